//! A card that goes down during an emulation (`--fail-card I --at T`), on the timeline the
//! reliability path defines (DESIGN.md, "Cards that fail and come back"):
//!
//! - the card's process dies at `at`; the attention node's watcher, calling the card's health
//!   check every [`HEARTBEAT`], finds it unreachable at its next call and marks it down;
//! - a step that needs the card (every step does: each card holds LM-head rows, and its
//!   experts' rows) waits for its reply in [`STATE_POLL`] slices, looks at the board between
//!   them, and fails once the card is marked down: its requests are answered 503. When
//!   replicas cover the card's experts, the step runs once more on the cards that are up and
//!   nothing is lost (the node computes the card's LM-head rows itself);
//! - while the card is down and nothing covers it, every step fails at once and the router
//!   refuses new requests (503); covered, steps dispatch around it;
//! - with `--card-down-for D` the process is back `D` after `at`; the watcher sees it at its
//!   next call, sends its shard again, and the card loads it (its weights over the host link of
//!   its profile) before the node dispatches to it again.
//!
//! Not modeled: the extra cost of the node's own LM-head rows for a down card, and the time
//! a restarted card takes to compile its program (milliseconds against the load).

use std::time::Duration;

use crate::cost::StepModel;
use gpu_attention::dispatch::ExpertPlacement;

/// How often the watcher calls a card's health check (deploy's `watch.rs`).
pub const HEARTBEAT: Duration = Duration::from_millis(200);
/// How long a step waits for a reply before it looks at the cards' states again
/// (gpu-attention's `node/failover.rs`).
pub const STATE_POLL: Duration = Duration::from_millis(20);

/// A card failure to inject.
#[derive(Debug, Clone, PartialEq)]
pub struct CardFault {
    /// The card.
    pub card: usize,
    /// When its process dies (modeled time since the run began).
    pub at: Duration,
    /// How long until its process is back; `None`: it stays down.
    pub down_for: Option<Duration>,
}

/// The timeline of one card failure, and what it does to steps.
#[derive(Debug, Clone)]
pub struct FaultState {
    fault: CardFault,
    /// When the node marks the card down.
    detected: Duration,
    /// When the node dispatches to the card again (`None`: never).
    back: Option<Duration>,
    /// The placement without the card, when replicas cover it.
    covered: Option<ExpertPlacement>,
    /// Bytes the card loads when it comes back.
    shard_bytes: u64,
    /// Its host link, bytes per second.
    link_bandwidth: f64,
}

/// The first heartbeat at or after `t`.
fn next_heartbeat(t: Duration) -> Duration {
    let beats = t.as_nanos().div_ceil(HEARTBEAT.as_nanos());
    Duration::from_nanos((beats * HEARTBEAT.as_nanos()) as u64)
}

impl FaultState {
    /// The timeline of `fault` on the deployment of `model`.
    pub fn new(fault: CardFault, model: &StepModel) -> Self {
        let covered = model
            .placement()
            .and_then(|p| p.without(&[fault.card]).ok())
            .filter(|_| {
                model.cards().is_none_or(|c| {
                    (0..model.config().num_layers())
                        .all(|l| !c.dense_cards(l).contains(&fault.card))
                })
            });
        let (shard_bytes, link_bandwidth) = model
            .cards()
            .and_then(|c| c.programs().get(fault.card))
            .map_or((0, 1.0), |p| {
                (
                    corsair_ffn::report::sram_needed(p)
                        + corsair_ffn::report::lpddr_use(p)
                            .iter()
                            .map(|u| u.bytes)
                            .sum::<u64>(),
                    p.profile.memory.host_link_bandwidth.max(1.0),
                )
            });
        let detected = next_heartbeat(fault.at);
        let load = Duration::from_secs_f64(shard_bytes as f64 / link_bandwidth);
        let back = fault
            .down_for
            .map(|d| next_heartbeat(fault.at + d).max(detected) + load);
        FaultState {
            fault,
            detected,
            back,
            covered,
            shard_bytes,
            link_bandwidth,
        }
    }

    /// The fault.
    pub fn fault(&self) -> &CardFault {
        &self.fault
    }

    /// When the node marks the card down.
    pub fn detected(&self) -> Duration {
        self.detected
    }

    /// When the card serves again (`None`: never).
    pub fn back(&self) -> Option<Duration> {
        self.back
    }

    /// Whether replicas cover the card's experts.
    pub fn covered(&self) -> bool {
        self.covered.is_some()
    }

    /// Seconds the card takes to load its shard when it comes back.
    pub fn reload_seconds(&self) -> f64 {
        self.shard_bytes as f64 / self.link_bandwidth
    }

    /// Whether the card's process is dead at `t` (it may not be known yet).
    fn dead(&self, t: Duration) -> bool {
        t >= self.fault.at && self.back.is_none_or(|b| t < b)
    }

    /// Whether the node knows the card is down at `t`.
    pub fn known_down(&self, t: Duration) -> bool {
        t >= self.detected && self.back.is_none_or(|b| t < b)
    }

    /// Whether the router refuses new requests at `t` (the card is known down and uncovered).
    pub fn refuses(&self, t: Duration) -> bool {
        self.known_down(t) && self.covered.is_none()
    }

    /// The placement steps starting at `t` dispatch with (`None`: the deployment's own).
    pub fn placement_at(&self, t: Duration) -> Option<&ExpertPlacement> {
        if self.known_down(t) {
            self.covered.as_ref()
        } else {
            None
        }
    }

    /// What happens to a step that starts at `start` and would end at `end` on healthy cards.
    pub fn step_fate(&self, start: Duration, end: Duration) -> StepFate {
        if self.known_down(start) {
            return match self.covered {
                Some(_) => StepFate::Runs,
                None => StepFate::Fails { at: start },
            };
        }
        let hit = self.dead(start) || (start < self.fault.at && end > self.fault.at);
        if !hit {
            return StepFate::Runs;
        }
        // The card dies before the step's replies are all in: the step waits until the node
        // marks the card down and sees it at its next look at the board.
        let noticed = self.detected.max(start) + STATE_POLL;
        match self.covered {
            Some(_) => StepFate::RunsAgain { from: noticed },
            None => StepFate::Fails { at: noticed },
        }
    }

    /// The next instant after `t` at which the card's state changes, if any.
    pub fn next_change(&self, t: Duration) -> Option<Duration> {
        [Some(self.fault.at), Some(self.detected), self.back]
            .into_iter()
            .flatten()
            .filter(|&c| c > t)
            .min()
    }

    /// In words, for the error of a failed step.
    pub fn describe(&self) -> String {
        format!(
            "card {} is down (unreachable since {:.3} s); no other card holds its experts",
            self.fault.card,
            self.fault.at.as_secs_f64()
        )
    }
}

/// What a card failure does to one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepFate {
    /// It runs as timed.
    Runs,
    /// It fails at this instant; its requests are answered 503.
    Fails {
        /// When.
        at: Duration,
    },
    /// It fails when the card is marked down and runs once more, from this instant, on the
    /// cards that are up.
    RunsAgain {
        /// When the second run starts.
        from: Duration,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heartbeats_round_up() {
        assert_eq!(next_heartbeat(Duration::ZERO), Duration::ZERO);
        assert_eq!(next_heartbeat(Duration::from_millis(1)), HEARTBEAT);
        assert_eq!(
            next_heartbeat(Duration::from_millis(401)),
            Duration::from_millis(600)
        );
    }
}
