//! What an attention node knows about its cards, shared between the node's step thread and the
//! shell that watches the cards (heartbeats over the control plane, loading a returning card's
//! shard again).
//!
//! [`tracker`] is the pure state machine; [`CardBoard`] wraps it with a clock, the cards'
//! current inboxes (a card that comes back has a new one) and the layout, to say whether the
//! node can serve with the cards that are up (replicas covering a down card's experts, the
//! node's own copy of the LM head covering its vocabulary rows).

pub mod tracker;

use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use jetstream::RegionDescriptor;
use step::{CardState, HealthSource, NodeHealth};

pub use tracker::{Action, CardTracker, Heartbeat};

use crate::dispatch::ExpertPlacement;
use crate::node::CardLayout;

/// Soft heartbeat misses in a row that mark a card down (see [`CardBoard::new`]).
pub const MISSES_TO_DOWN: u32 = 2;

/// The cards' states at one moment, as a step uses them.
#[derive(Debug, Clone, PartialEq)]
pub struct LiveCards {
    /// `epochs[card]`: the card's epoch then (see [`CardBoard::changed_since`]).
    pub epochs: Vec<u64>,
    /// Cards not up, ascending.
    pub down: Vec<usize>,
}

struct Inner {
    tracker: CardTracker,
    /// A card's new inbox, until the node's fabric takes it.
    new_inboxes: Vec<Option<RegionDescriptor>>,
    /// The layout the node dispatches with, and the card shard version it names.
    layout: CardLayout,
    shard_version: u32,
    /// A placement to switch to at the node's next step (an expert move), with its version.
    pending: Option<(u32, ExpertPlacement)>,
}

/// The shared state of one attention node's cards.
pub struct CardBoard {
    inner: Mutex<Inner>,
    cards: usize,
}

impl std::fmt::Debug for CardBoard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CardBoard")
            .field("down", &self.lock().tracker.not_up())
            .finish()
    }
}

impl CardBoard {
    /// Every card of `layout` up.
    pub fn new(layout: &CardLayout) -> Self {
        let cards = layout.placement.cards();
        CardBoard {
            inner: Mutex::new(Inner {
                tracker: CardTracker::new(cards, Instant::now(), MISSES_TO_DOWN),
                new_inboxes: vec![None; cards],
                layout: layout.clone(),
                shard_version: 0,
                pending: None,
            }),
            cards,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Number of cards.
    pub fn cards(&self) -> usize {
        self.cards
    }

    /// Asks the node to dispatch with `placement`, naming card shard version `version`, from
    /// its next step on (an expert move: every card holds that version already). Replaces a
    /// switch not yet taken.
    pub fn switch_placement(
        &self,
        version: u32,
        placement: ExpertPlacement,
    ) -> Result<(), crate::dispatch::PlacementError> {
        if placement.cards() != self.cards {
            return Err(crate::dispatch::PlacementError::Cards {
                placement: placement.cards(),
                cards: self.cards,
            });
        }
        self.lock().pending = Some((version, placement));
        Ok(())
    }

    /// The switch asked for, if any: the board dispatches with it from now on (the node takes
    /// it between two steps).
    pub fn take_switch(&self) -> Option<(u32, ExpertPlacement)> {
        let mut inner = self.lock();
        let (version, placement) = inner.pending.take()?;
        inner.layout.placement = placement.clone();
        inner.shard_version = version;
        tracing::info!(
            version,
            "experts moved: dispatching with shard version {version}"
        );
        Some((version, placement))
    }

    /// The card shard version the node dispatches with (the last switch it took).
    pub fn shard_version(&self) -> u32 {
        self.lock().shard_version
    }

    /// The placement the node dispatches with when every card is up.
    pub fn placement(&self) -> ExpertPlacement {
        self.lock().layout.placement.clone()
    }

    /// Card `card` answered a heartbeat; [`Action::Rejoin`] asks the caller to load its shard.
    pub fn heartbeat(&self, card: usize, beat: Heartbeat) -> Action {
        let action = self.lock().tracker.heartbeat(card, Instant::now(), beat);
        if action == Action::Rejoin {
            tracing::warn!(card, "card {card} answers again; loading its shard");
        }
        action
    }

    /// A heartbeat to card `card` failed (`hard`: unreachable; soft: timed out).
    pub fn missed(&self, card: usize, reason: &str, hard: bool) {
        let mut inner = self.lock();
        let was = inner.tracker.state(card);
        inner.tracker.missed(card, Instant::now(), reason, hard);
        if was == CardState::Up && inner.tracker.state(card) == CardState::Down {
            tracing::error!(card, "card {card} is down: heartbeat: {reason}");
        }
    }

    /// A step found card `card`'s data path broken.
    pub fn data_failed(&self, card: usize, reason: &str) {
        let mut inner = self.lock();
        if inner.tracker.state(card) == CardState::Up {
            tracing::error!(card, "card {card} is down: data plane: {reason}");
        }
        inner.tracker.data_failed(card, Instant::now(), reason);
    }

    /// Card `card` (incarnation `incarnation`) serves this node again, from the inbox `inbox`.
    pub fn rejoined(&self, card: usize, incarnation: u64, inbox: RegionDescriptor) {
        let mut inner = self.lock();
        if inner.tracker.state(card) != CardState::Rejoining {
            return;
        }
        inner.new_inboxes[card] = Some(inbox);
        inner.tracker.rejoined(card, Instant::now(), incarnation);
        tracing::warn!(card, "card {card} is back");
    }

    /// Loading card `card`'s shard again failed.
    pub fn rejoin_failed(&self, card: usize, reason: &str) {
        tracing::warn!(card, "card {card} could not rejoin: {reason}");
        self.lock()
            .tracker
            .rejoin_failed(card, Instant::now(), reason);
    }

    /// Inboxes of cards that came back since the last call, for the node's fabric.
    pub fn take_new_inboxes(&self) -> Vec<(usize, RegionDescriptor)> {
        let mut inner = self.lock();
        inner
            .new_inboxes
            .iter_mut()
            .enumerate()
            .filter_map(|(card, slot)| slot.take().map(|d| (card, d)))
            .collect()
    }

    /// The cards' states now.
    pub fn live(&self) -> LiveCards {
        let inner = self.lock();
        let t = &inner.tracker;
        LiveCards {
            epochs: (0..t.len()).map(|c| t.epoch(c)).collect(),
            down: t.not_up(),
        }
    }

    /// Whether card `card` left the state it had at `epoch` (went down, even if it is back).
    pub fn changed_since(&self, card: usize, epoch: u64) -> bool {
        self.lock().tracker.epoch(card) != epoch
    }

    /// Card `card`'s state and why it is not up.
    pub fn state(&self, card: usize) -> (CardState, String) {
        let inner = self.lock();
        (
            inner.tracker.state(card),
            inner.tracker.reason(card).to_owned(),
        )
    }

    /// The placement to dispatch with while the cards in `down` are down, or why the node
    /// cannot serve without them (see [`CardLayout::coverage`]).
    pub fn coverage(&self, down: &[usize]) -> Result<ExpertPlacement, (usize, String)> {
        self.lock().layout.coverage(down)
    }
}

impl HealthSource for CardBoard {
    fn health(&self) -> NodeHealth {
        let (cards, down) = {
            let inner = self.lock();
            (
                inner.tracker.snapshot(Instant::now()),
                inner.tracker.not_up(),
            )
        };
        let unserved = if down.is_empty() {
            None
        } else {
            self.coverage(&down).err().map(|(card, why)| {
                let state = &cards[card];
                format!(
                    "card {card} is {} ({}); {why}; new requests are refused until it is back",
                    state.state, state.reason
                )
            })
        };
        NodeHealth { cards, unserved }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ops::Range;

    fn layout(replicated: bool) -> CardLayout {
        let card_experts: Vec<Vec<Vec<u32>>> = (0..2u32)
            .map(|c| {
                if replicated {
                    vec![(0..4).collect()]
                } else {
                    vec![(c * 2..c * 2 + 2).collect()]
                }
            })
            .collect();
        CardLayout {
            placement: ExpertPlacement::new(1, 4, &[true], &card_experts).unwrap(),
            dense_cards: Vec::new(),
            lm_head: vec![0..8u32, 8..16] as Vec<Range<u32>>,
        }
    }

    fn inbox() -> RegionDescriptor {
        RegionDescriptor {
            node: "card-1".into(),
            id: 3,
            len: 64,
            key: 9,
        }
    }

    #[test]
    fn a_down_card_without_cover_makes_the_node_refuse_and_names_the_card() {
        let board = CardBoard::new(&layout(false));
        assert_eq!(board.health().unserved, None);
        let before = board.live();
        board.missed(1, "connection refused", true);
        assert!(board.changed_since(1, before.epochs[1]));
        assert!(!board.changed_since(0, before.epochs[0]));
        let h = board.health();
        let why = h.unserved.unwrap();
        assert!(why.contains("card 1 is down"), "{why}");
        assert!(why.contains("connection refused"), "{why}");
        assert_eq!(h.cards[1].failures, 1);
        assert_eq!(board.live().down, vec![1]);
    }

    #[test]
    fn replicas_keep_the_node_serving_and_a_rejoin_hands_over_the_new_inbox() {
        let board = CardBoard::new(&layout(true));
        board.data_failed(1, "peer card-1 is gone");
        assert_eq!(board.health().unserved, None);
        assert!(board.coverage(&[1]).is_ok());
        let beat = Heartbeat {
            incarnation: 2,
            serves_us: false,
        };
        assert_eq!(board.heartbeat(1, beat), Action::Rejoin);
        assert_eq!(board.state(1).0, CardState::Rejoining);
        board.rejoined(1, 2, inbox());
        assert_eq!(board.take_new_inboxes(), vec![(1, inbox())]);
        assert!(board.take_new_inboxes().is_empty());
        let h = board.health();
        assert_eq!((h.cards[1].state, h.cards[1].rejoins), (CardState::Up, 1));
    }
}
