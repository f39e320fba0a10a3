//! Scheduling and admission settings (vLLM's names where the concept matches).

/// Settings of one node's scheduler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Most sequences in one step (vLLM `max_num_seqs`).
    pub max_num_seqs: usize,
    /// Token budget of one step, prefill chunks and decodes together (vLLM
    /// `max_num_batched_tokens`).
    pub max_num_batched_tokens: usize,
    /// Longest sequence, prompt plus output, in tokens (vLLM `max_model_len`). Must fit in every
    /// node's KV cache.
    pub max_model_len: usize,
    /// Split prompts longer than the remaining budget over several steps (vLLM
    /// `enable_chunked_prefill`); without it a prompt waits until it fits in one step, and a
    /// prompt longer than `max_num_batched_tokens` is refused.
    pub enable_chunked_prefill: bool,
    /// Reuse the keys and values of full KV blocks whose tokens, and every token before them,
    /// match a block computed earlier (vLLM `enable_prefix_caching`, on by default as in vLLM
    /// v1). Only on nodes that share blocks between sequences; outputs are the same either way.
    pub enable_prefix_caching: bool,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            max_num_seqs: 256,
            max_num_batched_tokens: 2048,
            max_model_len: 4096,
            enable_chunked_prefill: true,
            enable_prefix_caching: true,
        }
    }
}

/// Settings of the router (every node's scheduler, plus admission).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouterConfig {
    /// Scheduler settings, the same for every node.
    pub scheduler: SchedulerConfig,
    /// Most requests admitted but not yet started, over all nodes; a request beyond it is
    /// refused (HTTP 429) instead of queueing without bound.
    pub max_waiting: usize,
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            scheduler: SchedulerConfig::default(),
            max_waiting: 1024,
        }
    }
}
