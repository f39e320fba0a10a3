//! The clock serving reads, and what a modeled clock needs to know of a step.
//!
//! Everything that timestamps serving (the scheduler's `now`, a request's arrival, first token,
//! each token, the latency histograms) reads one [`Clock`]: wall time ([`WallClock`]), modeled
//! time in a virtual run that moves only when told ([`VirtualClock`], `afd emulate`), or modeled
//! time live, wall time slowed down `K` times ([`DilatedClock`], `afd serve --clock modeled`).
//! Every clock answers an [`Instant`], so code that subtracts instants works on any of them.
//! Tokens never depend on the clock.
//!
//! A modeled clock advances by what each step would take on the deployment's hardware: a
//! [`StepTimer`] says, from the step's batch and the routing the node made ([`StepRouting`]).

use std::fmt::Debug;
use std::sync::Mutex;
use std::sync::PoisonError;
use std::time::{Duration, Instant};

use crate::StepBatch;

/// A source of `now` for serving.
pub trait Clock: Send + Sync + Debug {
    /// Now, on this clock.
    fn now(&self) -> Instant;

    /// Wall seconds one second of this clock takes: 1 for wall time, `K` for modeled time
    /// dilated `K` times. A virtual clock, which does not follow the wall at all, says 0.
    fn dilation(&self) -> f64 {
        1.0
    }

    /// Whether this clock is modeled time rather than the wall's.
    fn is_modeled(&self) -> bool {
        false
    }
}

/// Wall time.
#[derive(Debug, Clone, Copy, Default)]
pub struct WallClock;

impl Clock for WallClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
}

/// Modeled time of a virtual run: it starts at its epoch and moves only by
/// [`VirtualClock::advance_to`], never backwards.
#[derive(Debug)]
pub struct VirtualClock {
    epoch: Instant,
    elapsed: Mutex<Duration>,
}

impl Default for VirtualClock {
    fn default() -> Self {
        Self::new()
    }
}

impl VirtualClock {
    /// A clock at zero.
    pub fn new() -> Self {
        VirtualClock {
            epoch: Instant::now(),
            elapsed: Mutex::new(Duration::ZERO),
        }
    }

    /// Time since the start.
    pub fn elapsed(&self) -> Duration {
        *self.elapsed.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Moves the clock to `t` after the start (a `t` in the past leaves it where it is).
    pub fn advance_to(&self, t: Duration) {
        let mut e = self.elapsed.lock().unwrap_or_else(PoisonError::into_inner);
        *e = (*e).max(t);
    }

    /// The instant `t` after the start.
    pub fn at(&self, t: Duration) -> Instant {
        self.epoch + t
    }

    /// Time from the start to `instant` (zero before it).
    pub fn since_start(&self, instant: Instant) -> Duration {
        instant.saturating_duration_since(self.epoch)
    }
}

impl Clock for VirtualClock {
    fn now(&self) -> Instant {
        self.epoch + self.elapsed()
    }

    fn dilation(&self) -> f64 {
        0.0
    }

    fn is_modeled(&self) -> bool {
        true
    }
}

/// Modeled time live: `K` wall seconds make one modeled second. `K` may change
/// ([`DilatedClock::set_dilation`]); the clock then goes on from where it was, at the new rate.
#[derive(Debug)]
pub struct DilatedClock {
    state: Mutex<Dilated>,
}

#[derive(Debug, Clone, Copy)]
struct Dilated {
    /// The wall instant of the last change of `k`.
    wall: Instant,
    /// What the clock read then.
    modeled: Instant,
    k: f64,
}

/// `k` when it is a dilation (finite, at least 1), else 1.
fn valid(k: f64) -> f64 {
    if k.is_finite() && k >= 1.0 { k } else { 1.0 }
}

impl DilatedClock {
    /// A clock starting now, `k` times slower than the wall (`k` >= 1 and finite, else 1).
    pub fn new(k: f64) -> Self {
        let now = Instant::now();
        DilatedClock {
            state: Mutex::new(Dilated {
                wall: now,
                modeled: now,
                k: valid(k),
            }),
        }
    }

    fn state(&self) -> Dilated {
        *self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// From now on `k` wall seconds make a modeled second; the clock reads on from where it is.
    pub fn set_dilation(&self, k: f64) {
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let wall = Instant::now();
        let gone = wall.saturating_duration_since(s.wall).div_f64(s.k);
        s.modeled += gone;
        s.wall = wall;
        s.k = valid(k);
    }

    /// The wall instant at which this clock reads `modeled` (at the current dilation).
    pub fn wall_at(&self, modeled: Instant) -> Instant {
        let s = self.state();
        s.wall + modeled.saturating_duration_since(s.modeled).mul_f64(s.k)
    }
}

impl Clock for DilatedClock {
    fn now(&self) -> Instant {
        let s = self.state();
        s.modeled
            + Instant::now()
                .saturating_duration_since(s.wall)
                .div_f64(s.k)
    }

    fn dilation(&self) -> f64 {
        self.state().k
    }

    fn is_modeled(&self) -> bool {
        true
    }
}

/// The experts each token of a step was routed to, layer by layer: what the node computed,
/// for a modeled clock to time the step's dispatch by.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepRouting {
    /// Experts per token.
    pub top_k: usize,
    /// Per decoder layer: `None` for a dense layer; for a MoE layer the chosen experts of
    /// every token of the step, `top_k` per token, tokens in batch order (entry by entry).
    pub layers: Vec<Option<Vec<u32>>>,
}

impl StepRouting {
    /// Tokens routed in `layer` (0 for a dense layer).
    pub fn tokens(&self, layer: usize) -> usize {
        match self.layers.get(layer) {
            Some(Some(e)) if self.top_k > 0 => e.len() / self.top_k,
            _ => 0,
        }
    }
}

/// What a modeled clock needs: how long a step would take on the deployment's hardware.
pub trait StepTimer: Send {
    /// The modeled duration of the step `batch` that the node just ran, with the routing it
    /// made (`None` where the node does not report routing), while `nodes_busy` attention nodes
    /// share the cards.
    fn step_duration(
        &mut self,
        batch: &StepBatch,
        routing: Option<&StepRouting>,
        nodes_busy: usize,
    ) -> Duration;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_virtual_clock_moves_only_forward_and_only_when_told() {
        let c = VirtualClock::new();
        let start = c.now();
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(c.now(), start, "a virtual clock does not follow the wall");
        c.advance_to(Duration::from_millis(5));
        assert_eq!(c.now() - start, Duration::from_millis(5));
        c.advance_to(Duration::from_millis(3));
        assert_eq!(c.elapsed(), Duration::from_millis(5), "never backwards");
        assert_eq!(
            c.since_start(c.at(Duration::from_secs(2))),
            Duration::from_secs(2)
        );
        assert!(c.is_modeled());
    }

    #[test]
    fn a_dilated_clock_runs_k_times_slower_than_the_wall() {
        let c = DilatedClock::new(20.0);
        let wall = Instant::now();
        let modeled = c.now();
        std::thread::sleep(Duration::from_millis(40));
        let wall_gone = wall.elapsed();
        let modeled_gone = c.now() - modeled;
        // 40+ ms of wall are 2+ ms modeled; allow the sleep to overshoot.
        assert!(
            modeled_gone >= Duration::from_millis(2)
                && modeled_gone <= wall_gone.div_f64(20.0) + Duration::from_millis(1),
            "wall {wall_gone:?}, modeled {modeled_gone:?}"
        );
        let later = modeled + Duration::from_millis(3);
        assert!(c.wall_at(later) >= c.wall_at(modeled) + Duration::from_millis(59));
        assert_eq!(c.dilation(), 20.0);
        assert_eq!(DilatedClock::new(0.5).dilation(), 1.0, "below 1 is refused");
    }

    #[test]
    fn changing_the_dilation_keeps_the_clock_continuous() {
        let c = DilatedClock::new(1.0);
        std::thread::sleep(Duration::from_millis(10));
        let before = c.now();
        c.set_dilation(1000.0);
        let after = c.now();
        // Continuous: no jump at the change, and slow afterwards.
        assert!(
            after >= before && after - before < Duration::from_millis(2),
            "{:?}",
            after - before
        );
        std::thread::sleep(Duration::from_millis(20));
        assert!(c.now() - after < Duration::from_millis(1));
        assert_eq!(c.dilation(), 1000.0);
    }

    #[test]
    fn routing_counts_tokens_per_layer() {
        let r = StepRouting {
            top_k: 2,
            layers: vec![Some(vec![0, 1, 2, 3, 4, 5]), None],
        };
        assert_eq!(r.tokens(0), 3);
        assert_eq!(r.tokens(1), 0);
        assert_eq!(r.tokens(7), 0);
    }
}
