//! What exists only because the attention node's host path runs on the same CPUs as the
//! simulated cards: a second, wider pool for the attention of steps whose cards are waiting
//! (one micro-batch), pinned where it spans the process's CPUs, and the work below which
//! handing a layer to it costs more than it saves. A device node computes on its device and
//! never makes the pool; real cards would leave the host's cores to the node alone.

use std::sync::Arc;

use model::ModelConfig;
use step::{InvalidStep, StepError};

use super::compute::Compute;

/// Work (weights times tokens) a layer's attention must have for a step to hand it to the solo
/// pool. Below this the hand-over, twice a layer, costs more than the second core saves.
/// Measured on 2 cores: GPT-OSS-20B at one token (26.5 M weights a layer) went from 129 to 116
/// ms a step, and a medium Mixtral at 16 tokens spent 3.7, 3.7 and 5.0 ms a step in attention
/// (three runs) instead of 5.0-5.3. The same Mixtral at one token (1.5 M) first went from
/// 8.2-8.4 to 8.6 ms (a Zen 4 VM, 4 M here); once the AVX2 kernels read their inputs in place,
/// on a Zen 3 VM, `afd serve --cards 2` at c=1 had a median TPOT of 12.7-14.7 ms a token (four
/// rounds, alternated; 13.5 on average) against 14.0-15.0 (14.4) with the attention on one
/// core, and its attention took 0.24-0.26 against 0.30-0.34 ms a layer in `afd generate` traces.
pub(super) const SOLO_MIN_LAYER_WORK: usize = 1 << 20;

/// Weights of one layer's q, k, v and o projections.
fn attention_weights(config: &ModelConfig) -> usize {
    config.hidden_size * 2 * (config.q_dim() + config.kv_dim())
}

/// Attention work of one layer at `tokens` tokens: weights times tokens.
pub(super) fn attention_work(config: &ModelConfig, tokens: usize) -> usize {
    attention_weights(config).saturating_mul(tokens)
}

/// The pool of [`NodeConfig::solo_threads`] threads, for the host path when it is wider than
/// the process's pool (a device computes on its own).
pub(super) fn solo_pool(
    threads: usize,
    compute: &Compute,
) -> Result<Option<Arc<rayon::ThreadPool>>, StepError> {
    if !matches!(compute, Compute::Host(_)) || threads <= rayon::current_num_threads() {
        return Ok(None);
    }
    compute_pool(threads).map(Some)
}

/// A pool of `threads` compute threads for the attention, each pinned to a CPU of its own when
/// the pool is as wide as the CPUs the process may use (a narrower pool is left to the OS, so
/// that several processes on one host do not all crowd onto the first CPUs). The pool wakes
/// twice a layer, and a guest scheduler that packs waking threads onto fewer vCPUs (this
/// project's 2-vCPU VMs, `sched_vcpu_pack`) often ran both on one: GPT-OSS-20B on 8 cards at
/// one token took 205-210 ms a step pinned against 214-276 unpinned, four runs each,
/// alternated (`afd generate --trace`); a batch of 4 stayed within the noise (500-553 against
/// 508-534).
pub(super) fn compute_pool(threads: usize) -> Result<Arc<rayon::ThreadPool>, StepError> {
    let cpus = core_affinity::get_core_ids().unwrap_or_default();
    let pin = threads > 1 && threads == cpus.len();
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("afd-attention-{i}"))
        .start_handler(move |i| {
            if pin && !core_affinity::set_for_current(cpus[i]) {
                tracing::debug!(cpu = cpus[i].id, "could not pin an attention thread");
            }
        })
        .build()
        .map(Arc::new)
        .map_err(|e| {
            InvalidStep::Setup(format!("cannot start {threads} attention threads: {e}")).into()
        })
}
