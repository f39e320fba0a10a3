//! [`DisaggregatedNode`]: the attention node of afd. Attention, the KV cache and routing run
//! here; per layer the routed rows go to the cards that hold their experts and the partial sums
//! come back (DESIGN.md, "One decode step").

mod compute;
mod failover;
mod host_threads;
mod lm_head;
mod overlap;
mod pipeline;
mod trace;

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use model::forward::rope::Rope;
use model::{ModelConfig, ModelWeights};
use proto::data::WireDtype;

pub use pipeline::micro_batch_ranges;
pub use trace::{Span, Trace, chrome_trace};

use crate::cards::CardBoard;
use crate::device::AttentionDevice;
use crate::dispatch::ExpertPlacement;
use crate::fabric::{CardFabric, SlotSizes};
use crate::kv_cache::KvCacheConfig;
use crate::prefix::FilledBlocks;
use crate::sampler::TokenHistory;
use compute::Compute;
use overlap::OverlapTuner;
pub use step::MicroBatches;
use step::{
    AttentionNode, HealthSource, InvalidStep, KvCapacity, SeqId, StepBatch, StepError, StepOutput,
    StepRouting,
};

/// Settings of one attention node.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// Where the node computes: the host path (`cpu`) or the device path (`cuda`, `candle-cpu`).
    pub device: AttentionDevice,
    /// KV cache size and block size.
    pub kv: KvCacheConfig,
    /// Micro-batch overlap.
    pub micro_batches: MicroBatches,
    /// Dtype of hidden rows on the wire.
    pub wire_dtype: WireDtype,
    /// LM-head candidates each card returns per row.
    pub lm_head_candidates: usize,
    /// Most tokens in one step (and so in one message to a card).
    pub max_tokens: usize,
    /// How long to wait for a card's reply before failing the step (a card known to be down
    /// fails the step at once, whatever this says).
    pub reply_timeout: Duration,
    /// Record per-layer spans (see [`DisaggregatedNode::take_trace`]).
    pub trace: bool,
    /// Compute threads of the attention in a step of one micro-batch, where the cards wait
    /// for this node and it waits for them in turn (0: the process's pool, as in every other
    /// step). Where the cards share this node's host, their cores are idle while it computes,
    /// so such a step may use them all; with two micro-batches the node computes beside the
    /// cards and keeps to its own share. Steps whose attention is little work (under 1 M
    /// weights times tokens a layer: a small model's single decode token) keep to the
    /// process's pool: handing so little over costs more than it gains.
    pub solo_threads: usize,
}

impl Default for NodeConfig {
    fn default() -> Self {
        NodeConfig {
            device: AttentionDevice::Cpu,
            kv: KvCacheConfig::default(),
            micro_batches: MicroBatches::Auto,
            wire_dtype: WireDtype::F32,
            lm_head_candidates: 64,
            max_tokens: 512,
            reply_timeout: Duration::from_secs(30),
            trace: false,
            solo_threads: 0,
        }
    }
}

/// What each card holds, as the attention node needs to know it.
#[derive(Debug, Clone)]
pub struct CardLayout {
    /// Which card serves each expert.
    pub placement: ExpertPlacement,
    /// Cards holding a column slice of the dense FFN layers.
    pub dense_cards: Vec<usize>,
    /// Vocabulary rows of each card's LM-head shard (empty: none).
    pub lm_head: Vec<Range<u32>>,
}

impl CardLayout {
    /// Largest LM-head shard.
    pub fn largest_shard(&self) -> usize {
        self.lm_head.iter().map(|r| r.len()).max().unwrap_or(0)
    }

    /// The placement to dispatch with while the cards in `down` are down, or why a node
    /// cannot serve without them (naming the first such card): an expert with no live holder,
    /// or dense FFN columns on a down card. The LM head never stops service: the node covers a
    /// down card's vocabulary rows from its own copy.
    pub fn coverage(&self, down: &[usize]) -> Result<ExpertPlacement, (usize, String)> {
        if let Some(&card) = self.dense_cards.iter().find(|c| down.contains(c)) {
            return Err((
                card,
                format!(
                    "card {card} holds columns of the dense FFN layers, which no other card \
                     covers"
                ),
            ));
        }
        self.placement.without(down).map_err(|e| {
            let card = match &e {
                crate::dispatch::PlacementError::Uncovered { cards, .. } => {
                    cards.first().copied().unwrap_or(0)
                }
                _ => down.first().copied().unwrap_or(0),
            };
            (card, e.to_string())
        })
    }
}

/// Inbox and reply slot sizes for a model and node settings.
pub fn slot_sizes(config: &ModelConfig, node: &NodeConfig, layout: &CardLayout) -> SlotSizes {
    use proto::data::{HEADER_LEN, ROW_SAMPLING_LEN, proposal_len};
    let h = config.hidden_size;
    let n = node.max_tokens;
    let k = config.moe.map_or(0, |m| m.top_k);
    let dt = node.wire_dtype.size();
    let moe = n * (h * dt + k * 8);
    let lm = n * (h * dt + ROW_SAMPLING_LEN);
    let partials = n * h * dt;
    let proposals = n * proposal_len(node.lm_head_candidates);
    // The full-logits fallback sends rows in groups small enough for one slot, at least one row.
    let full_row = proposal_len(layout.largest_shard());
    SlotSizes {
        inbox: HEADER_LEN + moe.max(lm),
        reply: HEADER_LEN + partials.max(proposals).max(full_row),
    }
}

/// Counters a node keeps.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodeStats {
    /// Steps run.
    pub steps: u64,
    /// Tokens processed.
    pub tokens: u64,
    /// Wall seconds spent in steps.
    pub step_seconds: f64,
    /// Rows the full-logits fallback handled.
    pub full_logits_rows: u64,
    /// Steps run again after a card went down during them, with replicas covering it.
    pub retried_steps: u64,
    /// Layers whose attention ran on the wide pool ([`NodeConfig::solo_threads`]).
    pub solo_layers: u64,
    /// Steps run as two micro-batches.
    pub two_micro_batch_steps: u64,
    /// Layer dispatches of one micro-batch that split a replicated expert's rows over two or
    /// more of its copies (counted once per expert).
    pub split_experts: u64,
}

/// The attention node: attention and KV cache here, experts on the cards.
pub struct DisaggregatedNode {
    config: ModelConfig,
    node: NodeConfig,
    layout: CardLayout,
    rope: Rope,
    compute: Compute,
    /// Threads for the attention of single-micro-batch steps (see [`NodeConfig::solo_threads`]);
    /// `None` when they would be no more than the process's pool.
    solo_pool: Option<Arc<rayon::ThreadPool>>,
    /// Attention work (weights times tokens a layer) from which a step takes the solo pool;
    /// [`host_threads::SOLO_MIN_LAYER_WORK`], lowered by tests to put small fixtures on the pool.
    solo_min_work: usize,
    /// The LM head's weight, for the vocabulary rows of cards that are down.
    lm_weight: model::WeightMatrix,
    /// The cards' states, shared with whoever watches them.
    board: Arc<CardBoard>,
    /// The placement and card epochs of the step under way.
    active: failover::ActiveCards,
    seq_lens: HashMap<SeqId, usize>,
    histories: HashMap<SeqId, TokenHistory>,
    /// The KV blocks this node filled, which a prefix-cache hit may name.
    filled: FilledBlocks,
    fabric: Box<dyn CardFabric>,
    /// The card shard version every message names (see [`CardBoard::switch_placement`]).
    shard_version: u32,
    step_counter: u64,
    stats: NodeStats,
    /// Picks one or two micro-batches per step under [`MicroBatches::Auto`].
    overlap: OverlapTuner,
    trace: Trace,
    /// When set, every sampled row goes through the full-logits path and its logits are kept.
    collect_logits: bool,
    logits: Vec<(SeqId, Vec<f32>)>,
    /// The routing of the step under way, per layer, while recording ([`AttentionNode::record_routing`]).
    routing: Option<StepRouting>,
}

impl std::fmt::Debug for DisaggregatedNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DisaggregatedNode")
            .field("family", &self.config.family)
            .field("cards", &self.fabric.cards())
            .field("device", &self.node.device)
            .field("capacity", &self.compute.capacity())
            .finish()
    }
}

impl DisaggregatedNode {
    /// Builds the node from the non-expert weights (load them with `ExpertFilter::None`), the
    /// cards' layout, and a fabric whose cards have loaded their shards.
    pub fn new(
        weights: &ModelWeights,
        layout: CardLayout,
        fabric: Box<dyn CardFabric>,
        node: NodeConfig,
    ) -> Result<Self, StepError> {
        let config = weights.config.clone();
        if layout.placement.cards() != fabric.cards() || layout.lm_head.len() != fabric.cards() {
            return Err(InvalidStep::Setup(format!(
                "the card layout describes {} cards but the fabric connects {}",
                layout.placement.cards(),
                fabric.cards()
            ))
            .into());
        }
        let compute = Compute::new(weights, &node.kv, node.device)?;
        let filled = FilledBlocks::new(compute.capacity());
        let solo_pool = host_threads::solo_pool(node.solo_threads, &compute)?;
        let board = Arc::new(CardBoard::new(&layout));
        Ok(DisaggregatedNode {
            lm_weight: weights.lm_head.clone(),
            active: failover::ActiveCards::all(&layout),
            board,
            rope: Rope::new(&config),
            trace: Trace::new(node.trace),
            compute,
            solo_pool,
            solo_min_work: host_threads::SOLO_MIN_LAYER_WORK,
            config,
            node,
            layout,
            seq_lens: HashMap::new(),
            histories: HashMap::new(),
            filled,
            fabric,
            shard_version: 0,
            step_counter: 0,
            stats: NodeStats::default(),
            overlap: OverlapTuner::default(),
            collect_logits: false,
            logits: Vec::new(),
            routing: None,
        })
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Where the node computes.
    pub fn device(&self) -> AttentionDevice {
        self.node.device
    }

    /// Per layer, the rows one pass over an expert's weights is worth, as the cards reported
    /// it (`u32::MAX`: a replicated expert's rows are never split there).
    pub fn rows_per_weight_read(&self) -> Vec<u32> {
        self.layout.placement.rows_per_weight_read().to_vec()
    }

    /// Per layer, the part of it a copy of an expert costs however many rows it computes, as
    /// the cards reported it.
    pub fn fixed_rows_per_copy(&self) -> Vec<u32> {
        self.layout.placement.fixed_rows_per_copy().to_vec()
    }

    /// Counters so far.
    pub fn stats(&self) -> NodeStats {
        self.stats.clone()
    }

    /// Bytes sent to and received from the cards.
    pub fn traffic(&self) -> (u64, u64) {
        self.fabric.traffic()
    }

    /// Verification mode: gather every sampled row's full logits (slower) and keep them for
    /// [`Self::take_logits`].
    pub fn collect_logits(&mut self, on: bool) {
        self.collect_logits = on;
    }

    /// Logits gathered since the last call, `(sequence, [vocab])`, in sampling order.
    pub fn take_logits(&mut self) -> Vec<(SeqId, Vec<f32>)> {
        std::mem::take(&mut self.logits)
    }

    /// The cards' states: the shell that watches the cards reports heartbeats and rejoins to
    /// it; steps read it.
    pub fn board(&self) -> Arc<CardBoard> {
        self.board.clone()
    }

    /// Per-layer spans recorded since the last call (empty unless tracing is on).
    pub fn take_trace(&mut self) -> Vec<Span> {
        self.trace.take()
    }

    /// The instant the spans of [`Self::take_trace`] count from, to lay other timelines (the
    /// cards') beside them.
    pub fn trace_origin(&self) -> std::time::Instant {
        self.trace.origin()
    }
}

impl DisaggregatedNode {
    /// Hands a step's time to the [`OverlapTuner`], and says so when its choice for steps of
    /// this size turns.
    fn record_overlap(&mut self, tokens: usize, two: bool, seconds: f64) {
        let before = self.overlap.preference(tokens).map(|p| p.0);
        self.overlap.record(tokens, two, seconds);
        if let Some((two, one, two_s)) = self.overlap.preference(tokens)
            && before != Some(two)
        {
            let (low, high) = overlap::class_range(tokens);
            tracing::info!(
                "steps of {low}-{high} tokens now run as {} micro-batch(es): measured {:.3} ms a \
                 token with one, {:.3} ms with two",
                if two { 2 } else { 1 },
                one * 1e3,
                two_s * 1e3
            );
        }
    }
}

impl AttentionNode for DisaggregatedNode {
    fn kv_capacity(&self) -> KvCapacity {
        self.compute.capacity()
    }

    fn step(&mut self, batch: &StepBatch) -> Result<StepOutput, StepError> {
        let started = std::time::Instant::now();
        let retried = self.stats.retried_steps;
        let tokens: usize = batch.entries.iter().map(|e| e.tokens.len()).sum();
        // Only steps of two or more sequences can be split; only `auto` has a choice to learn.
        let tuning = batch.entries.len() >= 2 && self.node.micro_batches == MicroBatches::Auto;
        let two = batch.entries.len() >= 2
            && match self.node.micro_batches {
                MicroBatches::One => false,
                MicroBatches::Two => true,
                MicroBatches::Auto => self.overlap.two(tokens),
            };
        let out = self.step_with_failover(batch, two);
        let seconds = started.elapsed().as_secs_f64();
        self.stats.steps += 1;
        self.stats.tokens += tokens as u64;
        self.stats.step_seconds += seconds;
        self.stats.two_micro_batch_steps += u64::from(two);
        // A step that failed, or ran twice after a card went down, says nothing of its speed.
        if tuning && out.is_ok() && self.stats.retried_steps == retried {
            self.record_overlap(tokens, two, seconds);
        }
        out
    }

    fn free(&mut self, seqs: &[SeqId]) -> Result<(), StepError> {
        for s in seqs {
            self.seq_lens.remove(s);
            self.histories.remove(s);
        }
        Ok(())
    }

    fn shares_kv_blocks(&self) -> bool {
        true
    }

    fn health_source(&self) -> Option<Arc<dyn HealthSource>> {
        Some(self.board.clone())
    }

    fn record_routing(&mut self, on: bool) {
        self.routing = on.then(StepRouting::default);
    }

    fn take_routing(&mut self) -> Option<StepRouting> {
        let top_k = self.config.moe.map_or(0, |m| m.top_k);
        self.routing.as_mut().map(|r| {
            std::mem::replace(
                r,
                StepRouting {
                    top_k,
                    layers: Vec::new(),
                },
            )
        })
    }
}

#[cfg(test)]
mod tests;
