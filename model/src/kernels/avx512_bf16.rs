//! The AVX-512 BF16 path of [`super::bf16`]: `R` weight rows x `T` inputs per register block;
//! a bf16 block is one load, an MXFP4 block's nibbles become 32 bf16 values by one word
//! permute of the block's 16 scaled FP4 values; each block then takes one `vdpbf16ps` per row
//! and input, which adds element `2l + 1`'s product and then element `2l`'s into lane `l`.

use super::avx512::fold_all;
use super::x86::{BF16, MXFP4, MXFP4_PAIRS, MXFP4_PAIRS_SECOND, data_at, prefetch, second_of_pair};
use super::{BLOCK, BlockFormat, BlockRows, Reduction, Sink};
use std::arch::x86_64::*;

/// Whether this CPU can run this path.
pub(super) fn available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512bf16")
    })
}

/// The 16 FP4 values times each scale, as bf16 (exact: one mantissa bit times a power of two),
/// twice over, so that a row is one aligned 64-byte load and a word permute, which reads 5
/// index bits, finds a nibble's value whatever bit 4 holds.
#[repr(C, align(64))]
struct ScaledFp4Bf16([[u16; 32]; 256]);

fn scaled_fp4_bf16() -> &'static ScaledFp4Bf16 {
    static TABLE: std::sync::OnceLock<Box<ScaledFp4Bf16>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        let scaled = crate::mxfp4::scaled_fp4();
        let mut t = Box::new(ScaledFp4Bf16([[0; 32]; 256]));
        for (row, values) in t.0.iter_mut().zip(scaled.0.iter()) {
            for (w, v) in row.iter_mut().zip(values.iter().cycle()) {
                *w = (v.to_bits() >> 16) as u16;
            }
        }
        t
    })
}

/// See [`super::bf16::bf16_block_sums`].
///
/// # Safety
/// The CPU must have the features of [`available`]; `w` and `x` must hold every block the call
/// reads ([`BlockRows::check`]).
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(super) unsafe fn block_sums<const R: usize, const T: usize>(
    w: &BlockRows<'_, R>,
    x: &[&[u16]; T],
    reduction: &Reduction,
    emit: impl Sink<R, T>,
) {
    macro_rules! go {
        ($f:expr) => {
            // SAFETY: forwarded from the caller.
            unsafe {
                if w.prefetch > 0 && w.prefetch_steps(reduction.blocks.end).is_some() {
                    sums::<{ $f }, R, T, true>(w, x, reduction, emit)
                } else {
                    sums::<{ $f }, R, T, false>(w, x, reduction, emit)
                }
            }
        };
    }
    match w.format {
        BlockFormat::Mxfp4 => go!(MXFP4),
        BlockFormat::Mxfp4RowPairs if w.pair_offset == 1 => go!(MXFP4_PAIRS_SECOND),
        BlockFormat::Mxfp4RowPairs => go!(MXFP4_PAIRS),
        _ => go!(BF16),
    }
}

/// The block at `data` as 32 bf16 values in element order (MXFP4: scale byte at `scale`; a row
/// pair's block: its first row's values, or its second's when `second`).
///
/// # Safety
/// The block's bytes (and its scale byte, for MXFP4) must be readable; the CPU must have the
/// features of [`available`].
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[inline]
unsafe fn decode<const F: u8>(
    second: bool,
    data: *const u8,
    scale: *const u8,
    table: &ScaledFp4Bf16,
) -> __m512bh {
    // SAFETY: the caller guarantees the bytes read here are inside the rows.
    unsafe {
        let words = if matches!(F, MXFP4_PAIRS | MXFP4_PAIRS_SECOND) {
            // Word k: byte k, the rows' element k in its two nibbles. The permute reads the
            // low 5 bits; the table holds its 16 values twice, so bit 4 does not matter.
            let v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(data.cast()));
            let index = if second { _mm512_srli_epi16::<4>(v) } else { v };
            let values = _mm512_load_si512(table.0[*scale as usize].as_ptr().cast());
            _mm512_permutexvar_epi16(index, values)
        } else if F == MXFP4 {
            // Byte j holds elements 2j (low nibble) and 2j + 1 (high): one 32-bit lane per byte,
            // its low word indexing the low nibble's value and its high word the high one's.
            let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(data.cast()));
            let both = _mm512_ternarylogic_epi32::<0xA8>(
                v,
                _mm512_slli_epi32::<12>(v),
                _mm512_set1_epi32(0x000f_000f),
            );
            let values = _mm512_load_si512(table.0[*scale as usize].as_ptr().cast());
            _mm512_permutexvar_epi16(both, values)
        } else {
            _mm512_loadu_si512(data.cast())
        };
        // Same 512 bits, read as 32 bf16 values.
        std::mem::transmute::<__m512i, __m512bh>(words)
    }
}

/// # Safety
/// As [`block_sums`].
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn sums<const F: u8, const R: usize, const T: usize, const PREFETCH: bool>(
    w: &BlockRows<'_, R>,
    x: &[&[u16]; T],
    reduction: &Reduction,
    mut emit: impl Sink<R, T>,
) {
    let table = scaled_fp4_bf16();
    let (data, scales) = (w.data.as_ptr(), w.scales.as_ptr());
    let xs: [*const u16; T] = std::array::from_fn(|t| x[t].as_ptr());
    let blocks = &reduction.blocks;
    let steps = w.prefetch_steps(blocks.end).unwrap_or((0, 0));
    // SAFETY: all-zero bits, read as 32 bf16 zeros.
    let zero = unsafe { std::mem::transmute::<__m512i, __m512bh>(_mm512_setzero_si512()) };
    let rows_first = w.rows_first::<T>();
    for s in 0..reduction.segments() {
        let segment = reduction.segment_blocks(s);
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        if rows_first {
            // Row by row, each front to back (see `BlockRows::rows_first`).
            for (r, acc) in acc.iter_mut().enumerate() {
                for b in segment.clone() {
                    // SAFETY: block b of every row is inside `data` and the input holds
                    // blocks.end whole blocks (both checked by the caller); the scale address
                    // is only read by MXFP4, whose scales were checked too.
                    let (wv, xv) = unsafe {
                        (
                            decode::<F>(
                                second_of_pair::<F>(r),
                                data.add(data_at::<F, R>(w, r, b)),
                                scales.wrapping_add(w.scale_at(r, b)),
                                table,
                            ),
                            std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                                xs[0].add(b * BLOCK).cast(),
                            )),
                        )
                    };
                    acc[0] = _mm512_dpbf16_ps(acc[0], wv, xv);
                }
            }
        } else {
            for b in segment.clone() {
                if PREFETCH {
                    prefetch::<F, R>(w, data, scales, steps, b);
                }
                let mut wv = [zero; R];
                for (r, wv) in wv.iter_mut().enumerate() {
                    // SAFETY: block b of every row is inside `data` (checked by the caller); the
                    // scale address is only read by MXFP4, whose scales were checked too.
                    *wv = unsafe {
                        decode::<F>(
                            second_of_pair::<F>(r),
                            data.add(data_at::<F, R>(w, r, b)),
                            scales.wrapping_add(w.scale_at(r, b)),
                            table,
                        )
                    };
                }
                for t in 0..T {
                    // SAFETY: each input holds blocks.end whole blocks; the same 512 bits, read as
                    // bf16 values.
                    let xv = unsafe {
                        std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                            xs[t].add(b * BLOCK).cast(),
                        ))
                    };
                    for r in 0..R {
                        acc[r][t] = _mm512_dpbf16_ps(acc[r][t], wv[r], xv);
                    }
                }
            }
        }
        emit.segment(s, &fold_all(&acc));
    }
}
