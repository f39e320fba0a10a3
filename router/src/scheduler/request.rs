//! What the scheduler keeps per request, and what it hands out per step.

use std::time::Instant;

use step::{Constraint, MaskJob, SampleRequest, ScoredToken, StepBatch};

use super::BlockHash;

/// A request's id, unique within one router; it is also the node's sequence id.
pub type RequestId = u64;

/// How one sequence is generated (validated by the server).
#[derive(Debug, Clone, PartialEq)]
pub struct SequenceParams {
    /// Most tokens to generate (at least 1).
    pub max_tokens: usize,
    /// Sampling, penalties and logprobs, passed to the node as they are.
    pub sample: SampleRequest,
    /// Tokens that end the sequence (the model's end-of-sequence ids unless `ignore_eos`, plus
    /// the request's `stop_token_ids`). The stop token is part of the output.
    pub stop_token_ids: Vec<u32>,
    /// The grammar its output must follow (structured output), or `None`. The scheduler
    /// hands out a [`MaskJob`] for each step that samples it, and feeds it each sampled token.
    pub constraint: Option<Constraint>,
    /// Score every prompt token after the first (prompt logprobs), with this many alternatives
    /// per position; `None` for none. Such a request takes nothing from the prefix cache for
    /// its prompt (the cached tokens would go unscored), and its scores come with its first
    /// token ([`TokenOutput::prompt_logprobs`]).
    pub prompt_logprobs: Option<usize>,
}

/// A request as the scheduler receives it.
#[derive(Debug, Clone, PartialEq)]
pub struct NewRequest {
    /// Its id.
    pub id: RequestId,
    /// Prompt token ids (not empty).
    pub prompt: Vec<u32>,
    /// How to generate.
    pub params: SequenceParams,
    /// When the frontend received it (queue time is measured from here).
    pub arrival: Instant,
}

/// Where a request is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestStatus {
    /// Never scheduled yet.
    Waiting,
    /// In the running set: holds KV blocks and is scheduled every step.
    Running,
    /// Was running, lost its blocks to a request ahead of it, and waits to be recomputed.
    Preempted,
}

/// Why a sequence finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// It produced one of its stop tokens (the token is the last output token).
    StopToken(u32),
    /// It reached `max_tokens` or `max_model_len`.
    Length,
}

/// Why a step could not continue a sequence.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SequenceFailure {
    /// It asked for a token and the node returned none.
    #[error("the node returned no token for a sequence that asked for one")]
    NoToken,
    /// The token sampled does not follow the output's grammar.
    #[error("the sampled token does not follow the requested output format: {0}")]
    Constraint(String),
    /// It asked for prompt logprobs and the node returned fewer scores than prompt tokens.
    #[error("the node returned {got} prompt logprobs for {asked} prompt tokens")]
    PromptLogprobs {
        /// Scores asked for in the step.
        asked: usize,
        /// Scores returned.
        got: usize,
    },
}

/// One generated token, as the scheduler reports it after a step.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenOutput {
    /// The request.
    pub id: RequestId,
    /// The token.
    pub token: u32,
    /// Its log-probability (temperature 1, no filters), as the node reports it.
    pub logprob: f32,
    /// The most likely alternatives with their log-probabilities, best first.
    pub top_logprobs: Vec<(u32, f32)>,
    /// Set on the last token of the sequence.
    pub finish: Option<FinishReason>,
    /// When the request was first scheduled (the end of its queue time).
    pub first_scheduled: Instant,
    /// When the step that produced it ended (the caller's `now`).
    pub produced_at: Instant,
    /// How often the request has been preempted so far.
    pub num_preemptions: u32,
    /// On the first token of a request that asked for prompt logprobs: the score of every
    /// prompt token after the first, in order (`prompt_len - 1` of them). `None` otherwise.
    pub prompt_logprobs: Option<Vec<ScoredToken>>,
}

/// One request's state inside the scheduler.
#[derive(Debug, Clone)]
pub(crate) struct Sequence {
    pub(crate) prompt_len: usize,
    /// Prompt followed by every generated token.
    pub(crate) tokens: Vec<u32>,
    /// Tokens whose keys and values are in the node's cache.
    pub(crate) num_computed: usize,
    /// Physical KV blocks, in order.
    pub(crate) blocks: Vec<u32>,
    /// Prefix-cache hashes of the full blocks registered so far (or taken from the cache).
    pub(crate) block_hashes: Vec<BlockHash>,
    pub(crate) status: RequestStatus,
    pub(crate) params: SequenceParams,
    pub(crate) first_scheduled: Option<Instant>,
    /// The node holds state for this sequence (it has been in a step since its last reset).
    pub(crate) on_node: bool,
    pub(crate) num_preemptions: u32,
    /// The prompt's scores gathered so far (prompt logprobs), until its first token.
    pub(crate) prompt_scores: Vec<ScoredToken>,
}

impl Sequence {
    pub(crate) fn num_output(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Whether its prompt is still to be scored: it asked for prompt logprobs and has no
    /// output yet (a recompute after its first token scores nothing again).
    pub(crate) fn scores_prompt(&self) -> bool {
        self.params.prompt_logprobs.is_some() && self.num_output() == 0
    }
}

/// What one call to [`crate::Scheduler::schedule`] decided.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SchedulerOutput {
    /// The step for the node, one entry per scheduled request, in scheduling order.
    pub batch: StepBatch,
    /// Tokens scheduled per request, in the order of `batch.entries`.
    pub num_scheduled_tokens: Vec<(RequestId, usize)>,
    /// Sequences the node must forget before running `batch` (finished, aborted and
    /// preempted since the last step).
    pub freed: Vec<RequestId>,
    /// Requests scheduled for the first time in this step.
    pub started: Vec<RequestId>,
    /// Requests preempted in this step.
    pub preempted: Vec<RequestId>,
    /// The masks the step's constrained rows wait on: computed off the scheduling thread while
    /// the node runs the step (see [`step::constraint`]).
    pub mask_jobs: Vec<MaskJob>,
}

impl SchedulerOutput {
    /// Tokens in the step.
    pub fn total_tokens(&self) -> usize {
        self.num_scheduled_tokens.iter().map(|(_, n)| n).sum()
    }

    /// Whether nothing was scheduled.
    pub fn is_empty(&self) -> bool {
        self.batch.entries.is_empty()
    }
}

/// Counters and gauges of one scheduler, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SchedulerStats {
    /// Requests in the running set.
    pub running: usize,
    /// Requests waiting, never scheduled yet.
    pub waiting_new: usize,
    /// Requests waiting after a preemption.
    pub waiting_preempted: usize,
    /// KV blocks held by sequences.
    pub kv_blocks_used: usize,
    /// KV blocks in the cache.
    pub kv_blocks_total: usize,
    /// Preemptions so far.
    pub num_preemptions_total: u64,
    /// Prompt tokens of requests whose prefill completed (counted once per request).
    pub prompt_tokens_total: u64,
    /// Tokens generated.
    pub generation_tokens_total: u64,
    /// Tokens computed, recomputation after preemption included.
    pub computed_tokens_total: u64,
    /// Steps run.
    pub steps_total: u64,
    /// Tokens looked up in the prefix cache: every token of each request admitted with
    /// prefix caching on (vLLM's `prefix_cache_queries`).
    pub prefix_cache_queries_total: u64,
    /// Of those, tokens found cached, whose prefill was skipped (vLLM's `prefix_cache_hits`).
    pub prefix_cache_hits_total: u64,
    /// Tokens in the last step.
    pub last_step_tokens: usize,
}

impl SchedulerStats {
    /// Fraction of KV blocks in use.
    pub fn kv_usage(&self) -> f64 {
        if self.kv_blocks_total == 0 {
            0.0
        } else {
            self.kv_blocks_used as f64 / self.kv_blocks_total as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use step::StepEntry;

    use super::*;

    /// An entry of `n` new prompt tokens for sequence `seq`, starting at position 0.
    fn entry(seq: RequestId, n: usize) -> StepEntry {
        StepEntry {
            seq,
            tokens: vec![7; n],
            start: 0,
            prompt_len: n,
            block_table: vec![0],
            sample: None,
            cached_prefix: Vec::new(),
            prompt_logprobs: None,
        }
    }

    /// An output scheduling `counts[i].1` tokens of request `counts[i].0`.
    fn output(counts: &[(RequestId, usize)]) -> SchedulerOutput {
        SchedulerOutput {
            batch: StepBatch {
                entries: counts.iter().map(|&(id, n)| entry(id, n)).collect(),
            },
            num_scheduled_tokens: counts.to_vec(),
            ..SchedulerOutput::default()
        }
    }

    #[test]
    fn total_tokens_sums_the_tokens_scheduled_per_request() {
        assert_eq!(
            SchedulerOutput::default().total_tokens(),
            0,
            "nothing scheduled"
        );
        assert_eq!(output(&[(3, 1)]).total_tokens(), 1, "one decode token");
        assert_eq!(
            output(&[(1, 4), (2, 1), (5, 2)]).total_tokens(),
            7,
            "a 4-token chunk, a decode token and a 2-token chunk"
        );
    }

    #[test]
    fn is_empty_only_when_the_batch_has_no_entries() {
        assert!(SchedulerOutput::default().is_empty());
        let only_freed = SchedulerOutput {
            freed: vec![9],
            preempted: vec![9],
            ..SchedulerOutput::default()
        };
        assert!(
            only_freed.is_empty(),
            "freeing or preempting sequences schedules nothing"
        );
        assert!(!output(&[(1, 1)]).is_empty(), "one request scheduled");
        assert!(
            !output(&[(1, 4), (2, 1)]).is_empty(),
            "two requests scheduled"
        );
    }

    #[test]
    fn kv_usage_is_used_over_total_blocks_and_zero_without_blocks() {
        let stats = |used, total| SchedulerStats {
            kv_blocks_used: used,
            kv_blocks_total: total,
            ..SchedulerStats::default()
        };
        assert_eq!(
            stats(0, 0).kv_usage(),
            0.0,
            "a cache of no blocks is not in use"
        );
        assert_eq!(stats(0, 8).kv_usage(), 0.0, "no block held");
        assert_eq!(stats(2, 8).kv_usage(), 0.25, "2 of 8 blocks");
        assert_eq!(stats(3, 4).kv_usage(), 0.75, "3 of 4 blocks");
        assert_eq!(stats(8, 8).kv_usage(), 1.0, "every block held");
    }
}
