//! The attention half of a layer: q/k/v projections, optional q/k norm, RoPE, the KV cache,
//! grouped-query attention with an optional sliding window and sink logits, and the output
//! projection.
//!
//! Tokens of several sequences arrive flattened (`[tokens, hidden]`), each sequence a
//! [`SeqSpan`]; projections and RoPE run once over all rows, attention runs per sequence
//! against that sequence's cache: short spans (decode) as row loops over the cache's memory
//! ([`super::attend`]), long prompt chunks as matmuls ([`attention_core`]). The cache is behind
//! the [`KvCache`] trait so that the attention node can use a paged cache while the reference
//! uses a contiguous one.

use std::ops::Range;

use candle_core::{Device, Tensor};
use rayon::prelude::*;

use super::attend::{RowAttention, SpanQueries};
pub use super::kv_cache::{ContiguousKvCache, KvCache, KvRun, SeqId};
use super::ops::{rms_norm, to_f32_vec, vector, with_f32_slice};
use super::rope::RopeTables;
use crate::config::{AttentionKind, ModelConfig};
use crate::error::{Error, Result};
use crate::kernels;
use crate::weights::{LayerWeights, Linear};

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

/// How often a layer's row attention took each of its parallel paths: what a test asks to
/// know that the path it means to exercise ran.
#[derive(Debug, Default)]
pub struct AttentionPaths {
    /// Decode batches whose sequences ran side by side on the pool.
    pub side_by_side: std::sync::atomic::AtomicU64,
    /// Rows whose key/value heads were split over the pool.
    pub heads_split: std::sync::atomic::AtomicU64,
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
    /// The sinks again, on the host, for the row kernel.
    sink_values: Option<Vec<f32>>,
    kind: AttentionKind,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    eps: f64,
    scale: f64,
    paths: std::sync::Arc<AttentionPaths>,
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
            sink_values: a.sinks.clone(),
            kind: config.layers[layer].attention,
            num_heads: config.num_heads,
            num_kv_heads: config.num_kv_heads,
            head_dim: config.head_dim,
            eps: config.rms_norm_eps,
            scale: (config.head_dim as f64).powf(-0.5),
            paths: Default::default(),
        })
    }

    /// How often this layer's row attention split heads over the pool and ran sequences side
    /// by side, so far.
    pub fn paths(&self) -> &AttentionPaths {
        &self.paths
    }

    /// Attention output (before the residual add) for normed hidden states `h` (`[tokens, hidden]`).
    /// `rope` holds the RoPE tables of each row's position (`[tokens, head_dim / 2]`).
    pub fn forward(
        &self,
        layer: usize,
        h: &Tensor,
        spans: &[SeqSpan],
        rope: &RopeTables,
        cache: &mut dyn KvCache,
    ) -> Result<Tensor> {
        let (n, _) = h.dims2()?;
        let (nh, nkv, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let (q, k, v) = self.projections(h)?;
        let mut q = q.reshape((n, nh, d))?;
        let mut k = k.reshape((n, nkv, d))?;
        let v = v.reshape((n, nkv, d))?;
        if let Some(w) = &self.q_norm {
            q = rms_norm(&q, w, self.eps)?;
        }
        if let Some(w) = &self.k_norm {
            k = rms_norm(&k, w, self.eps)?;
        }
        // Host rows `[n, heads * d]` / `[n, kv_heads * d]`: what the cache stores and the row
        // kernel reads, rotated in place (no transposes through `[1, heads, n, d]`).
        let mut q_rows = to_f32_vec(&q)?;
        let mut k_rows = to_f32_vec(&k)?;
        rope_rows(&mut q_rows, nh * d, d, rope);
        rope_rows(&mut k_rows, nkv * d, d, rope);
        let v_rows = to_f32_vec(&v)?;
        let (q_w, kv_w) = (nh * d, nkv * d);
        let rows = RowAttention {
            heads: nh,
            kv_heads: nkv,
            head_dim: d,
            scale: self.scale as f32,
            kind: self.kind,
            sinks: self.sink_values.as_deref(),
        };
        // Every span is a sequence of its own, so all keys and values go in first and the
        // spans' attention then reads the cache side by side.
        for span in spans {
            let (a, b) = (span.start, span.start + span.len);
            cache.store(
                layer,
                span.seq,
                span.past,
                &k_rows[a * kv_w..b * kv_w],
                &v_rows[a * kv_w..b * kv_w],
            )?;
        }
        let cache: &dyn KvCache = cache;
        let mut out = vec![0f32; n * q_w];
        let (short, long): (Vec<_>, Vec<_>) = span_rows(spans, &mut out, q_w)?
            .into_iter()
            .partition(|(span, _)| span.len <= ROW_KERNEL_MAX_QUERIES);
        let row_attention =
            |(span, out_rows): (&SeqSpan, &mut [f32]), scores: &mut Vec<f32>| -> Result<()> {
                let (first_key, runs) = self.span_history(cache, layer, span)?;
                let (a, b) = (span.start, span.start + span.len);
                let queries = SpanQueries {
                    q: &q_rows[a * q_w..b * q_w],
                    past: span.past,
                    first_key,
                    runs: &runs,
                };
                rows.attend(queries, scores, out_rows);
                Ok(())
            };
        let threads = rayon::current_num_threads();
        // The most keys a span's queries read (a sliding window's layers read only the
        // window); looked at last, only when the other conditions hold.
        let longest = || {
            short
                .iter()
                .map(|(span, _)| span.past + span.len - self.first_key(span))
                .max()
                .unwrap_or(0)
        };
        if threads > 1
            && !short.len().is_multiple_of(threads)
            && nkv > 1
            && nh.is_multiple_of(nkv)
            && longest() * kv_w >= SPLIT_MIN_KEY_FLOATS
        {
            // Sequences that do not share out evenly over the threads (one sequence on two,
            // three on two), with long histories: each row's key/value heads are split over
            // the pool, so that no core waits while the last sequence's attention runs.
            self.paths
                .heads_split
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            self.attend_heads_split(&rows, cache, layer, short, &q_rows, threads)?;
        } else if short.len() >= 2 && threads > 1 {
            // A decode batch's sequences are independent row loops: split them over the
            // pool's threads (one sequence with a short history is not worth a hand-over).
            self.paths
                .side_by_side
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            short
                .into_par_iter()
                .try_for_each_init(Vec::new, |scores, job| row_attention(job, scores))?;
        } else {
            let mut scores = Vec::new();
            for job in short {
                row_attention(job, &mut scores)?;
            }
        }
        for (span, out_rows) in long {
            let total = span.past + span.len;
            let (a, b) = (span.start, span.start + span.len);
            let mut runs = Vec::new();
            cache.history(layer, span.seq, 0..total, &mut runs)?;
            let history = |values: bool| -> Result<Tensor> {
                let flat: Vec<f32> = runs
                    .iter()
                    .flat_map(|r| if values { r.values } else { r.keys }.iter().copied())
                    .collect();
                Ok(Tensor::from_vec(flat, (total, nkv, d), h.device())?
                    .transpose(0, 1)?
                    .contiguous()?)
            };
            let o = attention_core(
                &Tensor::from_slice(&q_rows[a * q_w..b * q_w], (span.len, nh, d), h.device())?
                    .transpose(0, 1)?
                    .contiguous()?,
                &history(false)?,
                &history(true)?,
                span.past,
                self.kind,
                self.sinks.as_ref(),
                self.scale,
            )?;
            out_rows.copy_from_slice(&to_f32_vec(&o)?);
        }
        let o = Tensor::from_vec(out, (n, q_w), h.device())?.to_dtype(h.dtype())?;
        self.o.forward(&o)
    }
}

impl AttentionBlock {
    /// The earliest position `span`'s first query may see.
    fn first_key(&self, span: &SeqSpan) -> usize {
        match self.kind {
            AttentionKind::Full => 0,
            AttentionKind::Sliding { window } => (span.past + 1).saturating_sub(window),
        }
    }

    /// The first position `span`'s queries may see, and the cached keys and values from it to
    /// the span's last token.
    fn span_history<'c>(
        &self,
        cache: &'c dyn KvCache,
        layer: usize,
        span: &SeqSpan,
    ) -> Result<(usize, Vec<KvRun<'c>>)> {
        let first_key = self.first_key(span);
        let mut runs = Vec::new();
        cache.history(layer, span.seq, first_key..span.past + span.len, &mut runs)?;
        Ok((first_key, runs))
    }

    /// The row attention of the `short` spans with each query row's key/value heads cut into
    /// up to `threads` ranges, every (row, range) a job of its own on the pool: the bits
    /// [`RowAttention::attend`] gives, since each head is computed whole by one job.
    fn attend_heads_split(
        &self,
        rows: &RowAttention<'_>,
        cache: &dyn KvCache,
        layer: usize,
        short: Vec<(&SeqSpan, &mut [f32])>,
        q_rows: &[f32],
        threads: usize,
    ) -> Result<()> {
        let (nh, nkv, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let (q_w, group) = (nh * d, nh / nkv);
        let parts = threads.min(nkv);
        let ranges: Vec<Range<usize>> = (0..parts)
            .map(|p| p * nkv / parts..(p + 1) * nkv / parts)
            .collect();
        let histories = short
            .iter()
            .map(|(span, _)| self.span_history(cache, layer, span))
            .collect::<Result<Vec<_>>>()?;
        let mut jobs = Vec::with_capacity(histories.len() * parts);
        for ((span, out_rows), (first_key, runs)) in short.into_iter().zip(&histories) {
            for (i, row) in out_rows.chunks_exact_mut(q_w).enumerate() {
                let q0 = (span.start + i) * q_w;
                let queries = SpanQueries {
                    q: &q_rows[q0..q0 + q_w],
                    past: span.past + i,
                    first_key: *first_key,
                    runs,
                };
                // A range's query heads are contiguous in the row: its outputs are too.
                let mut rest = row;
                for kv in &ranges {
                    let (mine, tail) = std::mem::take(&mut rest).split_at_mut(kv.len() * group * d);
                    rest = tail;
                    jobs.push((queries, kv.clone(), mine));
                }
            }
        }
        jobs.into_par_iter()
            .for_each_init(Vec::new, |scores, (queries, kv, out)| {
                rows.attend_heads(queries, kv, scores, out)
            });
        Ok(())
    }

    /// The query, key and value projections of `h` (`[tokens, hidden]`). One token's three
    /// products run in one parallel section ([`kernels::matvecs`], the same bits).
    fn projections(&self, h: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let (n, cols) = h.dims2()?;
        let linears = [&self.q, &self.k, &self.v];
        if n != 1 || linears.iter().any(|l| l.weight.cols() != cols) {
            return Ok((self.q.forward(h)?, self.k.forward(h)?, self.v.forward(h)?));
        }
        let mut outs = linears.map(|l| vec![0f32; l.weight.rows()]);
        with_f32_slice(h, |x| {
            let jobs = linears
                .iter()
                .zip(outs.iter_mut())
                .map(|(l, o)| l.matvec(x, o))
                .collect();
            kernels::matvecs(jobs);
        })?;
        let [q, k, v] = outs.map(|o| {
            let len = o.len();
            Tensor::from_vec(o, (1, len), h.device())
        });
        Ok((q?, k?, v?))
    }
}

/// Each span with its rows of `out` (`[tokens, width]`); the spans must cover disjoint rows.
fn span_rows<'s, 'o>(
    spans: &'s [SeqSpan],
    out: &'o mut [f32],
    width: usize,
) -> Result<Vec<(&'s SeqSpan, &'o mut [f32])>> {
    let mut order: Vec<&SeqSpan> = spans.iter().collect();
    order.sort_by_key(|s| s.start);
    let mut rest = out;
    let mut at = 0;
    let mut jobs = Vec::with_capacity(spans.len());
    for span in order {
        let end = span.start + span.len;
        if span.start < at || end > at + rest.len() / width.max(1) {
            return Err(Error::InvalidInput(format!(
                "sequence {} claims rows {}..{end}, which overlap another sequence's or lie \
                 past the batch",
                span.seq, span.start
            )));
        }
        let tail = std::mem::take(&mut rest);
        let (_, tail) = tail.split_at_mut((span.start - at) * width);
        let (rows, tail) = tail.split_at_mut(span.len * width);
        rest = tail;
        at = end;
        jobs.push((span, rows));
    }
    Ok(jobs)
}

/// Key floats (positions times key/value heads times head size) from which the row attention
/// of sequences that do not share out evenly over the pool's threads is split by key/value
/// heads, rather than each sequence run on one thread while the others wait. Below it the
/// hand-over costs about what the split saves: medium Mixtral (4 key/value heads of 64) at one
/// sequence and 64-128 positions took 0.27-0.29 ms a layer split against 0.24-0.29 whole
/// (attention span, Zen 3 VM, 2 threads); at 1,300-1,400 positions 0.63-0.66 against
/// 0.83-0.98 ms. Three sequences at 900-1,000 positions: 1.06-1.14 against 1.28-1.31 ms.
const SPLIT_MIN_KEY_FLOATS: usize = 32 * 1024;

/// Spans of at most this many new tokens (decode, short chunks) take the row kernel; longer
/// prompt chunks take the matmul path, where the matmul's throughput pays for its set-up.
const ROW_KERNEL_MAX_QUERIES: usize = 4;

/// RoPE in place on rows `[n, width]` of heads of `d` floats, with tables `[n, d / 2]`, by
/// candle's half-split formula (`x1 cos - x2 sin`, `x1 sin + x2 cos`: the same operations in
/// the same order, so the same bits as its kernel).
fn rope_rows(rows: &mut [f32], width: usize, d: usize, rope: &RopeTables) {
    let (half, cos, sin) = (d / 2, &rope.cos, &rope.sin);
    for (t, row) in rows.chunks_exact_mut(width).enumerate() {
        let (c, s) = (
            &cos[t * half..(t + 1) * half],
            &sin[t * half..(t + 1) * half],
        );
        for head in row.chunks_exact_mut(d) {
            let (x1, x2) = head.split_at_mut(half);
            for i in 0..half {
                let (a, b) = (x1[i], x2[i]);
                x1[i] = a * c[i] - b * s[i];
                x2[i] = a * s[i] + b * c[i];
            }
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The in-place rotation of host rows gives candle's rope kernel's bits.
    #[test]
    fn spans_get_their_own_rows_and_overlaps_are_refused() {
        let span = |seq, start, len| SeqSpan {
            seq,
            start,
            len,
            past: 0,
        };
        let mut out: Vec<f32> = (0..12).map(|i| i as f32).collect();
        // Out of order, with a gap (row 3 belongs to no span).
        let spans = [span(7, 4, 2), span(8, 0, 3)];
        let jobs = span_rows(&spans, &mut out, 2).unwrap();
        let got: Vec<(u64, Vec<f32>)> = jobs.iter().map(|(s, r)| (s.seq, r.to_vec())).collect();
        assert_eq!(
            got,
            vec![
                (8, vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]),
                (7, vec![8.0, 9.0, 10.0, 11.0])
            ]
        );
        for bad in [
            [span(1, 0, 3), span(2, 2, 2)],
            [span(1, 0, 3), span(2, 5, 2)],
        ] {
            let err = span_rows(&bad, &mut out, 2).unwrap_err().to_string();
            assert!(err.contains("sequence 2 claims rows"), "{err}");
        }
    }

    #[test]
    fn rope_rows_equal_candles_kernel() {
        let (n, heads, d) = (5, 3, 8);
        let values = |count: usize, seed: u64| -> Vec<f32> {
            crate::kernels::tests::values(seed, count)
                .into_iter()
                .map(|x| x * 3.0)
                .collect()
        };
        let x = values(n * heads * d, 1);
        let (cos, sin) = (values(n * d / 2, 2), values(n * d / 2, 3));
        let dev = Device::Cpu;
        let cos_t = Tensor::from_slice(&cos, (n, d / 2), &dev).unwrap();
        let sin_t = Tensor::from_slice(&sin, (n, d / 2), &dev).unwrap();
        let xt = Tensor::from_slice(&x, (n, heads, d), &dev)
            .unwrap()
            .transpose(0, 1)
            .unwrap()
            .unsqueeze(0)
            .unwrap()
            .contiguous()
            .unwrap();
        let want = to_f32_vec(
            &candle_nn::rotary_emb::rope(&xt, &cos_t, &sin_t)
                .unwrap()
                .squeeze(0)
                .unwrap()
                .transpose(0, 1)
                .unwrap(),
        )
        .unwrap();
        let mut got = x.clone();
        rope_rows(&mut got, heads * d, d, &RopeTables { cos, sin });
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&want));
        assert_ne!(got, x, "the rotation changed nothing");
    }
}
