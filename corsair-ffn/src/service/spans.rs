//! When each message a card computed landed, got its CPU and was done: the cards' side of a
//! step's timeline, beside the attention node's spans (`afd generate --trace`).

use std::sync::Mutex;
use std::time::Instant;

/// Spans a log keeps at most; later ones are dropped (a trace is for a short run).
const MAX_SPANS: usize = 1 << 20;

/// One message's time on a card.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CardSpan {
    /// The card's index.
    pub card: usize,
    /// The message's step (the attention node's counter, as carried on the wire).
    pub step: u64,
    /// Its layer (`proto::data::LM_HEAD_LAYER` for the LM head).
    pub layer: u16,
    /// Its micro-batch.
    pub micro_batch: u8,
    /// When it landed in the card's inbox (JetStream's receive time).
    pub landed: Instant,
    /// When the card's worker took it up: its CPU turn granted, or at once for a message that
    /// takes no turn (the LM head's).
    pub started: Instant,
    /// When its reply was computed.
    pub ended: Instant,
}

/// A card host's spans, recorded by its workers while tracing is on.
#[derive(Debug, Default)]
pub(crate) struct SpanLog {
    spans: Mutex<Vec<CardSpan>>,
}

impl SpanLog {
    pub fn push(&self, span: CardSpan) {
        let mut spans = self.spans.lock().unwrap_or_else(|p| p.into_inner());
        if spans.len() < MAX_SPANS {
            spans.push(span);
        }
    }

    /// The spans recorded so far, leaving the log empty.
    pub fn take(&self) -> Vec<CardSpan> {
        std::mem::take(&mut *self.spans.lock().unwrap_or_else(|p| p.into_inner()))
    }
}
