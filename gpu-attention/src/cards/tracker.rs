//! The card-state machine (no I/O, no clock of its own): up, down, rejoining, driven by
//! heartbeat outcomes, data-path failures and the outcome of loading a card's shard again.
//!
//! ```text
//!            missed (hard, or `misses_to_down` soft in a row) / data path failed
//!   Up ───────────────────────────────────────────────────────────────▶ Down
//!   ▲  │ heartbeat: restarted (new incarnation) or no longer serving us      │
//!   │  └──────────────────────────────┐                                     │ heartbeat answered
//!   │ rejoined                        ▼                                     ▼
//!   └──────────────────────────── Rejoining ◀──────────────────────────────┘
//!                                    │ rejoin failed
//!                                    └──────────────▶ Down
//! ```

use std::time::Instant;

use step::{CardHealth, CardState};

/// What one heartbeat learned from a card that answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heartbeat {
    /// The card process's incarnation (a new one after every restart).
    pub incarnation: u64,
    /// Whether the card still serves this attention node (has its inbox and worker).
    pub serves_us: bool,
}

/// What the shell must do after an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Nothing.
    None,
    /// Load (or attach to) the card's shard again, then report [`CardTracker::rejoined`] or
    /// [`CardTracker::rejoin_failed`].
    Rejoin,
}

#[derive(Debug, Clone)]
struct Card {
    state: CardState,
    reason: String,
    since: Instant,
    failures: u64,
    rejoins: u64,
    /// Soft misses in a row while up.
    misses: u32,
    /// The incarnation whose shard this node attached to, once known.
    incarnation: Option<u64>,
    /// Bumped on every change of state: a step that saw epoch `e` when it sent to the card
    /// knows the card went away (even if it is back) when the epoch moved.
    epoch: u64,
}

/// Every card's state, as one attention node sees it.
#[derive(Debug, Clone)]
pub struct CardTracker {
    cards: Vec<Card>,
    misses_to_down: u32,
}

impl CardTracker {
    /// `cards` cards, all up (the node has just attached to every one of them), marked down
    /// after `misses_to_down` heartbeats in a row went unanswered (at least 1).
    pub fn new(cards: usize, now: Instant, misses_to_down: u32) -> Self {
        CardTracker {
            cards: (0..cards)
                .map(|_| Card {
                    state: CardState::Up,
                    reason: String::new(),
                    since: now,
                    failures: 0,
                    rejoins: 0,
                    misses: 0,
                    incarnation: None,
                    epoch: 0,
                })
                .collect(),
            misses_to_down: misses_to_down.max(1),
        }
    }

    /// Number of cards.
    pub fn len(&self) -> usize {
        self.cards.len()
    }

    /// Whether there are no cards.
    pub fn is_empty(&self) -> bool {
        self.cards.is_empty()
    }

    /// Card `card`'s state.
    pub fn state(&self, card: usize) -> CardState {
        self.cards[card].state
    }

    /// Card `card`'s epoch (changes with every change of state).
    pub fn epoch(&self, card: usize) -> u64 {
        self.cards[card].epoch
    }

    /// Why card `card` is not up (empty while up).
    pub fn reason(&self, card: usize) -> &str {
        &self.cards[card].reason
    }

    /// Cards that are not up, ascending.
    pub fn not_up(&self) -> Vec<usize> {
        (0..self.cards.len())
            .filter(|&c| self.cards[c].state != CardState::Up)
            .collect()
    }

    fn enter(&mut self, card: usize, state: CardState, now: Instant, reason: String) {
        let c = &mut self.cards[card];
        if state == CardState::Down && c.state == CardState::Up {
            c.failures += 1;
        }
        c.state = state;
        c.reason = reason;
        c.since = now;
        c.misses = 0;
        c.epoch += 1;
    }

    /// Card `card` answered a heartbeat.
    pub fn heartbeat(&mut self, card: usize, now: Instant, beat: Heartbeat) -> Action {
        let c = &self.cards[card];
        match c.state {
            CardState::Up => {
                let restarted = c.incarnation.is_some_and(|i| i != beat.incarnation);
                if restarted || !beat.serves_us {
                    let why = if restarted {
                        "the card process restarted"
                    } else {
                        "the card no longer serves this node"
                    };
                    self.enter(card, CardState::Down, now, why.into());
                    self.enter(
                        card,
                        CardState::Rejoining,
                        now,
                        format!("{why}; loading its shard again"),
                    );
                    return Action::Rejoin;
                }
                let c = &mut self.cards[card];
                c.misses = 0;
                c.incarnation = Some(beat.incarnation);
                Action::None
            }
            CardState::Down => {
                let why = format!("answering again after: {}; loading its shard", c.reason);
                self.enter(card, CardState::Rejoining, now, why);
                Action::Rejoin
            }
            // A rejoin is under way; its outcome decides.
            CardState::Rejoining => Action::None,
        }
    }

    /// A heartbeat to card `card` failed: `hard` when the card could not be reached at all
    /// (connection refused or reset: the process is gone), soft when it timed out.
    pub fn missed(&mut self, card: usize, now: Instant, reason: &str, hard: bool) {
        let threshold = self.misses_to_down;
        let c = &mut self.cards[card];
        match c.state {
            CardState::Up => {
                c.misses += 1;
                if hard || c.misses >= threshold {
                    self.enter(card, CardState::Down, now, format!("heartbeat: {reason}"));
                }
            }
            CardState::Down => c.reason = format!("heartbeat: {reason}"),
            CardState::Rejoining => {}
        }
    }

    /// A step found card `card`'s data path broken (a write failed, or no reply came).
    pub fn data_failed(&mut self, card: usize, now: Instant, reason: &str) {
        if self.cards[card].state == CardState::Up {
            self.enter(card, CardState::Down, now, format!("data plane: {reason}"));
        }
    }

    /// Card `card` (incarnation `incarnation`) serves this node again.
    pub fn rejoined(&mut self, card: usize, now: Instant, incarnation: u64) {
        if self.cards[card].state == CardState::Rejoining {
            self.enter(card, CardState::Up, now, String::new());
            let c = &mut self.cards[card];
            c.rejoins += 1;
            c.incarnation = Some(incarnation);
        }
    }

    /// Loading card `card`'s shard again failed.
    pub fn rejoin_failed(&mut self, card: usize, now: Instant, reason: &str) {
        if self.cards[card].state == CardState::Rejoining {
            self.enter(
                card,
                CardState::Down,
                now,
                format!("rejoin failed: {reason}"),
            );
        }
    }

    /// Every card's state at `now`.
    pub fn snapshot(&self, now: Instant) -> Vec<CardHealth> {
        self.cards
            .iter()
            .enumerate()
            .map(|(i, c)| CardHealth {
                card: i,
                state: c.state,
                reason: c.reason.clone(),
                for_seconds: now.saturating_duration_since(c.since).as_secs_f64(),
                failures: c.failures,
                rejoins: c.rejoins,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::time::Duration;

    const BEAT: Heartbeat = Heartbeat {
        incarnation: 7,
        serves_us: true,
    };

    #[test]
    fn a_killed_card_goes_down_at_once_and_comes_back_through_rejoining() {
        let t0 = Instant::now();
        let mut t = CardTracker::new(2, t0, 2);
        assert_eq!(t.heartbeat(1, t0, BEAT), Action::None);
        t.missed(
            1,
            t0 + Duration::from_millis(250),
            "connection refused",
            true,
        );
        assert_eq!(t.state(1), CardState::Down);
        assert_eq!(t.not_up(), vec![1]);
        assert!(t.reason(1).contains("connection refused"));
        // Restarted: a new incarnation that does not serve us yet.
        let restarted = Heartbeat {
            incarnation: 8,
            serves_us: false,
        };
        assert_eq!(t.heartbeat(1, t0, restarted), Action::Rejoin);
        assert_eq!(t.state(1), CardState::Rejoining);
        assert_eq!(t.heartbeat(1, t0, restarted), Action::None);
        t.rejoined(1, t0 + Duration::from_secs(2), 8);
        assert_eq!(t.state(1), CardState::Up);
        let s = t.snapshot(t0 + Duration::from_secs(3));
        assert_eq!((s[1].failures, s[1].rejoins), (1, 1));
        assert!((s[1].for_seconds - 1.0).abs() < 1e-6);
        assert_eq!((s[0].failures, s[0].state), (0, CardState::Up));
    }

    #[test]
    fn a_stalled_card_needs_consecutive_misses_and_a_quick_restart_is_caught() {
        let t0 = Instant::now();
        let mut t = CardTracker::new(1, t0, 2);
        t.heartbeat(0, t0, BEAT);
        t.missed(0, t0, "timed out", false);
        assert_eq!(
            t.state(0),
            CardState::Up,
            "one slow heartbeat is not a failure"
        );
        assert_eq!(t.heartbeat(0, t0, BEAT), Action::None);
        t.missed(0, t0, "timed out", false);
        assert_eq!(
            t.state(0),
            CardState::Up,
            "an answer in between resets the count"
        );
        t.missed(0, t0, "timed out", false);
        assert_eq!(t.state(0), CardState::Down);
        // SIGCONT: the same incarnation answers; the node attaches again all the same.
        assert_eq!(t.heartbeat(0, t0, BEAT), Action::Rejoin);
        t.rejoin_failed(0, t0, "the card is loading");
        assert_eq!(t.state(0), CardState::Down);
        assert_eq!(t.heartbeat(0, t0, BEAT), Action::Rejoin);
        t.rejoined(0, t0, 7);
        // Restarted between two heartbeats: caught by the new incarnation.
        let fresh = Heartbeat {
            incarnation: 9,
            serves_us: true,
        };
        assert_eq!(t.heartbeat(0, t0, fresh), Action::Rejoin);
        assert!(t.reason(0).contains("restarted"));
        assert_eq!(t.snapshot(t0)[0].failures, 2);
    }

    #[derive(Debug, Clone)]
    enum Event {
        Beat { incarnation: u64, serves_us: bool },
        Missed { hard: bool },
        DataFailed,
        Rejoined,
        RejoinFailed,
    }

    fn event() -> impl Strategy<Value = Event> {
        prop_oneof![
            (0u64..3, any::<bool>()).prop_map(|(incarnation, serves_us)| Event::Beat {
                incarnation,
                serves_us
            }),
            any::<bool>().prop_map(|hard| Event::Missed { hard }),
            Just(Event::DataFailed),
            Just(Event::Rejoined),
            Just(Event::RejoinFailed),
        ]
    }

    proptest! {
        /// Whatever happens: a rejoin is asked for only when the card answered and was not up
        /// (or restarted); the card is up again only after a rejoin it was asked for; counters
        /// never go back; every change of state moves the epoch; and rejoins never outnumber
        /// failures.
        #[test]
        fn the_machine_only_moves_along_its_edges(events in proptest::collection::vec(event(), 1..60)) {
            let t0 = Instant::now();
            let mut t = CardTracker::new(1, t0, 2);
            let mut last = t.snapshot(t0)[0].clone();
            let mut epoch = t.epoch(0);
            for (i, e) in events.into_iter().enumerate() {
                let now = t0 + Duration::from_millis(i as u64);
                let before = t.state(0);
                let action = match e {
                    Event::Beat { incarnation, serves_us } => t.heartbeat(0, now, Heartbeat { incarnation, serves_us }),
                    Event::Missed { hard } => { t.missed(0, now, "x", hard); Action::None }
                    Event::DataFailed => { t.data_failed(0, now, "x"); Action::None }
                    Event::Rejoined => { t.rejoined(0, now, 1); Action::None }
                    Event::RejoinFailed => { t.rejoin_failed(0, now, "x"); Action::None }
                };
                let after = t.state(0);
                if action == Action::Rejoin {
                    prop_assert_eq!(after, CardState::Rejoining);
                    prop_assert_ne!(before, CardState::Rejoining);
                }
                if after == CardState::Up && before != CardState::Up {
                    prop_assert_eq!(before, CardState::Rejoining);
                }
                if after == CardState::Rejoining && before != CardState::Rejoining {
                    prop_assert_eq!(action, Action::Rejoin);
                }
                let now_s = t.snapshot(now)[0].clone();
                prop_assert!(now_s.failures >= last.failures && now_s.rejoins >= last.rejoins);
                prop_assert!(now_s.rejoins <= now_s.failures);
                prop_assert_eq!(now_s.state == CardState::Up, now_s.reason.is_empty());
                if after != before {
                    prop_assert!(t.epoch(0) > epoch);
                }
                epoch = t.epoch(0);
                last = now_s;
            }
        }
    }
}
