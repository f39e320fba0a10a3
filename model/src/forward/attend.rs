//! Attention of a few query rows straight over the cache's key and value runs.
//!
//! Decode is one query per sequence: as tensor operations that is a dozen tiny kernels per
//! sequence and layer, and their fixed costs dominate the step at batch 32 or 64. Here the
//! same math (scaled dot products, optional sink logit, softmax, weighted values) runs as
//! plain loops over rows the cache already holds, in the order the tensor path uses, with no
//! copy of the history. Long prompt chunks still go through the matmul path.

use super::kv_cache::KvRun;
use crate::config::AttentionKind;

/// The head geometry and options of one layer's attention.
#[derive(Debug, Clone, Copy)]
pub struct RowAttention<'a> {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (each shared by `heads / kv_heads` query heads).
    pub kv_heads: usize,
    /// Floats per head.
    pub head_dim: usize,
    /// Multiplier of the dot products (`head_dim^-0.5`).
    pub scale: f32,
    /// Full or sliding-window attention.
    pub kind: AttentionKind,
    /// One extra logit per query head in the softmax denominator (GPT-OSS), if any.
    pub sinks: Option<&'a [f32]>,
}

impl RowAttention<'_> {
    /// Attention output `[t, heads * head_dim]` into `out` for queries `q` (`[t, heads *
    /// head_dim]`) at positions `past..past + t`. `runs` hold the keys and values of positions
    /// `first_key..past + t` in order, where `first_key` is the earliest any query may see.
    pub fn attend(
        &self,
        q: &[f32],
        past: usize,
        first_key: usize,
        runs: &[KvRun<'_>],
        scores: &mut Vec<f32>,
        out: &mut [f32],
    ) {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2, checked just above.
            return unsafe { self.attend_avx2(q, past, first_key, runs, scores, out) };
        }
        self.attend_rows(q, past, first_key, runs, scores, out);
    }

    /// [`Self::attend_rows`] compiled for AVX2: the same operations in the same order (no
    /// fused multiply-adds), eight lanes wide, so results equal the portable build's.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn attend_avx2(
        &self,
        q: &[f32],
        past: usize,
        first_key: usize,
        runs: &[KvRun<'_>],
        scores: &mut Vec<f32>,
        out: &mut [f32],
    ) {
        self.attend_rows(q, past, first_key, runs, scores, out);
    }

    #[inline(always)]
    fn attend_rows(
        &self,
        q: &[f32],
        past: usize,
        first_key: usize,
        runs: &[KvRun<'_>],
        scores: &mut Vec<f32>,
        out: &mut [f32],
    ) {
        let (d, kv_w) = (self.head_dim, self.kv_heads * self.head_dim);
        let group = (self.heads / self.kv_heads.max(1)).max(1);
        let q_w = self.heads * d;
        for (i, (qi, oi)) in q
            .chunks_exact(q_w)
            .zip(out.chunks_exact_mut(q_w))
            .enumerate()
        {
            let pos = past + i;
            let lo = match self.kind {
                AttentionKind::Full => 0,
                AttentionKind::Sliding { window } => (pos + 1).saturating_sub(window),
            }
            .max(first_key);
            let positions: Vec<(&[f32], &[f32])> =
                rows(runs, first_key, lo, pos + 1, kv_w).collect();
            let n = positions.len();
            scores.clear();
            scores.resize(n, 0.0);
            for h in 0..self.heads {
                let g = h / group;
                let (qh, kv) = (&qi[h * d..(h + 1) * d], g * d..(g + 1) * d);
                for (s, (k, _)) in scores.iter_mut().zip(&positions) {
                    *s = dot(qh, &k[kv.clone()]) * self.scale;
                }
                let sink = self.sinks.map(|s| s[h]);
                let max = scores
                    .iter()
                    .copied()
                    .chain(sink)
                    .fold(f32::NEG_INFINITY, f32::max);
                let mut denom = 0f32;
                for s in scores.iter_mut() {
                    *s = (*s - max).exp();
                    denom += *s;
                }
                if let Some(s) = sink {
                    denom += (s - max).exp();
                }
                for s in scores.iter_mut() {
                    *s /= denom;
                }
                let oh = &mut oi[h * d..(h + 1) * d];
                match d {
                    32 => weighted_sum::<4>(scores, &positions, kv.start, oh),
                    64 => weighted_sum::<8>(scores, &positions, kv.start, oh),
                    128 => weighted_sum::<16>(scores, &positions, kv.start, oh),
                    _ => {
                        oh.fill(0.0);
                        for (&p, (_, v)) in scores.iter().zip(&positions) {
                            for (o, &x) in oh.iter_mut().zip(&v[kv.clone()]) {
                                *o += p * x;
                            }
                        }
                    }
                }
            }
        }
    }
}

/// `out = sum_j p[j] * v_j[off..off + 8 * C]`, summed over `j` in order (as the generic loop
/// does), with the `8 * C` sums held in registers instead of memory.
#[inline(always)]
fn weighted_sum<const C: usize>(
    p: &[f32],
    positions: &[(&[f32], &[f32])],
    off: usize,
    out: &mut [f32],
) {
    let mut acc = [[0f32; 8]; C];
    for (&pj, (_, v)) in p.iter().zip(positions) {
        let v = &v[off..off + 8 * C];
        for (c, a) in acc.iter_mut().enumerate() {
            for (l, x) in a.iter_mut().enumerate() {
                *x += pj * v[c * 8 + l];
            }
        }
    }
    for (o, x) in out.iter_mut().zip(acc.iter().flatten()) {
        *o = *x;
    }
}

/// The key and value rows of positions `from..to`; `runs` start at position `base`.
#[inline(always)]
fn rows<'r>(
    runs: &'r [KvRun<'r>],
    base: usize,
    from: usize,
    to: usize,
    row: usize,
) -> impl Iterator<Item = (&'r [f32], &'r [f32])> {
    let row = row.max(1);
    let mut at = base;
    runs.iter()
        .map(move |run| {
            let start = at;
            at += run.keys.len() / row;
            (start, run)
        })
        .take_while(move |(start, _)| *start < to)
        .flat_map(move |(start, run)| {
            let n = run.keys.len() / row;
            let (lo, hi) = (from.max(start), to.min(start + n));
            (lo..hi.max(lo)).map(move |p| {
                let r = (p - start) * row;
                (&run.keys[r..r + row], &run.values[r..r + row])
            })
        })
}

/// Dot product in eight independent lanes (so the compiler vectorizes it).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            lanes[l] += x[l] * y[l];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::*;
    use crate::forward::attention::attention_core;

    /// A deterministic pseudo-random vector in [-1, 1).
    fn values(n: usize, seed: u64) -> Vec<f32> {
        crate::kernels::tests::values(seed, n)
            .into_iter()
            .map(|x| x * 2.0)
            .collect()
    }

    /// The row kernel equals the tensor path for every kind and head size, with and without sinks, for
    /// queries at the end of a history split into uneven runs.
    #[test]
    fn rows_match_the_tensor_path() {
        let (heads, kv_heads) = (4, 2);
        let dev = Device::Cpu;
        // 12: the generic loop; 32, 64, 128: the register-held sums.
        for (d, kind) in [12, 32, 64, 128].into_iter().flat_map(|d| {
            [AttentionKind::Full, AttentionKind::Sliding { window: 5 }].map(|k| (d, k))
        }) {
            for with_sinks in [false, true] {
                for (past, t) in [(0, 3), (9, 1), (6, 4)] {
                    let total = past + t;
                    let kv_w = kv_heads * d;
                    let keys = values(total * kv_w, 1);
                    let vals = values(total * kv_w, 2);
                    let q = values(t * heads * d, 3);
                    let sinks = values(heads, 4);
                    let first_key = match kind {
                        AttentionKind::Full => 0,
                        AttentionKind::Sliding { window } => (past + 1).saturating_sub(window),
                    };
                    // Runs of 3 positions, as a paged cache with block size 3 would give.
                    let runs: Vec<KvRun<'_>> = (first_key..total)
                        .step_by(3)
                        .map(|p| {
                            let e = (p + 3).min(total);
                            KvRun {
                                keys: &keys[p * kv_w..e * kv_w],
                                values: &vals[p * kv_w..e * kv_w],
                            }
                        })
                        .collect();
                    let rows = RowAttention {
                        heads,
                        kv_heads,
                        head_dim: d,
                        scale: (d as f32).powf(-0.5),
                        kind,
                        sinks: with_sinks.then_some(&sinks[..]),
                    };
                    let mut out = vec![0f32; t * heads * d];
                    rows.attend(&q, past, first_key, &runs, &mut Vec::new(), &mut out);

                    let qt = Tensor::from_slice(&q, (t, heads, d), &dev)
                        .unwrap()
                        .transpose(0, 1)
                        .unwrap()
                        .contiguous()
                        .unwrap();
                    let hist = |x: &[f32]| {
                        Tensor::from_slice(x, (total, kv_heads, d), &dev)
                            .unwrap()
                            .transpose(0, 1)
                            .unwrap()
                            .contiguous()
                            .unwrap()
                    };
                    let sink_t = Tensor::from_slice(&sinks, heads, &dev).unwrap();
                    let want = attention_core(
                        &qt,
                        &hist(&keys),
                        &hist(&vals),
                        past,
                        kind,
                        with_sinks.then_some(&sink_t),
                        (d as f64).powf(-0.5),
                    )
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap();
                    let worst = out
                        .iter()
                        .zip(&want)
                        .map(|(a, b)| (a - b).abs())
                        .fold(0f32, f32::max);
                    assert!(
                        worst < 1e-5,
                        "{kind:?} sinks={with_sinks} past={past} t={t}: {worst}"
                    );
                }
            }
        }
    }
}
