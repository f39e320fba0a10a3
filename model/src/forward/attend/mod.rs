//! Attention of a few query rows straight over the cache's key and value runs.
//!
//! Decode is one query per sequence: as tensor operations that is a dozen tiny kernels per
//! sequence and layer, and their fixed costs dominate the step at batch 32 or 64. Here the
//! same math (scaled dot products, optional sink logit, softmax, weighted values) runs as
//! plain loops over rows the cache already holds, with no copy of the history. Long prompt
//! chunks still go through the matmul path.
//!
//! Three builds give the same bits: a portable one; on x86-64 with AVX2, one in intrinsics
//! (head sizes a multiple of 8); and where AVX-512VL adds registers, the same intrinsics for up
//! to three query heads of one key/value head together, which load each key and value once for
//! all of them (16 sequences of one query against 128 keys: 167 -> 105 us with medium
//! Mixtral's 12/4 heads, 838 -> 510 us with GPT-OSS-20B's 64/8; from about a thousand keys the
//! cache's reads bound both). All add a dot product's products in 8 lanes, in order, then
//! reduce the lanes by the tree `((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7))`, which is what
//! horizontal adds of eight keys at once produce; weighted values accumulate per element in
//! key order, which vector lanes do unchanged; the softmax takes its exponentials from
//! `exp_nonpositive` (libm's `expf` has no vector twin with the same bits) and sums them the
//! way the dot products sum lanes. Neither build uses fused multiply-adds.

use std::ops::Range;

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

/// One sequence's new queries and the history they attend to.
#[derive(Debug, Clone, Copy)]
pub struct SpanQueries<'a> {
    /// Query rows `[t, heads * head_dim]`, at positions `past..past + t`.
    pub q: &'a [f32],
    /// Position of the first query.
    pub past: usize,
    /// The earliest position any query may see (where `runs` start).
    pub first_key: usize,
    /// Keys and values of positions `first_key..past + t`, in order.
    pub runs: &'a [KvRun<'a>],
}

impl RowAttention<'_> {
    /// Attention output `[t, heads * head_dim]` of `span`'s queries into `out`; `scores` is
    /// scratch space reused across calls.
    pub fn attend(&self, span: SpanQueries<'_>, scores: &mut Vec<f32>, out: &mut [f32]) {
        self.attend_heads(span, 0..self.kv_heads, scores, out);
    }

    /// The query heads of key/value heads `kv` only, with the bits [`Self::attend`] gives
    /// them: each row of `out` holds those heads in order (`kv.len()` groups of
    /// `heads / kv_heads` heads of `head_dim` floats). Disjoint ranges of one span can run on
    /// different threads: a head reads only its own key/value head and writes only its output.
    pub fn attend_heads(
        &self,
        span: SpanQueries<'_>,
        kv: Range<usize>,
        scores: &mut Vec<f32>,
        out: &mut [f32],
    ) {
        assert!(
            kv.start <= kv.end && kv.end <= self.kv_heads,
            "key/value heads {kv:?} of {}",
            self.kv_heads
        );
        #[cfg(target_arch = "x86_64")]
        if self.head_dim.is_multiple_of(8) {
            if self.heads > self.kv_heads && grouped::available() {
                // SAFETY: the CPU has the grouped kernels' features and the head size is a
                // multiple of 8, checked above.
                return unsafe { self.attend_grouped(span, kv, scores, out) };
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU has AVX2 and the head size is a multiple of 8, checked above.
                return unsafe { self.attend_avx2(span, kv, scores, out) };
            }
        }
        self.attend_rows::<false, false>(span, kv, scores, out);
    }

    /// # Safety
    /// The CPU must support AVX2 and `head_dim` must be a multiple of 8.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn attend_avx2(
        &self,
        span: SpanQueries<'_>,
        kv: Range<usize>,
        scores: &mut Vec<f32>,
        out: &mut [f32],
    ) {
        self.attend_rows::<true, false>(span, kv, scores, out);
    }

    /// # Safety
    /// The CPU must have the features of [`grouped::available`] and `head_dim` must be a
    /// multiple of 8.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,avx512f,avx512vl")]
    unsafe fn attend_grouped(
        &self,
        span: SpanQueries<'_>,
        kv: Range<usize>,
        scores: &mut Vec<f32>,
        out: &mut [f32],
    ) {
        self.attend_rows::<true, true>(span, kv, scores, out);
    }

    /// The kernel; `SIMD` selects the AVX2 dot products, softmax and weighted sums, `GROUPED`
    /// takes the query heads of one key/value head up to three at a time (the caller has
    /// checked the CPU and the head size). Only the query heads of key/value heads `kv`, into
    /// rows of `out` as wide as those heads.
    #[inline(always)]
    fn attend_rows<const SIMD: bool, const GROUPED: bool>(
        &self,
        span: SpanQueries<'_>,
        kv: Range<usize>,
        scores: &mut Vec<f32>,
        out: &mut [f32],
    ) {
        let SpanQueries {
            q,
            past,
            first_key,
            runs,
        } = span;
        let (d, kv_w) = (self.head_dim, self.kv_heads * self.head_dim);
        let group = (self.heads / self.kv_heads.max(1)).max(1);
        let q_w = self.heads * d;
        // The query heads of `kv`; `out`'s rows hold only theirs.
        let heads = (kv.start * group).min(self.heads)..(kv.end * group).min(self.heads);
        let out_w = heads.len() * d;
        if out_w == 0 {
            return;
        }
        let mut positions: Vec<KvRow<'_>> = Vec::new();
        for (i, (qi, oi)) in q
            .chunks_exact(q_w)
            .zip(out.chunks_exact_mut(out_w))
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
            #[cfg(target_arch = "x86_64")]
            if GROUPED && !positions.is_empty() {
                // SAFETY: GROUPED is only set by `attend_grouped`, whose caller checked the
                // CPU and that `d` is a multiple of 8.
                unsafe { self.grouped_heads(heads.clone(), qi, oi, &positions, scores) };
                continue;
            }
            scores.clear();
            scores.resize(positions.len(), 0.0);
            for h in heads.clone() {
                let off = (h / group) * d;
                let qh = &qi[h * d..(h + 1) * d];
                let sink = self.sinks.map(|s| s[h]);
                let o = (h - heads.start) * d;
                let oh = &mut oi[o..o + d];
                if SIMD {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: SIMD is only set by `attend_avx2`, whose caller checked AVX2 and
                    // that `d` is a multiple of 8.
                    unsafe {
                        avx2::scaled_dots(qh, &positions, off, self.scale, scores);
                        avx2::softmax(scores, sink);
                        avx2::weighted_sum(scores, &positions, off, oh);
                    }
                } else {
                    for (s, (k, _)) in scores.iter_mut().zip(&positions) {
                        *s = dot(qh, &k[off..off + d]) * self.scale;
                    }
                    softmax(scores, sink);
                    weighted_sum(scores, &positions, off, oh);
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
impl RowAttention<'_> {
    /// One query row's heads `heads` (whole groups of one key/value head) against
    /// `positions`, into `oi` (those heads' outputs), the heads of each key/value head up to
    /// [`grouped::GROUP`] at a time.
    ///
    /// # Safety
    /// As [`Self::attend_grouped`]; `positions` is not empty.
    #[inline(always)]
    unsafe fn grouped_heads(
        &self,
        heads: Range<usize>,
        qi: &[f32],
        oi: &mut [f32],
        positions: &[KvRow<'_>],
        scores: &mut Vec<f32>,
    ) {
        let d = self.head_dim;
        let group = (self.heads / self.kv_heads.max(1)).max(1);
        scores.clear();
        scores.resize(grouped::GROUP * positions.len(), 0.0);
        let first = heads.start;
        let mut h = heads.start;
        while h < heads.end {
            // Heads h.. that share h's key/value head.
            let kv = h / group;
            let same = ((kv + 1) * group).min(heads.end) - h;
            let g = same.min(grouped::GROUP);
            let at = (h, first, kv * d);
            // SAFETY: forwarded from the caller.
            unsafe {
                match g {
                    1 => self.heads_together::<1>(at, qi, oi, positions, scores),
                    2 => self.heads_together::<2>(at, qi, oi, positions, scores),
                    _ => self.heads_together::<3>(at, qi, oi, positions, scores),
                }
            }
            h += g;
        }
    }

    /// Heads `h0..h0 + G` (sharing the key/value head at offset `off`) of one query row, into
    /// `oi`, whose first head is `first`.
    ///
    /// # Safety
    /// As [`Self::grouped_heads`]; `scores` holds `G` floats per position.
    #[inline(always)]
    unsafe fn heads_together<const G: usize>(
        &self,
        (h0, first, off): (usize, usize, usize),
        qi: &[f32],
        oi: &mut [f32],
        positions: &[KvRow<'_>],
        scores: &mut [f32],
    ) {
        let (d, n) = (self.head_dim, positions.len());
        let mut parts = scores.chunks_exact_mut(n);
        let mut parts: [&mut [f32]; G] = std::array::from_fn(|_| parts.next().unwrap_or_default());
        let q: [&[f32]; G] = std::array::from_fn(|g| &qi[(h0 + g) * d..(h0 + g + 1) * d]);
        let mut outs = oi[(h0 - first) * d..(h0 - first + G) * d].chunks_exact_mut(d);
        let mut outs: [&mut [f32]; G] = std::array::from_fn(|_| outs.next().unwrap_or_default());
        // SAFETY: the caller checked the CPU and that `d` is a multiple of 8; each query and
        // output holds `d` floats, each part one float per position, and every key and value
        // row holds the key/value heads' floats (`off + d` at least).
        unsafe {
            grouped::scaled_dots::<G>(q, positions, off, self.scale, &mut parts);
            for (g, part) in parts.iter_mut().enumerate() {
                avx2::softmax(part, self.sinks.map(|s| s[h0 + g]));
            }
            let p: [&[f32]; G] = std::array::from_fn(|g| &*parts[g]);
            grouped::weighted_sum::<G>(p, positions, off, &mut outs);
        }
    }
}

/// Softmax of `scores` in place, with an optional extra logit in the denominator only: the
/// exponentials by [`exp_nonpositive`], their sum in 8 lanes (element `j` into lane `j % 8`,
/// in order) reduced by the dot products' tree.
#[inline(always)]
fn softmax(scores: &mut [f32], sink: Option<f32>) {
    let max = softmax_max(scores, sink);
    let mut lanes = [0f32; 8];
    for chunk in scores.chunks_mut(8) {
        for (s, l) in chunk.iter_mut().zip(lanes.iter_mut()) {
            *s = exp_nonpositive(*s - max);
            *l += *s;
        }
    }
    let mut denom = tree(lanes);
    if let Some(s) = sink {
        denom += exp_nonpositive(s - max);
    }
    for s in scores.iter_mut() {
        *s /= denom;
    }
}

/// The largest of the scores and the sink.
#[inline(always)]
fn softmax_max(scores: &[f32], sink: Option<f32>) -> f32 {
    scores
        .iter()
        .copied()
        .chain(sink)
        .fold(f32::NEG_INFINITY, f32::max)
}

/// `((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7))`.
#[inline(always)]
fn tree(l: [f32; 8]) -> f32 {
    ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
}

/// Cody-Waite range reduction and a degree-5 polynomial (the Cephes `expf` constants).
const EXP_LOG2E: f32 = std::f32::consts::LOG2_E;
const EXP_LN2_HIGH: f32 = 0.693_359_4;
const EXP_LN2_LOW: f32 = -2.121_944_4e-4;
const EXP_POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    0.166_666_65,
    0.5,
];
/// Below this `e^x` is under the smallest normal float: arguments are clamped to it, so the
/// result stays about `f32::MIN_POSITIVE` instead of reaching 0 (weights that small vanish in
/// the sums anyway).
const EXP_FLOOR: f32 = -87.336_55;

/// `e^x` for `x <= 0` (softmax arguments), within 2 ulp, from plain IEEE operations that the
/// AVX2 build repeats eight at a time, so both give the same bits (libm's `expf` would differ
/// between scalar and vector code).
#[inline(always)]
fn exp_nonpositive(x: f32) -> f32 {
    let x = x.max(EXP_FLOOR);
    let n = (x * EXP_LOG2E + 0.5).floor();
    let r = x - n * EXP_LN2_HIGH;
    let r = r - n * EXP_LN2_LOW;
    let mut y = EXP_POLY[0];
    for &c in &EXP_POLY[1..] {
        y = y * r + c;
    }
    let y = y * (r * r) + r + 1.0;
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
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
    tree(l) + tail
}

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod grouped;

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
        #[cfg(target_arch = "x86_64")]
        let lacking = [
            (std::arch::is_x86_feature_detected!("avx2"), "AVX2"),
            (
                grouped::available(),
                "the grouped kernels' AVX2 and AVX-512 (F, VL)",
            ),
        ];
        #[cfg(not(target_arch = "x86_64"))]
        let lacking = [(false, "AVX2"), (false, "AVX-512 (F, VL)")];
        for (_, what) in lacking.iter().filter(|(has, _)| !has) {
            test_skips::skipped(&format!(
                "this CPU lacks {what}: that build was not checked"
            ));
        }
        for d in [8, 16, 32, 64, 128] {
            for (keys, (heads, kv_heads)) in [2, 7, 8, 13, 40]
                .into_iter()
                .flat_map(|k| [(4, 2), (3, 1), (2, 2), (8, 1), (10, 2)].map(|s| (k, s)))
            {
                let t = 2;
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
                let span = SpanQueries {
                    q: &q,
                    past,
                    first_key: 0,
                    runs: &runs,
                };
                rows.attend_rows::<false, false>(span, 0..kv_heads, &mut Vec::new(), &mut portable);
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                rows.attend(span, &mut Vec::new(), &mut fast);
                assert_eq!(
                    bits(&fast),
                    bits(&portable),
                    "d={d} keys={keys} heads={heads}/{kv_heads}"
                );
                #[cfg(target_arch = "x86_64")]
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: the CPU has AVX2; `d` is a multiple of 8.
                    unsafe { rows.attend_avx2(span, 0..kv_heads, &mut Vec::new(), &mut fast) };
                    assert_eq!(bits(&fast), bits(&portable), "AVX2, d={d} keys={keys}");
                }
                #[cfg(target_arch = "x86_64")]
                if grouped::available() {
                    // SAFETY: the CPU has the grouped kernels' features; `d` is a multiple of 8.
                    unsafe { rows.attend_grouped(span, 0..kv_heads, &mut Vec::new(), &mut fast) };
                    assert_eq!(
                        bits(&fast),
                        bits(&portable),
                        "grouped, d={d} keys={keys} heads={heads}/{kv_heads}"
                    );
                }
            }
        }
    }

    /// A row's key/value heads computed range by range, as the pool's threads take them, give
    /// each head the bits the whole row gives it; with sinks, sliding windows, and every way
    /// of cutting the key/value heads into consecutive ranges.
    #[test]
    fn key_value_head_ranges_give_the_whole_rows_bits() {
        let d = 64;
        for (heads, kv_heads) in [(12, 4), (8, 8), (6, 2), (4, 1)] {
            for kind in [AttentionKind::Full, AttentionKind::Sliding { window: 9 }] {
                let keys = 37;
                let kv_w = kv_heads * d;
                let keys_v = values(keys * kv_w, 11);
                let vals = values(keys * kv_w, 12);
                let q = values(heads * d, 13);
                let sinks = values(heads, 14);
                let (first, second) = (keys_v.split_at(20 * kv_w), vals.split_at(20 * kv_w));
                let runs = [
                    KvRun {
                        keys: first.0,
                        values: second.0,
                    },
                    KvRun {
                        keys: first.1,
                        values: second.1,
                    },
                ];
                let rows = RowAttention {
                    heads,
                    kv_heads,
                    head_dim: d,
                    scale: (d as f32).powf(-0.5),
                    kind,
                    sinks: Some(&sinks),
                };
                let span = SpanQueries {
                    q: &q,
                    past: keys - 1,
                    first_key: 0,
                    runs: &runs,
                };
                let mut whole = vec![0f32; heads * d];
                rows.attend(span, &mut Vec::new(), &mut whole);
                let group = heads / kv_heads;
                // Every cut of 0..kv_heads into consecutive ranges (one bit per boundary).
                for cuts in 0u32..1 << (kv_heads - 1) {
                    let mut pieces = Vec::new();
                    let mut start = 0;
                    for kv in 1..=kv_heads {
                        if kv == kv_heads || cuts & (1 << (kv - 1)) != 0 {
                            let mut out = vec![f32::NAN; (kv - start) * group * d];
                            rows.attend_heads(span, start..kv, &mut Vec::new(), &mut out);
                            pieces.extend(out);
                            start = kv;
                        }
                    }
                    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&pieces),
                        bits(&whole),
                        "heads {heads}/{kv_heads}, {kind:?}, cuts {cuts:b}"
                    );
                }
            }
        }
    }

    /// The softmax exponential is within 2 ulp of the true value (and exact at 0); far below
    /// the smallest normal float it stays about there.
    #[test]
    fn the_softmax_exponential_is_accurate() {
        assert_eq!(exp_nonpositive(0.0), 1.0);
        let mut worst = 0f64;
        for i in 0..=200_000 {
            let x = -(i as f32) * 87.0 / 200_000.0;
            let want = (x as f64).exp();
            let got = exp_nonpositive(x) as f64;
            worst = worst.max(((got - want) / want).abs());
        }
        assert!(worst < 2.5e-7, "largest relative error {worst:e}");
        let tiny = exp_nonpositive(-1000.0);
        assert!(
            (0.99 * f32::MIN_POSITIVE..1.01 * f32::MIN_POSITIVE).contains(&tiny),
            "{tiny:e}"
        );
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
                    let span = SpanQueries {
                        q: &q,
                        past,
                        first_key,
                        runs: &runs,
                    };
                    rows.attend(span, &mut Vec::new(), &mut out);

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
