//! One step of the disaggregated node: micro-batches pipelined over the layers.
//!
//! With two micro-batches the order is: attention of (layer l, mb 0) and its dispatch, attention
//! of (l, mb 1) and its dispatch, then for each micro-batch: wait for its replies of layer l,
//! combine, and immediately run its attention of layer l + 1 and dispatch it. So while the cards
//! compute one micro-batch's experts, this node computes the other's attention.

use std::collections::HashMap;

use candle_core::Tensor;
use model::config::FfnKind;
use model::forward::attention::SeqSpan;
use model::forward::rope::RopeTables;
use proto::data::{self, Immediate, Kind, MessageMeta};

use super::DisaggregatedNode;
use crate::device::inputs::{MbInputs, SpanInput};
use crate::dispatch::{DispatchPlan, plan_dispatch};
use crate::fabric::Reply;
use crate::monolithic::validate_batch;
use crate::sampler::record_tokens;
use step::{InvalidStep, ModelFailure, SeqId, StepBatch, StepError, StepOutput};

/// One micro-batch's state through the layers.
pub(super) struct MicroBatch {
    /// Indices of its entries in the step batch.
    pub entries: Vec<usize>,
    pub spans: Vec<SeqSpan>,
    /// Per row: the token's position (replica key, RoPE position).
    pub positions: Vec<usize>,
    /// RoPE tables of its rows.
    pub rope: RopeTables,
    /// Residual stream `[rows, hidden]` (on the node's device).
    pub x: Tensor,
    /// Its inputs on the device (device path only).
    pub device: Option<MbInputs>,
    /// What this micro-batch waits for after its last dispatch.
    pub pending: Option<Pending>,
}

pub(super) struct Pending {
    pub layer: usize,
    /// `None`: a dense layer, every dense card answers for every row.
    pub plan: Option<DispatchPlan>,
    pub cards: Vec<usize>,
}

impl DisaggregatedNode {
    /// One step, as two micro-batches when `two` and the batch has two or more sequences.
    pub(super) fn run_step(
        &mut self,
        batch: &StepBatch,
        two: bool,
    ) -> Result<StepOutput, StepError> {
        // A sequence that starts at 0 (or after a cached prefix) is new, whatever this node
        // remembers under its id (a frontend that restarted numbers its sequences from the
        // start again).
        for e in batch.entries.iter().filter(|e| e.starts_sequence()) {
            self.seq_lens.remove(&e.seq);
            self.histories.remove(&e.seq);
        }
        validate_batch(batch, self.compute.capacity(), Some(&self.filled), |s| {
            self.seq_lens.get(&s).copied().unwrap_or(0)
        })?;
        if batch.entries.is_empty() {
            return Ok(StepOutput::default());
        }
        self.begin_cards()?;
        self.step_counter += 1;
        if let Some(r) = self.routing.as_mut() {
            // A step run again after a card went down records afresh.
            r.top_k = self.config.moe.map_or(0, |m| m.top_k);
            r.layers = vec![None; self.config.num_layers()];
        }
        let mut mbs = self.split(batch, two)?;
        for mb in &mbs {
            let rows = mb.positions.len();
            if rows > self.node.max_tokens {
                return Err(InvalidStep::TooManyTokens {
                    rows,
                    max_tokens: self.node.max_tokens,
                }
                .into());
            }
        }
        let tables: HashMap<SeqId, (&[u32], usize)> = batch
            .entries
            .iter()
            .map(|e| (e.seq, (e.block_table.as_slice(), e.start)))
            .collect();
        let layers = self.config.num_layers();
        let mut stash: HashMap<(usize, u8, usize), Vec<u8>> = HashMap::new();
        let solo = match (&self.solo_pool, mbs.as_slice()) {
            (Some(pool), [mb])
                if super::host_threads::attention_work(&self.config, mb.positions.len())
                    >= self.solo_min_work =>
            {
                Some(pool.clone())
            }
            _ => None,
        };
        for layer in 0..layers {
            for (m, mb) in mbs.iter_mut().enumerate() {
                if layer > 0 {
                    self.finish_ffn(mb, m as u8, &mut stash)?;
                }
                self.attention_and_dispatch(layer, mb, m as u8, &tables, solo.as_deref())?;
            }
        }
        // Every micro-batch's rows go to the LM head in one message when they fit in one:
        // the cards then pass over their vocabulary rows once, not once per micro-batch.
        // Sending the first micro-batch's early would gain nothing, as the cards still have
        // the second's last layer to compute when it is ready.
        let lm_rows: usize = batch.entries.iter().map(super::lm_head::lm_rows).sum();
        let mut sent = Vec::with_capacity(mbs.len());
        if lm_rows <= self.node.max_tokens {
            for (m, mb) in mbs.iter_mut().enumerate() {
                self.finish_ffn(mb, m as u8, &mut stash)?;
            }
            sent.push(self.lm_head_send(batch, &mbs, 0)?);
        } else {
            for m in 0..mbs.len() {
                self.finish_ffn(&mut mbs[m], m as u8, &mut stash)?;
                sent.push(self.lm_head_send(batch, &mbs[m..=m], m as u8)?);
            }
        }
        for e in &batch.entries {
            self.seq_lens.insert(e.seq, e.start + e.tokens.len());
            record_tokens(&mut self.histories, e);
        }
        let out = self.lm_head_merge(batch, &sent, &mut stash);
        match &out {
            Ok(_) => self.filled.record(batch),
            Err(_) => self.forget_tokens(batch),
        }
        out
    }

    /// Cuts the batch into one micro-batch or (when `two`) two of about equal token counts,
    /// in order.
    fn split(&self, batch: &StepBatch, two: bool) -> Result<Vec<MicroBatch>, StepError> {
        let tokens: Vec<usize> = batch.entries.iter().map(|e| e.tokens.len()).collect();
        micro_batch_ranges(&tokens, two)
            .into_iter()
            .map(|range| {
                let entries: Vec<usize> = range.collect();
                let mut spans = Vec::new();
                let mut inputs = Vec::new();
                let mut positions = Vec::new();
                let mut tokens = Vec::new();
                for &i in &entries {
                    let e = &batch.entries[i];
                    spans.push(SeqSpan {
                        seq: e.seq,
                        start: tokens.len(),
                        len: e.tokens.len(),
                        past: e.start,
                    });
                    inputs.push(SpanInput {
                        tokens: &e.tokens,
                        past: e.start,
                        table: &e.block_table,
                    });
                    positions.extend(e.start..e.start + e.tokens.len());
                    tokens.extend_from_slice(&e.tokens);
                }
                let rope = self.rope.tables(&positions);
                let (x, device) = self.compute.embed(&self.config, &inputs, &tokens, &rope)?;
                Ok(MicroBatch {
                    entries,
                    spans,
                    positions,
                    rope,
                    x,
                    device,
                    pending: None,
                })
            })
            .collect()
    }

    fn meta(&self, layer: u16, micro_batch: u8) -> MessageMeta {
        MessageMeta {
            step: self.step_counter,
            layer,
            micro_batch,
            dtype: self.node.wire_dtype,
            shard: self.shard_version,
        }
    }

    /// Attention of `layer` for one micro-batch, on `pool` when given, then its FFN rows out
    /// to the cards.
    fn attention_and_dispatch(
        &mut self,
        layer: usize,
        mb: &mut MicroBatch,
        m: u8,
        tables: &HashMap<SeqId, (&[u32], usize)>,
        pool: Option<&rayon::ThreadPool>,
    ) -> Result<(), StepError> {
        let span = self.trace.begin();
        let hidden = self.config.hidden_size;
        let ffn_input = match pool {
            Some(pool) => {
                let (compute, config) = (&mut self.compute, &self.config);
                let out = step::compute::run_on_sleeping(pool, || {
                    compute.attention(config, layer, mb, tables)
                })?;
                self.stats.solo_layers += 1;
                out
            }
            None => self.compute.attention(&self.config, layer, mb, tables)?,
        };
        let h2 = ffn_input.rows;
        let meta = self.meta(layer as u16, m);
        let immediate = Immediate {
            step: self.step_counter,
            layer: layer as u16,
            micro_batch: m,
        };
        let pending = match (self.config.layers[layer].ffn, ffn_input.routing) {
            (FfnKind::Moe, Some(routing)) => {
                if let Some(slot) = self.routing.as_mut().and_then(|r| r.layers.get_mut(layer)) {
                    // Micro-batches are consecutive entries, so appending keeps batch order.
                    slot.get_or_insert_with(Vec::new)
                        .extend_from_slice(&routing.experts);
                }
                let keys: Vec<u64> = mb.positions.iter().map(|&p| p as u64).collect();
                let plan = plan_dispatch(&routing, layer, &self.active.placement, &keys);
                self.stats.split_experts += plan.split_experts as u64;
                self.trace.end(span, "attention", layer, m);
                let span = self.trace.begin();
                let mut cards = Vec::new();
                for c in &plan.cards {
                    let mut sel = Vec::with_capacity(c.rows.len() * hidden);
                    for &r in &c.rows {
                        sel.extend_from_slice(&h2[r * hidden..(r + 1) * hidden]);
                    }
                    let mut msg = Vec::new();
                    data::encode_moe_dispatch(
                        meta, hidden, &sel, plan.slots, &c.experts, &c.weights, &mut msg,
                    );
                    self.send_to(c.card, m, msg, immediate)?;
                    cards.push(c.card);
                }
                self.trace.end(span, "dispatch", layer, m);
                Pending {
                    layer,
                    plan: Some(plan),
                    cards,
                }
            }
            (FfnKind::Moe, None) => {
                return Err(ModelFailure::Missing("an MoE layer's routing").into());
            }
            (FfnKind::Dense, _) => {
                self.trace.end(span, "attention", layer, m);
                let span = self.trace.begin();
                let mut msg = Vec::new();
                data::encode_rows(Kind::DenseDispatch, meta, hidden, &h2, &mut msg);
                for card in self.layout.dense_cards.clone() {
                    self.send_to(card, m, msg.clone(), immediate)?;
                }
                self.trace.end(span, "dispatch", layer, m);
                Pending {
                    layer,
                    plan: None,
                    cards: self.layout.dense_cards.clone(),
                }
            }
        };
        mb.pending = Some(pending);
        Ok(())
    }

    /// Waits for the replies a micro-batch is owed and adds them to its residual stream.
    fn finish_ffn(
        &mut self,
        mb: &mut MicroBatch,
        m: u8,
        stash: &mut HashMap<(usize, u8, usize), Vec<u8>>,
    ) -> Result<(), StepError> {
        let Some(p) = mb.pending.take() else {
            return Ok(());
        };
        let span = self.trace.begin();
        let replies = self.collect(p.layer as u16, m, &p.cards, stash)?;
        let hidden = self.config.hidden_size;
        let rows = mb.positions.len();
        let mut partials = Vec::with_capacity(replies.len());
        for (card, bytes) in p.cards.iter().zip(&replies) {
            let (h, r) =
                data::decode_rows(bytes, Kind::PartialSums).map_err(|e| StepError::Card {
                    card: *card,
                    message: format!("bad partial sums: {e}"),
                })?;
            if h.hidden as usize != hidden {
                return Err(StepError::Card {
                    card: *card,
                    message: format!(
                        "partial sums of width {} for a model of width {hidden}",
                        h.hidden
                    ),
                });
            }
            partials.push(r.to_f32());
        }
        match &p.plan {
            Some(plan) => {
                for (c, part) in plan.cards.iter().zip(&partials) {
                    if part.len() != c.rows.len() * hidden {
                        return Err(StepError::Card {
                            card: c.card,
                            message: format!(
                                "{} partial rows for {} rows sent",
                                part.len() / hidden,
                                c.rows.len()
                            ),
                        });
                    }
                }
            }
            None => {
                for (card, part) in p.cards.iter().zip(&partials) {
                    if part.len() != rows * hidden {
                        return Err(StepError::Card {
                            card: *card,
                            message: "dense partial sums of the wrong size".into(),
                        });
                    }
                }
            }
        }
        self.compute
            .add_ffn(mb, p.plan.as_ref(), partials, hidden)?;
        self.trace.end(span, "wait+combine", p.layer, m);
        Ok(())
    }

    /// The replies of `cards` for (layer, micro-batch) of this step, in the order of `cards`.
    pub(super) fn collect(
        &mut self,
        layer: u16,
        m: u8,
        cards: &[usize],
        stash: &mut HashMap<(usize, u8, usize), Vec<u8>>,
    ) -> Result<Vec<Vec<u8>>, StepError> {
        let mut out: Vec<Option<Vec<u8>>> = cards
            .iter()
            .map(|&c| stash.remove(&(layer as usize, m, c)))
            .collect();
        while out.iter().any(Option::is_none) {
            let waiting: Vec<usize> = cards
                .iter()
                .zip(&out)
                .filter(|(_, o)| o.is_none())
                .map(|(&c, _)| c)
                .collect();
            let Reply {
                card,
                immediate,
                bytes,
            } = self.next_reply(&waiting)?;
            if let Ok(h) = data::decode_header(&bytes)
                && h.kind == Kind::Error
            {
                let message = data::decode_error(&bytes).map_or_else(|e| e.to_string(), |(_, m)| m);
                return Err(StepError::Card { card, message });
            }
            if immediate.step != Immediate::wire_step(self.step_counter) {
                // A late reply of a failed earlier step: not ours to use.
                tracing::debug!(card, step = immediate.step, "dropping a stale reply");
                continue;
            }
            match cards.iter().position(|&c| c == card) {
                Some(i) if immediate.layer == layer && immediate.micro_batch == m => {
                    out[i] = Some(bytes)
                }
                _ => {
                    stash.insert(
                        (immediate.layer as usize, immediate.micro_batch, card),
                        bytes,
                    );
                }
            }
        }
        Ok(out.into_iter().flatten().collect())
    }
}

/// How a step of entries with `tokens` new tokens each is cut into micro-batches: one, or (when
/// `two` and there are two or more entries) two runs of consecutive entries of about equal
/// token counts, the first ending at the entry where half the tokens are reached.
pub fn micro_batch_ranges(tokens: &[usize], two: bool) -> Vec<std::ops::Range<usize>> {
    let n = tokens.len();
    if !two || n < 2 {
        return std::iter::once(0..n).collect();
    }
    let total: usize = tokens.iter().sum();
    let mut acc = 0;
    let mut cut = 1;
    for (i, t) in tokens.iter().enumerate() {
        acc += t;
        if 2 * acc >= total {
            cut = (i + 1).clamp(1, n - 1);
            break;
        }
    }
    vec![0..cut, cut..n]
}
