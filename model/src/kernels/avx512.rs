//! The AVX-512 path of the matrix kernel: `R` weight rows x `T` inputs per register block,
//! each block of 32 weights decoded into two vectors in registers (bf16: a shift and a mask,
//! or a widen and a shift; f16: `vcvtph2ps`; MXFP4: nibbles looked up in the 16 FP4 values
//! pre-multiplied by the block's scale; MXINT8: widen, convert, scale).
//!
//! It computes [`super::portable`]'s bits: the same decoded values, each term added as one
//! fused multiply-add or as a separate multiply and add as the order says, lanes folded by
//! [`super::fold_lanes`]'s tree in registers.

use super::x86::{
    BF16, F16, F32, MXFP4, MXFP4_PAIRS, MXFP4_PAIRS_SECOND, MXINT8, data_at, prefetch,
    second_of_pair,
};
use super::{BLOCK, BlockFormat, BlockRows, LANES, Reduction, Sink, SumOrder};
use crate::mxfp4::{self, ScaledFp4};
use std::arch::x86_64::*;

/// Whether this CPU can run this path.
pub(super) fn available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
    })
}

/// See [`super::block_sums`].
///
/// # Safety
/// The CPU must have the features of [`available`]; `w` and `x` must hold every block (and half
/// block) the call reads ([`BlockRows::check`]).
#[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
pub(super) unsafe fn block_sums<O: SumOrder, const R: usize, const T: usize>(
    w: &BlockRows<'_, R>,
    x: &[&[f32]; T],
    reduction: &Reduction,
    emit: impl Sink<R, T>,
) {
    let scaled = mxfp4::scaled_fp4();
    // The prefetch is a type parameter so that the loop without it carries none of its code
    // (the register allocator treats the whole loop alike).
    macro_rules! go {
        ($f:expr) => {
            // SAFETY: forwarded from the caller.
            unsafe {
                if w.prefetch > 0 && w.prefetch_steps(reduction.blocks.end).is_some() {
                    sums::<O, { $f }, R, T, true>(w, x, reduction, scaled, emit)
                } else {
                    sums::<O, { $f }, R, T, false>(w, x, reduction, scaled, emit)
                }
            }
        };
    }
    match w.format {
        BlockFormat::F32 => go!(F32),
        BlockFormat::Bf16 => go!(BF16),
        BlockFormat::F16 => go!(F16),
        BlockFormat::Mxfp4 => go!(MXFP4),
        BlockFormat::Mxint8 => go!(MXINT8),
        BlockFormat::Mxfp4RowPairs if w.pair_offset == 1 => go!(MXFP4_PAIRS_SECOND),
        BlockFormat::Mxfp4RowPairs => go!(MXFP4_PAIRS),
    }
}

/// The two lane vectors of the block at `data` (scale byte at `scale`, read by MX formats):
/// its even and odd values when `pairs` (bf16, f16, MXFP4), else its two halves. A row pair's
/// block ([`MXFP4_PAIRS`]) gives its first row's values, or its second's when `second`.
///
/// # Safety
/// The block's bytes (and its scale byte, for MX formats) must be readable; the CPU must have
/// the features of [`available`].
#[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
#[inline]
unsafe fn decode<const F: u8>(
    pairs: bool,
    second: bool,
    data: *const u8,
    scale: *const u8,
    scaled: &ScaledFp4,
) -> (__m512, __m512) {
    // SAFETY: the caller guarantees the bytes read here are inside the rows.
    unsafe {
        match F {
            MXFP4_PAIRS | MXFP4_PAIRS_SECOND => {
                // The permute reads the low 4 bits of each index: the row's nibble once the
                // second row's is shifted down.
                let nibbles = |v: __m512i| if second { _mm512_srli_epi32::<4>(v) } else { v };
                let table = _mm512_load_ps(scaled.0[*scale as usize].as_ptr());
                if pairs {
                    // 32-bit lane l: bytes 2l and 2l + 1, the row's elements 2l and 2l + 1.
                    let v = nibbles(_mm512_cvtepu16_epi32(_mm256_loadu_si256(data.cast())));
                    (
                        _mm512_permutexvar_ps(v, table),
                        _mm512_permutexvar_ps(_mm512_srli_epi32::<8>(v), table),
                    )
                } else {
                    let half = |p: *const u8| {
                        let v = nibbles(_mm512_cvtepu8_epi32(_mm_loadu_si128(p.cast())));
                        _mm512_permutexvar_ps(v, table)
                    };
                    (half(data), half(data.add(LANES)))
                }
            }
            F32 => {
                let p = data.cast::<f32>();
                (_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(LANES)))
            }
            BF16 if pairs => {
                let v = _mm512_loadu_si512(data.cast());
                let even = _mm512_slli_epi32::<16>(v);
                let odd = _mm512_and_si512(v, _mm512_set1_epi32(0xffff_0000u32 as i32));
                (_mm512_castsi512_ps(even), _mm512_castsi512_ps(odd))
            }
            BF16 => (bf16_half(data), bf16_half(data.add(2 * LANES))),
            F16 if pairs => {
                let v = _mm512_loadu_si512(data.cast());
                let even = _mm512_cvtepi32_epi16(v);
                let odd = _mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(v));
                (_mm512_cvtph_ps(even), _mm512_cvtph_ps(odd))
            }
            F16 => (f16_half(data), f16_half(data.add(2 * LANES))),
            MXFP4 if pairs => {
                let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(data.cast()));
                let lo = _mm512_and_si512(v, _mm512_set1_epi32(0x0f));
                let hi = _mm512_srli_epi32::<4>(v);
                // The block's 16 values, already scaled: one aligned load (after the nibbles,
                // which keeps the compiler from holding every row's table live at once).
                let table = _mm512_load_ps(scaled.0[*scale as usize].as_ptr());
                (
                    _mm512_permutexvar_ps(lo, table),
                    _mm512_permutexvar_ps(hi, table),
                )
            }
            MXFP4 => {
                let v = _mm_loadu_si128(data.cast());
                let low = _mm_set1_epi8(0x0f);
                let lo = _mm_and_si128(v, low);
                let hi = _mm_and_si128(_mm_srli_epi16::<4>(v), low);
                // Byte j holds elements 2j (low) and 2j + 1 (high): interleaved back into
                // element order, bytes 0..8 give elements 0..16 and bytes 8..16 the rest.
                let (a, b) = (_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi));
                let table = _mm512_load_ps(scaled.0[*scale as usize].as_ptr());
                (
                    _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(a), table),
                    _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(b), table),
                )
            }
            _ => {
                let s = _mm512_set1_ps(mxfp4::SCALE_LUT[*scale as usize]);
                let a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(data.cast())));
                let b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                    data.add(LANES).cast(),
                )));
                (_mm512_mul_ps(a, s), _mm512_mul_ps(b, s))
            }
        }
    }
}

/// 16 bf16 values at `p`, widened.
///
/// # Safety
/// 32 bytes at `p` must be readable; AVX-512F/BW must be available.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn bf16_half(p: *const u8) -> __m512 {
    // SAFETY: forwarded from the caller.
    let h = unsafe { _mm256_loadu_si256(p.cast()) };
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
}

/// 16 f16 values at `p`, converted.
///
/// # Safety
/// 32 bytes at `p` must be readable; AVX-512F must be available.
#[target_feature(enable = "avx512f,f16c")]
#[inline]
unsafe fn f16_half(p: *const u8) -> __m512 {
    // SAFETY: forwarded from the caller.
    _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(p.cast()) })
}

/// The first 16 values of a dense block at `data`.
///
/// # Safety
/// Half the block's bytes must be readable; the CPU must have the features of [`available`].
#[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
#[inline]
unsafe fn decode_half<const F: u8>(data: *const u8) -> __m512 {
    // SAFETY: forwarded from the caller.
    unsafe {
        match F {
            F32 => _mm512_loadu_ps(data.cast()),
            BF16 => bf16_half(data),
            _ => f16_half(data),
        }
    }
}

/// One term per lane: `acc + w * x` as the order rounds it.
#[target_feature(enable = "avx512f,fma")]
#[inline]
fn term<O: SumOrder>(acc: __m512, w: __m512, x: __m512) -> __m512 {
    if O::FUSED {
        _mm512_fmadd_ps(w, x, acc)
    } else {
        _mm512_add_ps(acc, _mm512_mul_ps(w, x))
    }
}

/// The 16 lanes of `acc` folded by [`super::fold_lanes`]'s halving tree (8, 4, 2, 1).
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) fn fold(acc: __m512) -> f32 {
    let high = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(acc)));
    let v8 = _mm256_add_ps(_mm512_castps512_ps256(acc), high);
    let v4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps::<1>(v8));
    let v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
    _mm_cvtss_f32(_mm_add_ss(v2, _mm_movehdup_ps(v2)))
}

/// Every accumulator of a register block folded as [`fold`] folds it, 16 at a time by a
/// transposing tree: each step adds the halves of two vectors' live lanes at once, so 16
/// accumulators take 15 adds and 30 shuffles instead of 64 adds and the extracts between them.
/// Each result meets the same additions of the same values as in [`fold`], so the same bits.
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) fn fold_all<const R: usize, const T: usize>(acc: &[[__m512; T]; R]) -> [[f32; T]; R] {
    let mut out = [[0f32; T]; R];
    let n = R * T;
    let mut at = 0;
    while at < n {
        let take = (n - at).min(16);
        if take < 4 {
            for i in at..at + take {
                out[i / T][i % T] = fold(acc[i / T][i % T]);
            }
        } else {
            let v: [__m512; 16] = std::array::from_fn(|j| {
                let i = at + j;
                if j < take {
                    acc[i / T][i % T]
                } else {
                    _mm512_setzero_ps()
                }
            });
            let lanes = fold16(&v);
            for j in 0..take {
                let i = at + j;
                // Vector 4m + c lands in lane 4c + m.
                out[i / T][i % T] = lanes[(j % 4) * 4 + j / 4];
            }
        }
        at += take;
    }
    out
}

/// The folds of 16 vectors; vector `4m + c`'s lands in lane `4c + m`.
#[target_feature(enable = "avx512f")]
#[inline]
fn fold16(v: &[__m512; 16]) -> [f32; 16] {
    // 16 lanes to 8: [a.c0 + a.c2, a.c1 + a.c3, b.c0 + b.c2, b.c1 + b.c3] (c: 128-bit chunks).
    let s: [__m512; 8] = std::array::from_fn(|i| {
        let (a, b) = (v[2 * i], v[2 * i + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x44>(a, b),
            _mm512_shuffle_f32x4::<0xEE>(a, b),
        )
    });
    // 8 to 4: chunk c of u[j] holds vector 4j + c's four live lanes.
    let u: [__m512; 4] = std::array::from_fn(|j| {
        let (a, b) = (s[2 * j], s[2 * j + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x88>(a, b),
            _mm512_shuffle_f32x4::<0xDD>(a, b),
        )
    });
    // 4 to 2 within each chunk: lanes 0 + 2 and 1 + 3, of u[2k] then of u[2k + 1].
    let w: [__m512; 2] = std::array::from_fn(|k| {
        let (a, b) = (u[2 * k], u[2 * k + 1]);
        _mm512_add_ps(
            _mm512_shuffle_ps::<0x44>(a, b),
            _mm512_shuffle_ps::<0xEE>(a, b),
        )
    });
    // 2 to 1: lane 0 + lane 1 of each pair.
    let z = _mm512_add_ps(
        _mm512_shuffle_ps::<0x88>(w[0], w[1]),
        _mm512_shuffle_ps::<0xDD>(w[0], w[1]),
    );
    let mut lanes = [0f32; 16];
    // SAFETY: `lanes` holds 16 floats; the store is unaligned.
    unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), z) };
    lanes
}

/// # Safety
/// As [`block_sums`].
#[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
unsafe fn sums<O: SumOrder, const F: u8, const R: usize, const T: usize, const PREFETCH: bool>(
    w: &BlockRows<'_, R>,
    x: &[&[f32]; T],
    reduction: &Reduction,
    scaled: &ScaledFp4,
    mut emit: impl Sink<R, T>,
) {
    let pairs = O::PAIRED && matches!(F, BF16 | F16 | MXFP4 | MXFP4_PAIRS | MXFP4_PAIRS_SECOND);
    let (data, scales) = (w.data.as_ptr(), w.scales.as_ptr());
    let xs: [*const f32; T] = std::array::from_fn(|t| x[t].as_ptr());
    let blocks = &reduction.blocks;
    let steps = w.prefetch_steps(blocks.end).unwrap_or((0, 0));
    let rows_first = w.rows_first::<T>();
    for s in 0..reduction.segments() {
        let segment = reduction.segment_blocks(s);
        let last = segment.end;
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        if rows_first {
            // Row by row, each front to back (see `BlockRows::rows_first`).
            for (r, acc) in acc.iter_mut().enumerate() {
                for b in segment.clone() {
                    // SAFETY: block b of every row is inside `data` and the input holds
                    // blocks.end whole blocks (both checked by the caller); the scale address
                    // is only read by MX formats, whose scales were checked too.
                    let (wv, xa, xb) = unsafe {
                        (
                            decode::<F>(
                                pairs,
                                second_of_pair::<F>(r),
                                data.add(data_at::<F, R>(w, r, b)),
                                scales.wrapping_add(w.scale_at(r, b)),
                                scaled,
                            ),
                            _mm512_loadu_ps(xs[0].add(b * BLOCK)),
                            _mm512_loadu_ps(xs[0].add(b * BLOCK + LANES)),
                        )
                    };
                    acc[0] = term::<O>(term::<O>(acc[0], wv.0, xa), wv.1, xb);
                }
            }
        } else {
            for b in segment.clone() {
                if PREFETCH {
                    prefetch::<F, R>(w, data, scales, steps, b);
                }
                // Every row's block first, then token by token: the live registers are the
                // accumulators, the R decoded pairs and one token's two input vectors.
                let mut wv = [(_mm512_setzero_ps(), _mm512_setzero_ps()); R];
                for (r, wv) in wv.iter_mut().enumerate() {
                    // SAFETY: block b of every row is inside `data` (checked by the caller); the
                    // scale address is only read by MX formats, whose scales were checked too.
                    *wv = unsafe {
                        decode::<F>(
                            pairs,
                            second_of_pair::<F>(r),
                            data.add(data_at::<F, R>(w, r, b)),
                            scales.wrapping_add(w.scale_at(r, b)),
                            scaled,
                        )
                    };
                }
                for t in 0..T {
                    // One input vector live at a time: each accumulator still takes its first
                    // half's term before its second's. SAFETY: each input holds blocks.end whole
                    // blocks.
                    let xa = unsafe { _mm512_loadu_ps(xs[t].add(b * BLOCK)) };
                    for r in 0..R {
                        acc[r][t] = term::<O>(acc[r][t], wv[r].0, xa);
                    }
                    // SAFETY: as above.
                    let xb = unsafe { _mm512_loadu_ps(xs[t].add(b * BLOCK + LANES)) };
                    for r in 0..R {
                        acc[r][t] = term::<O>(acc[r][t], wv[r].1, xb);
                    }
                }
            }
        }
        if reduction.half && last == blocks.end && matches!(F, F32 | BF16 | F16) {
            let b = blocks.end;
            for (r, acc) in acc.iter_mut().enumerate() {
                // SAFETY: the first half of block `end` is inside every row and input (checked).
                let wa = unsafe { decode_half::<F>(data.add(data_at::<F, R>(w, r, b))) };
                for (acc, x) in acc.iter_mut().zip(&xs) {
                    // SAFETY: as above.
                    let xa = unsafe { _mm512_loadu_ps(x.add(b * BLOCK)) };
                    *acc = term::<O>(*acc, wa, xa);
                }
            }
        }
        emit.segment(s, &fold_all(&acc));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lanes of every magnitude, so that the order of the additions shows in the bits.
    fn lanes(seed: u32) -> [f32; 16] {
        let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
        std::array::from_fn(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            let mantissa = (s % 20_001) as f32 / 10_000.0 - 1.0;
            mantissa * 2f32.powi((s >> 20) as i32 % 40 - 20)
        })
    }

    fn folds_match<const R: usize, const T: usize>() {
        for seed in 0..50u32 {
            let values: [[[f32; 16]; T]; R] = std::array::from_fn(|r| {
                std::array::from_fn(|t| lanes(seed * 97 + (r * T + t) as u32))
            });
            // SAFETY: the test only runs where the CPU has AVX-512F (checked below).
            let (all, one) = unsafe {
                let acc: [[__m512; T]; R] = std::array::from_fn(|r| {
                    std::array::from_fn(|t| _mm512_loadu_ps(values[r][t].as_ptr()))
                });
                let one: [[f32; T]; R] =
                    std::array::from_fn(|r| std::array::from_fn(|t| fold(acc[r][t])));
                (fold_all(&acc), one)
            };
            for r in 0..R {
                for t in 0..T {
                    assert_eq!(
                        all[r][t].to_bits(),
                        one[r][t].to_bits(),
                        "{R}x{T} ({r}, {t})"
                    );
                    assert_eq!(
                        one[r][t].to_bits(),
                        super::super::fold_lanes(values[r][t]).to_bits()
                    );
                }
            }
        }
    }

    #[test]
    fn folding_a_block_at_once_gives_each_accumulator_its_own_fold() {
        if !available() {
            test_skips::skipped("this CPU lacks AVX-512 (F, BW, FMA, F16C)");
            return;
        }
        folds_match::<8, 2>();
        folds_match::<4, 4>();
        folds_match::<8, 1>();
        folds_match::<4, 2>();
        folds_match::<3, 4>();
        folds_match::<1, 4>();
        folds_match::<3, 1>();
        folds_match::<1, 1>();
        folds_match::<8, 4>();
    }
}
