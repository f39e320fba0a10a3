//! When `afd up` starts a process that died again (no I/O, no clock of its own): at once the
//! first time, then after delays that double up to a ceiling, so a process that keeps dying
//! does not spin; a process that ran long enough before dying starts the count afresh. The
//! order in which roles are stopped, so that each drains while the ones it needs still run.

use std::time::Duration;

use super::plan::Role;

/// The back-off settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RestartPolicy {
    /// Delay before the second restart in a row (the first is at once).
    pub first_delay: Duration,
    /// Longest delay.
    pub max_delay: Duration,
    /// A process that ran this long before dying is restarted at once again.
    pub stable_after: Duration,
}

impl Default for RestartPolicy {
    fn default() -> Self {
        RestartPolicy {
            first_delay: Duration::from_millis(500),
            max_delay: Duration::from_secs(30),
            stable_after: Duration::from_secs(60),
        }
    }
}

/// One process's restarts in a row.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Backoff {
    /// Restarts since the process last ran `stable_after`.
    in_a_row: u32,
    /// Restarts in all.
    total: u64,
}

impl Backoff {
    /// The process died after running `ran`: how long to wait before starting it again.
    pub fn next(&mut self, policy: &RestartPolicy, ran: Duration) -> Duration {
        if ran >= policy.stable_after {
            self.in_a_row = 0;
        }
        let delay = match self.in_a_row {
            0 => Duration::ZERO,
            n => policy
                .first_delay
                .saturating_mul(1u32 << (n - 1).min(20))
                .min(policy.max_delay),
        };
        self.in_a_row += 1;
        self.total += 1;
        delay
    }

    /// Restarts so far.
    pub fn total(&self) -> u64 {
        self.total
    }
}

/// The stage in which a role is stopped: the frontend first (it drains its requests while the
/// attention nodes and cards still serve them), then the attention nodes, then the cards.
pub fn stop_stage(role: Role) -> usize {
    match role {
        Role::Frontend => 0,
        Role::Attention(_) => 1,
        Role::Card(_) => 2,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn delays_double_up_to_the_ceiling_and_reset_after_a_stable_run() {
        let p = RestartPolicy::default();
        let mut b = Backoff::default();
        let quick = Duration::from_secs(1);
        let delays: Vec<f64> = (0..9).map(|_| b.next(&p, quick).as_secs_f64()).collect();
        assert_eq!(delays, vec![0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]);
        assert_eq!(b.next(&p, Duration::from_secs(120)), Duration::ZERO);
        assert_eq!(b.next(&p, quick), p.first_delay);
        assert_eq!(b.total(), 11);
    }

    #[test]
    fn the_frontend_stops_before_the_nodes_and_the_nodes_before_the_cards() {
        assert!(stop_stage(Role::Frontend) < stop_stage(Role::Attention(0)));
        assert!(stop_stage(Role::Attention(3)) < stop_stage(Role::Card(0)));
    }

    proptest! {
        /// Delays never exceed the ceiling, never shrink while deaths come quickly, and are
        /// zero exactly after a stable run (or the first time).
        #[test]
        fn delays_are_bounded_and_monotone(runs in proptest::collection::vec(0u64..200, 1..40)) {
            let p = RestartPolicy::default();
            let mut b = Backoff::default();
            let mut last = Duration::ZERO;
            for (i, secs) in runs.into_iter().enumerate() {
                let ran = Duration::from_secs(secs);
                let d = b.next(&p, ran);
                prop_assert!(d <= p.max_delay);
                if ran >= p.stable_after || i == 0 {
                    prop_assert_eq!(d, Duration::ZERO);
                } else {
                    prop_assert!(d >= last);
                }
                last = d;
            }
        }
    }
}
