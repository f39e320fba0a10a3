//! The AVX-512 path of the weight kernels: 4 weight rows x 4 tokens per register block,
//! weights decoded 16 at a time in registers (bf16: widen and shift; f16: `vcvtph2ps`;
//! MXFP4: nibbles through a 16-entry permute table, times the block scale).
//!
//! It reproduces [`super::dot`] bit for bit: lane `l` accumulates every `k = l mod 16` with a
//! separate multiply and add, lanes are reduced in registers by the same tree as
//! [`super::reduce`], the scalar tail is added last.

use std::arch::x86_64::*;

use super::LANES;
use crate::mxfp4;
use crate::weights::{WeightFormat, WeightMatrix};

const BLOCK_ROWS: usize = 4;
const BLOCK_TOKENS: usize = 4;

const F32: u8 = 0;
const BF16: u8 = 1;
const F16: u8 = 2;
const MXFP4: u8 = 3;

/// Whether this CPU can run this path.
pub fn available() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
}

/// A stored row: element (or packed-block) bytes and, for MXFP4, its scales.
#[derive(Clone, Copy)]
struct RowPtr {
    data: *const u8,
    scales: *const u8,
}

/// Values `k..k + 16` of a row, decoded to f32.
///
/// # Safety
/// `k + 16` must not exceed the row's columns, and the CPU must have AVX-512F/BW.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn load_chunk<const F: u8>(row: RowPtr, k: usize) -> __m512 {
    // SAFETY: the caller guarantees the 16 values (8 bytes for MXFP4) lie inside the row.
    unsafe {
        match F {
            F32 => _mm512_loadu_ps(row.data.cast::<f32>().add(k)),
            BF16 => {
                let h = _mm256_loadu_si256(row.data.cast::<u16>().add(k).cast());
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
            }
            F16 => _mm512_cvtph_ps(_mm256_loadu_si256(row.data.cast::<u16>().add(k).cast())),
            _ => {
                let packed = _mm_loadl_epi64(row.data.add(k / 2).cast());
                // b0 b0 b1 b1 ... -> lanes; even lanes take the low nibble, odd the high one.
                let doubled = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(packed, packed));
                let shifts = _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0);
                let nibbles =
                    _mm512_and_si512(_mm512_srlv_epi32(doubled, shifts), _mm512_set1_epi32(0x0f));
                let table = _mm512_loadu_ps(mxfp4::FP4_VALUES.as_ptr());
                let scale = mxfp4::SCALE_LUT[*row.scales.add(k / mxfp4::BLOCK) as usize];
                _mm512_mul_ps(_mm512_permutexvar_ps(nibbles, table), _mm512_set1_ps(scale))
            }
        }
    }
}

/// The 16 lanes of `acc` folded by [`super::reduce`]'s halving tree (8, 4, 2, 1), in registers
/// (the Corsair executor's lane tree is the same and uses this too).
///
/// # Safety
/// Callers without AVX-512F enabled must check that the CPU has it.
#[target_feature(enable = "avx512f")]
#[inline]
pub fn fold(acc: __m512) -> f32 {
    let high = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(acc)));
    let v8 = _mm256_add_ps(_mm512_castps512_ps256(acc), high);
    let v4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps::<1>(v8));
    let v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
    _mm_cvtss_f32(_mm_add_ss(v2, _mm_movehdup_ps(v2)))
}

/// Sums of `R` rows against `T` tokens over the first `full` columns, lanes folded.
///
/// # Safety
/// Every row and token must have at least `full` columns; `full` is a multiple of 16.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn block<const F: u8, const R: usize, const T: usize>(
    rows: &[RowPtr; R],
    xs: &[*const f32; T],
    full: usize,
    out: &mut [[f32; T]; R],
) {
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    let mut w = [_mm512_setzero_ps(); R];
    let mut k = 0;
    while k < full {
        for r in 0..R {
            // SAFETY: k + 16 <= full <= columns.
            w[r] = unsafe { load_chunk::<F>(rows[r], k) };
        }
        for t in 0..T {
            // SAFETY: k + 16 <= full <= columns of token t.
            let xv = unsafe { _mm512_loadu_ps(xs[t].add(k)) };
            for r in 0..R {
                acc[r][t] = _mm512_add_ps(acc[r][t], _mm512_mul_ps(w[r], xv));
            }
        }
        k += LANES;
    }
    for r in 0..R {
        for t in 0..T {
            out[r][t] = fold(acc[r][t]);
        }
    }
}

/// One register block of `R` rows from `n0` and `T` tokens from `t0`, finished with the tree
/// reduction and the scalar tail, written into `tile`.
///
/// # Safety
/// AVX-512F/BW must be available; indices must be in range (checked by the caller).
#[target_feature(enable = "avx512f,avx512bw")]
#[allow(clippy::too_many_arguments)]
unsafe fn run_block<const F: u8, const R: usize, const T: usize>(
    w: &WeightMatrix,
    x: &[f32],
    tokens: usize,
    n0: usize,
    t0: usize,
    tile: &mut [f32],
    tile_n0: usize,
) {
    let cols = w.cols();
    let full = cols / LANES * LANES;
    let mut rows = [RowPtr {
        data: std::ptr::null(),
        scales: std::ptr::null(),
    }; R];
    for (r, row) in rows.iter_mut().enumerate() {
        *row = RowPtr {
            data: w.row_bytes(n0 + r).as_ptr(),
            scales: w.row_scales(n0 + r).as_ptr(),
        };
    }
    let mut xs = [std::ptr::null::<f32>(); T];
    for (t, p) in xs.iter_mut().enumerate() {
        *p = x[(t0 + t) * cols..(t0 + t + 1) * cols].as_ptr();
    }
    let mut sums = [[0f32; T]; R];
    // SAFETY: rows and tokens have `cols >= full` columns.
    unsafe { block::<F, R, T>(&rows, &xs, full, &mut sums) };
    for r in 0..R {
        for t in 0..T {
            let mut tail = 0f32;
            for k in full..cols {
                tail += w.element(n0 + r, k) * x[(t0 + t) * cols + k];
            }
            tile[(n0 + r - tile_n0) * tokens + t0 + t] = sums[r][t] + tail;
        }
    }
}

/// Output rows `[n0, n0 + count)` for every token into `tile` (`[count, tokens]`).
///
/// # Safety
/// AVX-512F/BW must be available ([`available`]).
#[target_feature(enable = "avx512f,avx512bw")]
pub unsafe fn tile(
    x: &[f32],
    tokens: usize,
    w: &WeightMatrix,
    n0: usize,
    count: usize,
    tile: &mut [f32],
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match w.format() {
            WeightFormat::F32 => tile_rows::<F32>(x, tokens, w, n0, count, tile),
            WeightFormat::Bf16 => tile_rows::<BF16>(x, tokens, w, n0, count, tile),
            WeightFormat::F16 => tile_rows::<F16>(x, tokens, w, n0, count, tile),
            WeightFormat::Mxfp4 => tile_rows::<MXFP4>(x, tokens, w, n0, count, tile),
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn tile_rows<const F: u8>(
    x: &[f32],
    tokens: usize,
    w: &WeightMatrix,
    n0: usize,
    count: usize,
    tile: &mut [f32],
) {
    let mut n = n0;
    while n < n0 + count {
        let rows = BLOCK_ROWS.min(n0 + count - n);
        let mut t = 0;
        while t < tokens {
            let ts = BLOCK_TOKENS.min(tokens - t);
            macro_rules! go {
                ($r:literal, $t:literal) => {
                    // SAFETY: forwarded from the caller; n + rows <= w.rows(), t + ts <= tokens.
                    unsafe { run_block::<F, $r, $t>(w, x, tokens, n, t, tile, n0) }
                };
            }
            match (rows, ts) {
                (4, 4) => go!(4, 4),
                (4, 3) => go!(4, 3),
                (4, 2) => go!(4, 2),
                (4, 1) => go!(4, 1),
                (3, 4) => go!(3, 4),
                (3, 3) => go!(3, 3),
                (3, 2) => go!(3, 2),
                (3, 1) => go!(3, 1),
                (2, 4) => go!(2, 4),
                (2, 3) => go!(2, 3),
                (2, 2) => go!(2, 2),
                (2, 1) => go!(2, 1),
                (1, 4) => go!(1, 4),
                (1, 3) => go!(1, 3),
                (1, 2) => go!(1, 2),
                _ => go!(1, 1),
            }
            t += ts;
        }
        n += rows;
    }
}
