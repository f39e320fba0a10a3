//! What can go wrong in a step, as types: the batch itself ([`InvalidStep`], what the router or a
//! caller sent wrong), a card, the wait for replies, the model computation, or the node itself.

use crate::SeqId;

/// Errors of a step. The router treats them as fatal for the step's sequences.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    /// The batch itself is inconsistent, or the node cannot take it as it is set up.
    #[error("invalid step: {0}")]
    Invalid(#[from] InvalidStep),
    /// A card did not answer in time or went away.
    #[error("card {card} failed: {message}")]
    Card {
        /// The card's index.
        card: usize,
        /// What happened.
        message: String,
    },
    /// No card replied within the wait: which card is at fault is for the caller, who knows whom
    /// it waits for, to say (it reports [`StepError::Card`] for them).
    #[error("no card replied within {waited:?}: {reason}")]
    NoReply {
        /// How long the node waited.
        waited: std::time::Duration,
        /// What the transport said.
        reason: String,
    },
    /// The model computation could not produce what the step asked for.
    #[error("model error: {0}")]
    Model(#[from] ModelFailure),
    /// A tensor operation of the model computation failed (a model or candle error, kept as
    /// the cause; `step` names no numerics crate, so it is boxed).
    #[error("model error: {0}")]
    Compute(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The node is unreachable (remote nodes).
    #[error("attention node at {address} unavailable: {reason}")]
    Unavailable {
        /// Where it was reached for.
        address: String,
        /// What the connection said.
        reason: String,
    },
}

impl StepError {
    /// A failed tensor operation of the model computation, keeping the error as the cause.
    pub fn compute(e: impl std::error::Error + Send + Sync + 'static) -> Self {
        StepError::Compute(Box::new(e))
    }
}

/// What the model computation could not produce.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelFailure {
    /// A constrained row's mask never came, or its grammar failed (the reason is the grammar
    /// engine's).
    #[error("the allowed tokens of sequence {seq}: {reason}")]
    Mask {
        /// The sequence.
        seq: SeqId,
        /// What the grammar side said.
        reason: String,
    },
    /// A row that asked for a token got none.
    #[error("no token was sampled for sequence {seq}")]
    NoToken {
        /// The sequence.
        seq: SeqId,
    },
    /// Prompt tokens asked to be scored were not.
    #[error("the prompt tokens of sequence {seq} were not all scored")]
    Unscored {
        /// The sequence.
        seq: SeqId,
    },
    /// A full-logits round that came back short.
    #[error("the cards returned {filled} of {vocab} logits for a full-logits row")]
    PartialLogits {
        /// Logits received.
        filled: usize,
        /// Logits a row has.
        vocab: usize,
    },
    /// A part of the model the computation needs is missing (a router of an MoE layer, its
    /// routing, the inputs the device computed).
    #[error("{0}")]
    Missing(&'static str),
    /// The model could not be prepared on its device.
    #[error("preparing the model on {device}: {reason}")]
    Prepare {
        /// The device.
        device: String,
        /// What failed.
        reason: String,
    },
    /// What a remote node reported (its cause crosses the wire as text).
    #[error("{0}")]
    Remote(String),
}

/// Why a node refuses a step batch: what in it is inconsistent with itself or with the node.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidStep {
    /// A sequence has two entries.
    #[error("sequence {seq} appears twice in one step")]
    DuplicateSequence {
        /// The sequence.
        seq: SeqId,
    },
    /// An entry brings no token.
    #[error("sequence {seq} has no new tokens")]
    NoNewTokens {
        /// The sequence.
        seq: SeqId,
    },
    /// An entry does not start where the node's cache of the sequence ends.
    #[error("sequence {seq} starts at {start} but {cached} of its tokens are cached")]
    StartMismatch {
        /// The sequence.
        seq: SeqId,
        /// Where the entry starts.
        start: usize,
        /// Tokens the node holds for it.
        cached: usize,
    },
    /// A request to generate from nothing.
    #[error("request {request} has an empty prompt")]
    EmptyPrompt {
        /// Its index among the requests.
        request: usize,
    },
    /// A block table too short for the entry's tokens.
    #[error("sequence {seq} needs {needed} KV blocks for {tokens} tokens, got {got}")]
    TooFewBlocks {
        /// The sequence.
        seq: SeqId,
        /// Blocks its tokens need.
        needed: usize,
        /// Its tokens after the step.
        tokens: usize,
        /// Blocks in its table.
        got: usize,
    },
    /// A block id past the cache.
    #[error("sequence {seq} uses KV block {block}, the cache has {num_blocks}")]
    UnknownBlock {
        /// The sequence.
        seq: SeqId,
        /// The block.
        block: u32,
        /// Blocks in the cache.
        num_blocks: usize,
    },
    /// A token id past the vocabulary (a new token, or a prompt token to score).
    #[error("token id {token} is out of range: the vocabulary has {vocab} entries")]
    TokenOutOfRange {
        /// The token.
        token: u32,
        /// Entries in the vocabulary.
        vocab: usize,
    },
    /// A cached prefix sent to a node that keeps each sequence's keys and values apart.
    #[error(
        "sequence {seq} comes with a cached prefix, but this node keeps each sequence's keys and \
         values apart and cannot share blocks"
    )]
    BlocksNotShared {
        /// The sequence.
        seq: SeqId,
    },
    /// A cached prefix that is not whole blocks at the start of the table, or that the entry
    /// does not start after.
    #[error(
        "sequence {seq}: a cached prefix of {tokens} tokens starting a step at {start} is not \
         whole blocks of {block_size} tokens of its table"
    )]
    CachedPrefixNotWholeBlocks {
        /// The sequence.
        seq: SeqId,
        /// Tokens in the prefix.
        tokens: usize,
        /// Where the entry starts.
        start: usize,
        /// Tokens per block.
        block_size: usize,
    },
    /// A cached prefix naming a block the node never filled.
    #[error(
        "sequence {seq}: its cached prefix names KV block {block}, which this node has not \
         filled (did the node restart?); the router forgets its prefix cache after a failed step"
    )]
    CachedBlockNotFilled {
        /// The sequence.
        seq: SeqId,
        /// The block.
        block: u32,
    },
    /// A cached prefix whose tokens are not those the node holds there.
    #[error("sequence {seq}: cached position {position} holds token {held}, not {token}")]
    CachedTokenMismatch {
        /// The sequence.
        seq: SeqId,
        /// The position.
        position: usize,
        /// The token the node holds there.
        held: u32,
        /// The token the prefix says.
        token: u32,
    },
    /// A step that writes a block another live sequence holds.
    #[error("block {block} of live sequence {holder} written by sequence {seq}")]
    BlockOfAnother {
        /// The sequence writing.
        seq: SeqId,
        /// The block.
        block: u32,
        /// The sequence holding it.
        holder: SeqId,
    },
    /// More alternatives per token than a node returns.
    #[error("top_logprobs {asked} exceeds {max}")]
    TooManyTopLogprobs {
        /// Asked for.
        asked: usize,
        /// The most a node returns.
        max: usize,
    },
    /// Prompt scoring that does not fit its entry: more (or no) scores than new tokens.
    #[error("sequence {seq} asks to score {scored} prompt tokens after {new_tokens} new tokens")]
    PromptScoring {
        /// The sequence.
        seq: SeqId,
        /// Prompt tokens to score.
        scored: usize,
        /// New tokens of the entry.
        new_tokens: usize,
    },
    /// A micro-batch larger than the node's buffers.
    #[error("a micro-batch of {rows} tokens exceeds the node's max_tokens {max_tokens}")]
    TooManyTokens {
        /// Tokens in the micro-batch.
        rows: usize,
        /// The node's limit.
        max_tokens: usize,
    },
    /// A message larger than the card's inbox slot.
    #[error("a {bytes}-byte message does not fit the {slot}-byte inbox slot (raise max_tokens)")]
    MessageTooLarge {
        /// The message.
        bytes: usize,
        /// The slot.
        slot: usize,
    },
    /// A structured-output mask of the wrong size (a step from the wire).
    #[error(
        "sequence {seq}: the allowed-token mask over {tokens} tokens must be {expected} bytes, \
         got {bytes}"
    )]
    MalformedMask {
        /// The sequence.
        seq: SeqId,
        /// Tokens the mask covers.
        tokens: usize,
        /// Bytes it must have.
        expected: usize,
        /// Bytes it has.
        bytes: usize,
    },
    /// The node's settings or environment cannot run it (a layout that does not match the
    /// fabric, a device that cannot open, threads that cannot start, an option for another
    /// device); the text says what to change.
    #[error("{0}")]
    Setup(String),
    /// What a remote node reported (its cause crosses the wire as text).
    #[error("{0}")]
    Remote(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The typed causes read as the messages users saw before, and convert into `StepError`.
    #[test]
    fn causes_say_what_was_wrong() {
        let e: StepError = InvalidStep::StartMismatch {
            seq: 3,
            start: 4,
            cached: 2,
        }
        .into();
        assert_eq!(
            e.to_string(),
            "invalid step: sequence 3 starts at 4 but 2 of its tokens are cached"
        );
        let shared = InvalidStep::BlocksNotShared { seq: 9 }.to_string();
        assert!(shared.contains("keys and values apart"), "{shared}");
        assert!(!shared.contains("  "), "no stray spaces: {shared:?}");
        let prefix = InvalidStep::CachedPrefixNotWholeBlocks {
            seq: 1,
            tokens: 6,
            start: 6,
            block_size: 4,
        }
        .to_string();
        assert!(!prefix.contains("  "), "{prefix:?}");
        assert!(matches!(
            e,
            StepError::Invalid(InvalidStep::StartMismatch { seq: 3, .. })
        ));
    }
}
