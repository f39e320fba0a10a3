//! Attention of a few query rows straight over the cache's key and value runs.
//!
//! Decode is one query per sequence: as tensor operations that is a dozen tiny kernels per
//! sequence and layer, and their fixed costs dominate the step at batch 32 or 64. Here the
//! same math (scaled dot products, optional sink logit, softmax, weighted values) runs as
//! plain loops over rows the cache already holds, with no copy of the history. Long prompt
//! chunks still go through the matmul path.
//!
//! Two builds give the same bits: a portable one and, on x86-64 with AVX2, one in intrinsics
//! (head sizes a multiple of 8). Both add a dot product's products in 8 lanes, in order, then
//! reduce the lanes by the tree `((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7))`, which is what
//! horizontal adds of eight keys at once produce; weighted values accumulate per element in
//! key order, which vector lanes do unchanged. Neither uses fused multiply-adds.

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

/// A position's key and value rows (every KV head).
type KvRow<'r> = (&'r [f32], &'r [f32]);

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
        if self.head_dim.is_multiple_of(8) && std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 and the head size is a multiple of 8, checked above.
            return unsafe { self.attend_avx2(q, past, first_key, runs, scores, out) };
        }
        self.attend_rows::<false>(q, past, first_key, runs, scores, out);
    }

    /// # Safety
    /// The CPU must support AVX2 and `head_dim` must be a multiple of 8.
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
        self.attend_rows::<true>(q, past, first_key, runs, scores, out);
    }

    /// The kernel; `SIMD` selects the AVX2 dot products and weighted sums (the caller has
    /// checked the CPU and the head size).
    #[inline(always)]
    fn attend_rows<const SIMD: bool>(
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
        let mut positions: Vec<KvRow<'_>> = Vec::new();
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
            positions.clear();
            positions.extend(rows(runs, first_key, lo, pos + 1, kv_w));
            scores.clear();
            scores.resize(positions.len(), 0.0);
            for h in 0..self.heads {
                let off = (h / group) * d;
                let qh = &qi[h * d..(h + 1) * d];
                if SIMD {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: SIMD is only set by `attend_avx2`, whose caller checked AVX2 and
                    // that `d` is a multiple of 8.
                    unsafe {
                        avx2::scaled_dots(qh, &positions, off, self.scale, scores)
                    };
                } else {
                    for (s, (k, _)) in scores.iter_mut().zip(&positions) {
                        *s = dot(qh, &k[off..off + d]) * self.scale;
                    }
                }
                softmax(scores, self.sinks.map(|s| s[h]));
                let oh = &mut oi[h * d..(h + 1) * d];
                if SIMD {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: as above.
                    unsafe {
                        avx2::weighted_sum(scores, &positions, off, oh)
                    };
                } else {
                    weighted_sum(scores, &positions, off, oh);
                }
            }
        }
    }
}

/// Softmax of `scores` in place, with an optional extra logit in the denominator only.
#[inline(always)]
fn softmax(scores: &mut [f32], sink: Option<f32>) {
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
}

/// `out = sum_j p[j] * v_j[off..off + out.len()]`, summed over `j` in order per element.
#[inline(always)]
fn weighted_sum(p: &[f32], positions: &[KvRow<'_>], off: usize, out: &mut [f32]) {
    out.fill(0.0);
    for (&pj, (_, v)) in p.iter().zip(positions) {
        for (o, &x) in out.iter_mut().zip(&v[off..]) {
            *o += pj * x;
        }
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
) -> impl Iterator<Item = KvRow<'r>> {
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

/// Dot product in eight lanes reduced by the tree the AVX2 build uses; a tail shorter than
/// eight (head sizes the AVX2 build does not take) is added last.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut l = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            l[i] += x[i] * y[i];
        }
    }
    (((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))) + tail
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::KvRow;

    /// Keys per block of dot products: one register of scores.
    const KEYS: usize = 8;
    /// 8-float chunks of a head held in registers by the weighted sum.
    const CHUNKS: usize = 4;

    /// `scores[j] = dot(q, k_j[off..off + q.len()]) * scale`, eight keys at a time.
    ///
    /// # Safety
    /// The CPU must have AVX2; `q.len()` must be a multiple of 8, and every key row must hold
    /// `off + q.len()` floats.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn scaled_dots(
        q: &[f32],
        positions: &[KvRow<'_>],
        off: usize,
        scale: f32,
        scores: &mut [f32],
    ) {
        let d = q.len();
        let scale = _mm256_set1_ps(scale);
        for (block, out) in positions.chunks(KEYS).zip(scores.chunks_mut(KEYS)) {
            // A short last block repeats its first key; its extra scores are dropped.
            let keys: [*const f32; KEYS] = std::array::from_fn(|j| {
                let (k, _) = block[if j < block.len() { j } else { 0 }];
                k[off..off + d].as_ptr()
            });
            let mut acc = [_mm256_setzero_ps(); KEYS];
            for c in (0..d).step_by(8) {
                // SAFETY: `c + 8 <= d` and every key row holds `off + d` floats.
                unsafe {
                    let qc = _mm256_loadu_ps(q.as_ptr().add(c));
                    for (a, k) in acc.iter_mut().zip(keys) {
                        *a = _mm256_add_ps(*a, _mm256_mul_ps(qc, _mm256_loadu_ps(k.add(c))));
                    }
                }
            }
            // Lane sums of eight keys at once: ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)).
            let h01 = _mm256_hadd_ps(acc[0], acc[1]);
            let h23 = _mm256_hadd_ps(acc[2], acc[3]);
            let h45 = _mm256_hadd_ps(acc[4], acc[5]);
            let h67 = _mm256_hadd_ps(acc[6], acc[7]);
            let h0123 = _mm256_hadd_ps(h01, h23);
            let h4567 = _mm256_hadd_ps(h45, h67);
            let low = _mm256_permute2f128_ps::<0x20>(h0123, h4567);
            let high = _mm256_permute2f128_ps::<0x31>(h0123, h4567);
            let s = _mm256_mul_ps(_mm256_add_ps(low, high), scale);
            let mut lanes = [0f32; KEYS];
            // SAFETY: `lanes` holds 8 floats.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), s) };
            out.copy_from_slice(&lanes[..out.len()]);
        }
    }

    /// [`super::weighted_sum`], 32 output floats (then 8) held in registers at a time.
    ///
    /// # Safety
    /// The CPU must have AVX2; `out.len()` must be a multiple of 8, and every value row must
    /// hold `off + out.len()` floats.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn weighted_sum(
        p: &[f32],
        positions: &[KvRow<'_>],
        off: usize,
        out: &mut [f32],
    ) {
        let mut at = 0;
        while out.len() - at >= 8 * CHUNKS {
            weighted_block::<CHUNKS>(p, positions, off + at, &mut out[at..at + 8 * CHUNKS]);
            at += 8 * CHUNKS;
        }
        while at < out.len() {
            weighted_block::<1>(p, positions, off + at, &mut out[at..at + 8]);
            at += 8;
        }
    }

    /// `out` (`8 * C` floats) `= sum_j p[j] * v_j[off..off + 8 * C]`.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn weighted_block<const C: usize>(
        p: &[f32],
        positions: &[KvRow<'_>],
        off: usize,
        out: &mut [f32],
    ) {
        let mut acc = [_mm256_setzero_ps(); C];
        for (&pj, (_, v)) in p.iter().zip(positions) {
            let w = _mm256_set1_ps(pj);
            let v = &v[off..off + 8 * C];
            for (c, a) in acc.iter_mut().enumerate() {
                // SAFETY: chunk `c` lies inside the `8 * C` floats sliced above.
                let x = unsafe { _mm256_loadu_ps(v.as_ptr().add(8 * c)) };
                *a = _mm256_add_ps(*a, _mm256_mul_ps(w, x));
            }
        }
        for (c, a) in acc.iter().enumerate() {
            // SAFETY: `out` holds `8 * C` floats.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(8 * c), *a) };
        }
    }
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

    /// The dispatched kernel (AVX2 where the CPU has it) gives the portable build's bits, for
    /// head sizes the AVX2 build takes and histories that are not a multiple of its 8 keys.
    #[test]
    fn the_simd_build_gives_the_portable_bits() {
        for d in [8, 16, 32, 64, 128] {
            for keys in [2, 7, 8, 13, 40] {
                let (heads, kv_heads, t) = (4, 2, 2);
                let kv_w = kv_heads * d;
                let keys_v = values(keys * kv_w, 5);
                let vals = values(keys * kv_w, 6);
                let q = values(t * heads * d, 7);
                let sinks = values(heads, 8);
                let runs = [KvRun {
                    keys: &keys_v,
                    values: &vals,
                }];
                let rows = RowAttention {
                    heads,
                    kv_heads,
                    head_dim: d,
                    scale: (d as f32).powf(-0.5),
                    kind: AttentionKind::Full,
                    sinks: Some(&sinks),
                };
                let past = keys - t;
                let mut fast = vec![0f32; t * heads * d];
                let mut portable = fast.clone();
                rows.attend(&q, past, 0, &runs, &mut Vec::new(), &mut fast);
                rows.attend_rows::<false>(&q, past, 0, &runs, &mut Vec::new(), &mut portable);
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&fast), bits(&portable), "d={d} keys={keys}");
            }
        }
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
