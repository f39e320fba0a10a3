//! What a step does about cards that are down: it dispatches to the live holders of each
//! expert (the replicas), computes a down card's LM-head rows from the node's own copy of the
//! LM head, fails at once (naming the card) when nothing covers a card it needs, and runs once
//! more when a card went down while the step waited for it and the others cover it.

use std::time::{Duration, Instant};

use step::{StepBatch, StepError, StepOutput};

use super::{CardLayout, DisaggregatedNode};
use crate::dispatch::ExpertPlacement;
use crate::fabric::Reply;

/// How long one wait for a reply lasts before the node looks at the cards' states again: the
/// longest a step keeps waiting for a card after it was marked down.
const STATE_POLL: Duration = Duration::from_millis(20);

/// The cards as the step under way uses them.
pub(super) struct ActiveCards {
    /// Who serves each expert (the layout's placement less the down cards).
    pub placement: ExpertPlacement,
    /// Each card's epoch when the step began.
    pub epochs: Vec<u64>,
    /// Cards that were down when the step began, ascending.
    pub down: Vec<usize>,
}

impl ActiveCards {
    /// Every card of `layout` up.
    pub fn all(layout: &CardLayout) -> Self {
        ActiveCards {
            placement: layout.placement.clone(),
            epochs: vec![0; layout.placement.cards()],
            down: Vec::new(),
        }
    }
}

impl DisaggregatedNode {
    /// Runs a step; when a card went down during it and the other cards cover it, once more.
    pub(super) fn step_with_failover(
        &mut self,
        batch: &StepBatch,
        two: bool,
    ) -> Result<StepOutput, StepError> {
        match self.run_step(batch, two) {
            Err(StepError::Card { card, message }) if self.covered_now(card) => {
                self.stats.retried_steps += 1;
                tracing::warn!(
                    card,
                    "card {card} failed during a step ({message}); running the step again on the \
                     cards that are up"
                );
                self.run_step(batch, two)
            }
            other => other,
        }
    }

    /// Whether `card` is down now and the cards that are up cover it.
    fn covered_now(&self, card: usize) -> bool {
        let live = self.board.live();
        live.down.contains(&card) && self.board.coverage(&live.down).is_ok()
    }

    /// Takes the cards' states for a new step: the inboxes of cards that came back, and the
    /// placement without the cards that are down. Fails when a down card is not covered.
    pub(super) fn begin_cards(&mut self) -> Result<(), StepError> {
        for (card, inbox) in self.board.take_new_inboxes() {
            self.fabric.replace_inbox(card, inbox);
        }
        // An expert move switches between two steps: this one dispatches with the new
        // placement and names the cards' new shard version in every message.
        let switched = match self.board.take_switch() {
            Some((version, placement)) => {
                self.layout.placement = placement;
                self.shard_version = version;
                true
            }
            None => false,
        };
        let live = self.board.live();
        if switched || live.down != self.active.down {
            let placement = self.board.coverage(&live.down).map_err(|(card, why)| {
                let (state, reason) = self.board.state(card);
                StepError::Card {
                    card,
                    message: format!("card {card} is {state} ({reason}); {why}"),
                }
            })?;
            if live.down.is_empty() {
                // A switch is logged by the board.
                if !switched {
                    tracing::info!("every card is up; dispatching to all of them again");
                }
            } else {
                tracing::warn!(down = ?live.down, "dispatching around the cards that are down");
            }
            self.active.placement = placement;
            self.active.down = live.down;
        }
        self.active.epochs = live.epochs;
        Ok(())
    }

    /// The step's error for card `card` if it left the state it had when the step began.
    fn gone(&self, card: usize) -> Option<StepError> {
        let epoch = *self.active.epochs.get(card)?;
        if !self.board.changed_since(card, epoch) {
            return None;
        }
        let (state, reason) = self.board.state(card);
        Some(StepError::Card {
            card,
            message: format!("card {card} is {state} ({reason})"),
        })
    }

    /// Writes a message to `card`; a failed write marks the card's data path down.
    pub(super) fn send_to(
        &mut self,
        card: usize,
        micro_batch: u8,
        message: Vec<u8>,
        immediate: proto::data::Immediate,
    ) -> Result<(), StepError> {
        if let Some(e) = self.gone(card) {
            return Err(e);
        }
        self.fabric
            .send(card, micro_batch, message, immediate)
            .inspect_err(|e| self.note_data_failure(e))
    }

    fn note_data_failure(&self, e: &StepError) {
        if let StepError::Card { card, message } = e {
            self.board.data_failed(*card, message);
        }
    }

    /// The next reply, while `waiting` (the cards still owed a reply) are waited for: fails
    /// at once when one of them goes down, and after the reply timeout otherwise.
    pub(super) fn next_reply(&mut self, waiting: &[usize]) -> Result<Reply, StepError> {
        let deadline = Instant::now() + self.node.reply_timeout;
        loop {
            if let Some(e) = waiting.iter().find_map(|&c| self.gone(c)) {
                return Err(e);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.fabric.recv(left.min(STATE_POLL)) {
                Ok(reply) => return Ok(reply),
                Err(StepError::NoReply { .. }) if !left.is_zero() => continue,
                Err(StepError::NoReply { reason, .. }) => {
                    let card = waiting.first().copied().unwrap_or(0);
                    let e = StepError::Card {
                        card,
                        message: format!("no reply within {:?}: {reason}", self.node.reply_timeout),
                    };
                    self.note_data_failure(&e);
                    return Err(e);
                }
                Err(e) => {
                    self.note_data_failure(&e);
                    return Err(e);
                }
            }
        }
    }

    /// The cards holding vocabulary rows that are down now (their rows come from the node).
    pub(super) fn lm_cards_down(&self) -> Vec<usize> {
        self.active
            .down
            .iter()
            .copied()
            .filter(|&c| self.layout.lm_head.get(c).is_some_and(|r| !r.is_empty()))
            .collect()
    }

    /// Fills `logits` (`[rows, vocab]`, from normed rows `normed`) with the vocabulary rows of
    /// the LM-head cards that are down, computed here.
    pub(super) fn node_lm_rows(&self, normed: &[f32], rows: usize, logits: &mut [Vec<f32>]) {
        for card in self.lm_cards_down() {
            let range = self.layout.lm_head[card].clone();
            let (start, len) = (range.start as usize, range.len());
            let head = self.lm_weight.select_rows(start, 1, len);
            let mut out = vec![0f32; rows * len];
            model::kernels::matmul(normed, rows, &head, None, &mut out);
            for (r, row) in logits.iter_mut().enumerate().take(rows) {
                row[start..start + len].copy_from_slice(&out[r * len..(r + 1) * len]);
            }
        }
    }

    /// Forgets what a failed step recorded for its sequences (their length and tokens), so the
    /// router may run it again or free them.
    pub(super) fn forget_tokens(&mut self, batch: &StepBatch) {
        for e in &batch.entries {
            if e.starts_sequence() {
                self.seq_lens.remove(&e.seq);
                self.histories.remove(&e.seq);
            } else {
                self.seq_lens.insert(e.seq, e.start);
                if let Some(h) = self.histories.get_mut(&e.seq) {
                    h.truncate(e.start);
                }
            }
        }
    }
}
