//! The step API of one attention node: what the router drives, in process or over tonic.
//!
//! Owns the types a step is made of ([`StepBatch`], [`StepEntry`], [`StepOutput`], ...) and what
//! can go wrong in one ([`StepError`], with the typed causes of a refused batch: [`InvalidStep`]), the
//! [`AttentionNode`] trait, the micro-batch setting ([`MicroBatches`]), the [`Clock`] serving
//! reads and what a modeled clock needs of a step ([`clock`]), [`compute::on_own_pool`], which
//! puts the thread that steps a node at the head of its own compute pool, and
//! [`compute::run_on_sleeping`], which hands work to another pool while that thread sleeps,
//! and [`replicas`], the rule that splits a replicated expert's rows over its copies (the
//! node's dispatcher applies it, the planner's model of a step mirrors it).
//!
//! Must not: depend on the numerics or the transport (candle, quinn, tonic) or on any afd crate
//! but `model`'s light part (its sampling parameters), so that the router and the HTTP server
//! build and test without them. The concrete nodes live in `gpu-attention`.
//!
//! The router owns scheduling and KV-block allocation (as vLLM's scheduler does); the node owns
//! the KV cache memory and the model math. Each step the router sends, per scheduled sequence,
//! the new tokens (a prompt chunk, or the token sampled last step), where they start, the
//! sequence's block table, and whether to sample after them. The node appends the tokens'
//! keys and values into the given blocks, runs every layer (dispatching experts to the cards),
//! and returns one sampled token (with logprobs) per sequence that asked for one.

pub mod clock;
pub mod compute;
pub mod constraint;
mod error;
pub mod health;
pub mod prompt_logprobs;
pub mod replicas;

pub use clock::{Clock, StepRouting, StepTimer, WallClock};
pub use constraint::{AllowedTokens, Constraint, MaskJob, TokenConstraint, TokenMask};
pub use error::{InvalidStep, ModelFailure, StepError};
pub use health::{CardHealth, CardState, HealthSource, NodeHealth};
pub use prompt_logprobs::{PromptLogprobs, PromptScoring, ScoredToken};

use model::sampling::SamplingParams;

/// Most alternatives a node returns per token, sampled or scored (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// A sequence, as the router names it (unique per attention node while it is running).
pub type SeqId = u64;

/// Repetition penalties (vLLM semantics): `presence` and `frequency` apply to tokens generated
/// so far; `repetition` divides positive logits (multiplies negative ones) of every token seen
/// in the prompt or the output. The node tracks each sequence's tokens itself.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Penalties {
    /// Subtracted once from the logit of every token already generated.
    pub presence: f32,
    /// Subtracted per occurrence from the logit of every token already generated.
    pub frequency: f32,
    /// > 1 discourages tokens already seen anywhere in the sequence; 1 disables.
    pub repetition: f32,
}

impl Default for Penalties {
    fn default() -> Self {
        Penalties {
            presence: 0.0,
            frequency: 0.0,
            repetition: 1.0,
        }
    }
}

impl Penalties {
    /// Whether any penalty is active.
    pub fn is_active(&self) -> bool {
        self.presence != 0.0 || self.frequency != 0.0 || self.repetition != 1.0
    }
}

/// How to pick the token that follows a sequence's last new token.
#[derive(Debug, Clone, PartialEq)]
pub struct SampleRequest {
    /// Temperature, top-p, top-k, min-p and seed.
    pub params: SamplingParams,
    /// Repetition penalties.
    pub penalties: Penalties,
    /// Whether the sampled token's log-probability is wanted (OpenAI `logprobs`). Without it
    /// (and without `top_logprobs`), the LM-head shards skip their log-sum-exps and
    /// [`SampledToken::logprob`] may be NaN.
    pub logprobs: bool,
    /// How many most likely alternatives to return with their logprobs (0: none; at most 20).
    pub top_logprobs: usize,
    /// The only tokens it may sample (structured output), computed while the step runs; `None`
    /// for any token. The logprobs stay those of the unconstrained distribution.
    pub allowed: Option<AllowedTokens>,
}

impl SampleRequest {
    /// Whether any log-probability is wanted: the token's or its alternatives'.
    pub fn wants_logprobs(&self) -> bool {
        self.logprobs || self.top_logprobs > 0
    }

    /// The mask this row samples under, waited for (up to [`constraint::MASK_WAIT`]): `None`
    /// for a row without a constraint. The router fills the handle on another thread while
    /// the step runs, so a node waits only when it reaches the row; a mask that never came
    /// (or whose grammar failed) fails the step rather than sampling a token the grammar would
    /// refuse. `seq` names the sequence in the error.
    pub fn allowed_mask(&self, seq: SeqId) -> Result<Option<std::sync::Arc<TokenMask>>, StepError> {
        match &self.allowed {
            None => Ok(None),
            Some(handle) => handle.wait(constraint::MASK_WAIT).map(Some).map_err(|e| {
                StepError::Model(ModelFailure::Mask {
                    seq,
                    reason: e.to_string(),
                })
            }),
        }
    }
}

/// One sequence's part of a step.
#[derive(Debug, Clone, PartialEq)]
pub struct StepEntry {
    /// The sequence.
    pub seq: SeqId,
    /// New tokens: a prompt chunk, or the token sampled at the previous step.
    pub tokens: Vec<u32>,
    /// Position of the first new token (tokens of this sequence already in the cache).
    pub start: usize,
    /// How many of the sequence's tokens are prompt (for penalties: the rest are output).
    pub prompt_len: usize,
    /// Physical KV blocks of the sequence, in order; enough for `start + tokens.len()` tokens.
    pub block_table: Vec<u32>,
    /// Sample after the last new token (false for prompt chunks that are not the last one).
    pub sample: Option<SampleRequest>,
    /// On a sequence's first step after a prefix-cache hit: its first `start` tokens, whose
    /// keys and values other sequences wrote into the first blocks of `block_table` (full
    /// blocks, shared and never written again). Empty otherwise.
    pub cached_prefix: Vec<u32>,
    /// Score the prompt tokens that follow the new tokens (prompt logprobs), or `None`.
    pub prompt_logprobs: Option<PromptScoring>,
}

impl StepEntry {
    /// Whether this entry starts its sequence on the node: from position 0, or after a cached
    /// prefix. The node then forgets whatever it kept under the id.
    pub fn starts_sequence(&self) -> bool {
        self.start == self.cached_prefix.len()
    }
}

/// One step of one attention node.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepBatch {
    /// The scheduled sequences; each appears at most once.
    pub entries: Vec<StepEntry>,
}

/// A sampled token.
#[derive(Debug, Clone, PartialEq)]
pub struct SampledToken {
    /// The sequence.
    pub seq: SeqId,
    /// The token.
    pub token: u32,
    /// Its log-probability under the model's distribution (temperature 1, no filters, no
    /// penalties), as vLLM reports it; NaN where the request wanted no logprobs and the node
    /// skipped them.
    pub logprob: f32,
    /// The most likely tokens and their log-probabilities, best first (`top_logprobs` of them).
    pub top_logprobs: Vec<(u32, f32)>,
}

/// What a step returns.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepOutput {
    /// One entry per [`StepEntry`] that asked to sample, in batch order.
    pub sampled: Vec<SampledToken>,
    /// One entry per [`StepEntry`] that asked for prompt logprobs, in batch order.
    pub prompt_logprobs: Vec<PromptLogprobs>,
}

/// How a step is cut into micro-batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MicroBatches {
    /// For steps of two or more sequences, whichever of one and two the node has measured to
    /// be faster for steps of that size (it tries both; gpu-attention's `node/overlap.rs`), else one.
    #[default]
    Auto,
    /// Never split.
    One,
    /// Split into two whenever there are two or more sequences.
    Two,
}

impl std::str::FromStr for MicroBatches {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(MicroBatches::Auto),
            "1" => Ok(MicroBatches::One),
            "2" => Ok(MicroBatches::Two),
            other => Err(format!("--micro-batches takes 1, 2 or auto, not `{other}`")),
        }
    }
}

/// The KV cache geometry of a node, for the router's block accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvCapacity {
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks in the cache (ids `0..num_blocks`).
    pub num_blocks: usize,
}

/// One attention node, driven by the router one step at a time.
pub trait AttentionNode: Send {
    /// The node's KV cache geometry.
    fn kv_capacity(&self) -> KvCapacity;

    /// Runs one step.
    fn step(&mut self, batch: &StepBatch) -> Result<StepOutput, StepError>;

    /// Forgets sequences (finished, cancelled or preempted); their blocks are the router's again.
    fn free(&mut self, seqs: &[SeqId]) -> Result<(), StepError>;

    /// Whether the node reads a block named in several sequences' tables as the same keys and
    /// values, so that the router may share full blocks between sequences (prefix caching) and
    /// send [`StepEntry::cached_prefix`]. A node with per-sequence storage says no (the
    /// default), and the router then never shares a block.
    fn shares_kv_blocks(&self) -> bool {
        false
    }

    /// A handle on the node's view of its cards, for the router to read between steps from
    /// other threads; `None` for a node without cards (nothing can go down under it).
    fn health_source(&self) -> Option<std::sync::Arc<dyn HealthSource>> {
        None
    }

    /// Starts or stops keeping each step's routing for [`AttentionNode::take_routing`] (what
    /// a modeled clock times a step by). A node that cannot report routing ignores it.
    fn record_routing(&mut self, _on: bool) {}

    /// The routing of the last step, while recording; `None` from nodes that do not report it.
    fn take_routing(&mut self) -> Option<StepRouting> {
        None
    }
}

#[cfg(test)]
mod tests;
