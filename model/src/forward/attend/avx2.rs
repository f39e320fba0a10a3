//! The AVX2 build of the decode attention kernel: the same operations as the portable one,
//! eight lanes at a time (see the parent module for the order they keep).

use std::arch::x86_64::*;

use super::KvRow;

/// Keys per block of dot products: one register of scores.
pub(super) const KEYS: usize = 8;
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
        let s = key_sums(&acc, scale);
        let mut lanes = [0f32; KEYS];
        // SAFETY: `lanes` holds 8 floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), s) };
        out.copy_from_slice(&lanes[..out.len()]);
    }
}

/// The scaled dot products of eight keys from their accumulators, all lane sums at once:
/// ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)) for each, times `scale`.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn key_sums(acc: &[__m256; KEYS], scale: __m256) -> __m256 {
    let h01 = _mm256_hadd_ps(acc[0], acc[1]);
    let h23 = _mm256_hadd_ps(acc[2], acc[3]);
    let h45 = _mm256_hadd_ps(acc[4], acc[5]);
    let h67 = _mm256_hadd_ps(acc[6], acc[7]);
    let h0123 = _mm256_hadd_ps(h01, h23);
    let h4567 = _mm256_hadd_ps(h45, h67);
    let low = _mm256_permute2f128_ps::<0x20>(h0123, h4567);
    let high = _mm256_permute2f128_ps::<0x31>(h0123, h4567);
    _mm256_mul_ps(_mm256_add_ps(low, high), scale)
}

/// [`super::exp_nonpositive`] of eight values.
#[target_feature(enable = "avx2")]
#[inline]
fn exp_nonpositive(x: __m256) -> __m256 {
    use super::{EXP_FLOOR, EXP_LN2_HIGH, EXP_LN2_LOW, EXP_LOG2E, EXP_POLY};
    let x = _mm256_max_ps(x, _mm256_set1_ps(EXP_FLOOR));
    let n = _mm256_floor_ps(_mm256_add_ps(
        _mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
        _mm256_set1_ps(0.5),
    ));
    let r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(EXP_LN2_HIGH)));
    let r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(EXP_LN2_LOW)));
    let mut y = _mm256_set1_ps(EXP_POLY[0]);
    for &c in &EXP_POLY[1..] {
        y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(c));
    }
    let y = _mm256_add_ps(
        _mm256_add_ps(_mm256_mul_ps(y, _mm256_mul_ps(r, r)), r),
        _mm256_set1_ps(1.0),
    );
    let bits = _mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvttps_epi32(n),
        _mm256_set1_epi32(127),
    ));
    _mm256_mul_ps(y, _mm256_castsi256_ps(bits))
}

/// [`super::softmax`], eight scores at a time.
///
/// # Safety
/// The CPU must have AVX2.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn softmax(scores: &mut [f32], sink: Option<f32>) {
    let max = super::softmax_max(scores, sink);
    let vmax = _mm256_set1_ps(max);
    let mut acc = _mm256_setzero_ps();
    let mut chunks = scores.chunks_exact_mut(8);
    for chunk in &mut chunks {
        // SAFETY: `chunk` holds 8 floats.
        unsafe {
            let e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(chunk.as_ptr()), vmax));
            _mm256_storeu_ps(chunk.as_mut_ptr(), e);
            acc = _mm256_add_ps(acc, e);
        }
    }
    let mut lanes = [0f32; 8];
    // SAFETY: `lanes` holds 8 floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
    for (s, l) in chunks.into_remainder().iter_mut().zip(lanes.iter_mut()) {
        *s = super::exp_nonpositive(*s - max);
        *l += *s;
    }
    let mut denom = super::tree(lanes);
    if let Some(s) = sink {
        denom += super::exp_nonpositive(s - max);
    }
    let d = _mm256_set1_ps(denom);
    let mut chunks = scores.chunks_exact_mut(8);
    for chunk in &mut chunks {
        // SAFETY: `chunk` holds 8 floats.
        unsafe {
            _mm256_storeu_ps(
                chunk.as_mut_ptr(),
                _mm256_div_ps(_mm256_loadu_ps(chunk.as_ptr()), d),
            )
        };
    }
    for s in chunks.into_remainder() {
        *s /= denom;
    }
}

/// [`super::weighted_sum`], 32 output floats (then 8) held in registers at a time.
///
/// # Safety
/// The CPU must have AVX2; `out.len()` must be a multiple of 8, and every value row must
/// hold `off + out.len()` floats.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn weighted_sum(p: &[f32], positions: &[KvRow<'_>], off: usize, out: &mut [f32]) {
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
fn weighted_block<const C: usize>(p: &[f32], positions: &[KvRow<'_>], off: usize, out: &mut [f32]) {
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
