//! The AVX2 kernel's dot products and weighted sums for up to [`GROUP`] query heads that share
//! one key/value head, side by side: each key and value chunk is loaded once for all of them.
//! The operations of each head are the AVX2 build's, in its order (so the same bits); the
//! AVX-512VL encoding only adds registers (32 of 256 bits instead of 16), which three heads' 24
//! accumulators need.

use std::arch::x86_64::*;

use super::KvRow;
use super::avx2::KEYS;

/// Most query heads taken together.
pub(super) const GROUP: usize = 3;
/// 8-float chunks of a head held in registers by the weighted sum, per head.
const CHUNKS: usize = 4;

/// Whether this CPU can run these kernels.
pub(super) fn available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512vl")
    })
}

/// `scores[g][j] = dot(q[g], k_j[off..off + d]) * scale` for `G` heads, eight keys at a time:
/// the AVX2 build's [`super::avx2::scaled_dots`] for each head.
///
/// # Safety
/// The CPU must have the features of [`available`]; every `q[g]` must hold `d` floats (a
/// multiple of 8), every key row `off + d`, every `scores[g]` one float per position.
#[target_feature(enable = "avx2,avx512f,avx512vl")]
pub(super) unsafe fn scaled_dots<const G: usize>(
    q: [&[f32]; G],
    positions: &[KvRow<'_>],
    off: usize,
    scale: f32,
    scores: &mut [&mut [f32]; G],
) {
    let d = q[0].len();
    let scale = _mm256_set1_ps(scale);
    for (b, block) in positions.chunks(KEYS).enumerate() {
        // A short last block repeats its first key; its extra scores are dropped.
        let keys: [*const f32; KEYS] = std::array::from_fn(|j| {
            let (k, _) = block[if j < block.len() { j } else { 0 }];
            k[off..off + d].as_ptr()
        });
        let mut acc = [[_mm256_setzero_ps(); KEYS]; G];
        for c in (0..d).step_by(8) {
            // SAFETY: `c + 8 <= d`, every query holds `d` floats and every key row `off + d`.
            unsafe {
                let qc: [__m256; G] =
                    std::array::from_fn(|g| _mm256_loadu_ps(q[g].as_ptr().add(c)));
                for (j, k) in keys.iter().enumerate() {
                    let kc = _mm256_loadu_ps(k.add(c));
                    for (head, qc) in acc.iter_mut().zip(qc) {
                        head[j] = _mm256_add_ps(head[j], _mm256_mul_ps(qc, kc));
                    }
                }
            }
        }
        for (a, scores) in acc.iter().zip(scores.iter_mut()) {
            let s = super::avx2::key_sums(a, scale);
            let mut lanes = [0f32; KEYS];
            // SAFETY: `lanes` holds 8 floats.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), s) };
            let out = &mut scores[b * KEYS..b * KEYS + block.len()];
            out.copy_from_slice(&lanes[..block.len()]);
        }
    }
}

/// `out[g] = sum_j p[g][j] * v_j[off..off + d]` for `G` heads: the AVX2 build's
/// [`super::avx2::weighted_sum`] for each head, 32 floats (then 8) of every head at a time.
///
/// # Safety
/// The CPU must have the features of [`available`]; every `out[g]` must hold `d` floats (a
/// multiple of 8), every value row `off + d`, every `p[g]` one weight per position.
#[target_feature(enable = "avx2,avx512f,avx512vl")]
pub(super) unsafe fn weighted_sum<const G: usize>(
    p: [&[f32]; G],
    positions: &[KvRow<'_>],
    off: usize,
    out: &mut [&mut [f32]; G],
) {
    let d = out[0].len();
    let mut at = 0;
    while d - at >= 8 * CHUNKS {
        weighted_block::<G, CHUNKS>(p, positions, off, at, out);
        at += 8 * CHUNKS;
    }
    while at < d {
        weighted_block::<G, 1>(p, positions, off, at, out);
        at += 8;
    }
}

/// Floats `at..at + 8 * C` of every head's output.
#[target_feature(enable = "avx2,avx512f,avx512vl")]
#[inline]
fn weighted_block<const G: usize, const C: usize>(
    p: [&[f32]; G],
    positions: &[KvRow<'_>],
    off: usize,
    at: usize,
    out: &mut [&mut [f32]; G],
) {
    let mut acc = [[_mm256_setzero_ps(); C]; G];
    for (j, (_, v)) in positions.iter().enumerate() {
        let w: [__m256; G] = std::array::from_fn(|g| _mm256_set1_ps(p[g][j]));
        let v = &v[off + at..off + at + 8 * C];
        // SAFETY: chunk `c` lies inside the `8 * C` floats sliced above.
        let x: [__m256; C] =
            std::array::from_fn(|c| unsafe { _mm256_loadu_ps(v.as_ptr().add(8 * c)) });
        for (head, w) in acc.iter_mut().zip(w) {
            for (a, x) in head.iter_mut().zip(x) {
                *a = _mm256_add_ps(*a, _mm256_mul_ps(w, x));
            }
        }
    }
    for (head, out) in acc.iter().zip(out.iter_mut()) {
        let o = &mut out[at..at + 8 * C];
        for (c, a) in head.iter().enumerate() {
            // SAFETY: `o` holds `8 * C` floats.
            unsafe { _mm256_storeu_ps(o.as_mut_ptr().add(8 * c), *a) };
        }
    }
}
