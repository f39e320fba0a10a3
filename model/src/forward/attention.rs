//! The attention half of a layer: q/k/v projections, optional q/k norm, RoPE, the KV cache,
//! grouped-query attention with an optional sliding window and sink logits, and the output
//! projection.
//!
//! Tokens of several sequences arrive flattened (`[tokens, hidden]`), each sequence a
//! [`SeqSpan`]; projections run once over all rows, attention runs per sequence against that
//! sequence's cache. The cache is behind the [`KvCache`] trait so that the attention node can
//! use a paged cache while the reference uses a contiguous one.

use std::collections::HashMap;

use candle_core::{Device, Tensor};

use super::ops::{rms_norm, vector};
use crate::config::{AttentionKind, ModelConfig};
use crate::error::{Error, Result};
use crate::weights::{LayerWeights, Linear};

/// Identifies a sequence across steps.
pub type SeqId = u64;

/// Where one sequence's new tokens sit in a flattened batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqSpan {
    /// The sequence.
    pub seq: SeqId,
    /// First row of its tokens in the batch.
    pub start: usize,
    /// Number of new tokens.
    pub len: usize,
    /// Tokens of this sequence already in the cache (the position of its first new token).
    pub past: usize,
}

/// Storage of keys and values per (layer, sequence).
pub trait KvCache {
    /// Appends `k` and `v` (`[kv_heads, t, head_dim]`) of `seq` at `layer` and returns every key
    /// and value of the sequence so far (`[kv_heads, past + t, head_dim]`).
    fn append(
        &mut self,
        layer: usize,
        seq: SeqId,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(Tensor, Tensor)>;
}

/// A KV cache that keeps one growing tensor per (layer, sequence).
#[derive(Debug, Default)]
pub struct ContiguousKvCache {
    entries: HashMap<(usize, SeqId), (Tensor, Tensor)>,
}

impl ContiguousKvCache {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// Drops everything cached for `seq`.
    pub fn free(&mut self, seq: SeqId) {
        self.entries.retain(|(_, s), _| *s != seq);
    }

    /// Tokens cached for `seq` (0 if unknown).
    pub fn len(&self, seq: SeqId) -> usize {
        self.entries
            .get(&(0, seq))
            .and_then(|(k, _)| k.dim(1).ok())
            .unwrap_or(0)
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

impl KvCache for ContiguousKvCache {
    fn append(
        &mut self,
        layer: usize,
        seq: SeqId,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let entry = match self.entries.remove(&(layer, seq)) {
            Some((pk, pv)) => (Tensor::cat(&[&pk, k], 1)?, Tensor::cat(&[&pv, v], 1)?),
            None => (k.clone(), v.clone()),
        };
        self.entries.insert((layer, seq), entry.clone());
        Ok(entry)
    }
}

/// One layer's attention, with its small tensors prepared on the device.
#[derive(Debug, Clone)]
pub struct AttentionBlock {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
    sinks: Option<Tensor>,
    kind: AttentionKind,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    eps: f64,
    scale: f64,
}

impl AttentionBlock {
    /// Prepares layer `layer` of `weights`.
    pub fn new(
        config: &ModelConfig,
        layer: usize,
        weights: &LayerWeights,
        device: &Device,
    ) -> Result<Self> {
        let a = &weights.attention;
        let prep = |v: &Option<Vec<f32>>| v.as_deref().map(|v| vector(v, device)).transpose();
        Ok(AttentionBlock {
            q: a.q.clone(),
            k: a.k.clone(),
            v: a.v.clone(),
            o: a.o.clone(),
            q_norm: prep(&a.q_norm)?,
            k_norm: prep(&a.k_norm)?,
            sinks: prep(&a.sinks)?,
            kind: config.layers[layer].attention,
            num_heads: config.num_heads,
            num_kv_heads: config.num_kv_heads,
            head_dim: config.head_dim,
            eps: config.rms_norm_eps,
            scale: (config.head_dim as f64).powf(-0.5),
        })
    }

    /// Attention output (before the residual add) for normed hidden states `h` (`[tokens, hidden]`).
    /// `cos`/`sin` are the RoPE tables of each row's position (`[tokens, head_dim / 2]`).
    pub fn forward(
        &self,
        layer: usize,
        h: &Tensor,
        spans: &[SeqSpan],
        cos: &Tensor,
        sin: &Tensor,
        cache: &mut dyn KvCache,
    ) -> Result<Tensor> {
        let (n, _) = h.dims2()?;
        let (nh, nkv, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let mut q = self.q.forward(h)?.reshape((n, nh, d))?;
        let mut k = self.k.forward(h)?.reshape((n, nkv, d))?;
        let v = self.v.forward(h)?.reshape((n, nkv, d))?;
        if let Some(w) = &self.q_norm {
            q = rms_norm(&q, w, self.eps)?;
        }
        if let Some(w) = &self.k_norm {
            k = rms_norm(&k, w, self.eps)?;
        }
        // [n, heads, d] -> [1, heads, n, d] for candle's half-split rope kernel.
        let rope = |x: Tensor| -> Result<Tensor> {
            let x = x.transpose(0, 1)?.unsqueeze(0)?.contiguous()?;
            Ok(candle_nn::rotary_emb::rope(&x, cos, sin)?.squeeze(0)?)
        };
        let q = rope(q)?;
        let k = rope(k)?;
        let v = v.transpose(0, 1)?.contiguous()?;
        let mut outputs = Vec::with_capacity(spans.len());
        for span in spans {
            let qs = q.narrow(1, span.start, span.len)?.contiguous()?;
            let ks = k.narrow(1, span.start, span.len)?.contiguous()?;
            let vs = v.narrow(1, span.start, span.len)?.contiguous()?;
            let (k_all, v_all) = cache.append(layer, span.seq, &ks, &vs)?;
            let cached = k_all.dim(1)?;
            if cached != span.past + span.len {
                return Err(Error::InvalidInput(format!(
                    "sequence {} has {} cached tokens at layer {layer}, expected {}",
                    span.seq,
                    cached - span.len,
                    span.past
                )));
            }
            outputs.push(attention_core(
                &qs,
                &k_all,
                &v_all,
                span.past,
                self.kind,
                self.sinks.as_ref(),
                self.scale,
            )?);
        }
        let o = Tensor::cat(&outputs, 0)?;
        self.o.forward(&o)
    }
}

/// Grouped-query attention of one sequence: `q` `[heads, t, d]` at positions `past..past + t`
/// against the sequence's whole history `k`, `v` (`[kv_heads, past + t, d]`). Returns
/// `[t, heads * d]`.
///
/// A sliding window of `W` lets query `i` see key `j` when `i - W < j <= i`. Sinks add one
/// extra logit per head to the softmax denominator (a "null key" with value 0).
pub fn attention_core(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    past: usize,
    kind: AttentionKind,
    sinks: Option<&Tensor>,
    scale: f64,
) -> Result<Tensor> {
    let (heads, t, d) = q.dims3()?;
    let (kv_heads, total, _) = k.dims3()?;
    let group = heads / kv_heads;
    // Keys no query of this chunk can see are dropped before the matmul.
    let first_key = match kind {
        AttentionKind::Full => 0,
        AttentionKind::Sliding { window } => (past + 1).saturating_sub(window),
    };
    let keys = total - first_key;
    let k = k.narrow(1, first_key, keys)?;
    let v = v.narrow(1, first_key, keys)?;
    // Query heads 8j..8j+7 share KV head j: fold the group into the row dimension.
    let qg = q.reshape((kv_heads, group * t, d))?;
    let scores = qg.matmul(&k.t()?)?.affine(scale, 0.0)?;
    let mut scores = scores.reshape((heads, t, keys))?;
    if let Some(mask) = mask(t, past, first_key, keys, kind, q.device())? {
        scores = scores.broadcast_add(&mask)?;
    }
    let probs = match sinks {
        Some(s) => {
            let sink_col = s.reshape((heads, 1, 1))?.broadcast_as((heads, t, 1))?;
            let with_sink = Tensor::cat(&[&scores, &sink_col.contiguous()?], 2)?;
            candle_nn::ops::softmax_last_dim(&with_sink)?.narrow(2, 0, keys)?
        }
        None => candle_nn::ops::softmax_last_dim(&scores)?,
    };
    let probs = probs.contiguous()?.reshape((kv_heads, group * t, keys))?;
    let out = probs.matmul(&v.contiguous()?)?.reshape((heads, t, d))?;
    Ok(out.transpose(0, 1)?.contiguous()?.reshape((t, heads * d))?)
}

/// Additive mask `[t, keys]` (0 or -inf), or `None` when every key is visible to every query.
fn mask(
    t: usize,
    past: usize,
    first_key: usize,
    keys: usize,
    kind: AttentionKind,
    device: &Device,
) -> Result<Option<Tensor>> {
    let visible = |i: usize, j: usize| {
        let (q_pos, k_pos) = (past + i, first_key + j);
        k_pos <= q_pos
            && match kind {
                AttentionKind::Full => true,
                AttentionKind::Sliding { window } => k_pos + window > q_pos,
            }
    };
    let mut values = Vec::with_capacity(t * keys);
    let mut any_hidden = false;
    for i in 0..t {
        for j in 0..keys {
            let ok = visible(i, j);
            any_hidden |= !ok;
            values.push(if ok { 0.0f32 } else { f32::NEG_INFINITY });
        }
    }
    if !any_hidden {
        return Ok(None);
    }
    Ok(Some(
        Tensor::from_vec(values, (t, keys), device)?.unsqueeze(0)?,
    ))
}
