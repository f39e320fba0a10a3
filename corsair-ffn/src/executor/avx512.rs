//! The AVX-512 tile kernel: `R` weight rows x `T` tokens per register block, weights decoded
//! 32 at a time in registers (bf16: one shift and one mask per pair of vectors; MXFP4: a
//! 16-entry table scaled once per block, looked up by nibble; MXINT8: widen and scale).
//!
//! Lane `l` of an accumulator takes element `2l`, then `2l + 1`, of every block with a fused
//! multiply-add, and the 16 lanes are folded by halves (8, 4, 2, 1) exactly as
//! [`crate::numerics::fold_lanes`] does, so the bits equal the portable path's.

use std::arch::x86_64::*;

// The lane tree of the numerics definition (halves 8, 4, 2, 1) is the model kernels' tree.
use model::kernels::fold_lanes_avx512 as fold;
use model::mxfp4::ScaledFp4;

use super::kernel::{ROW_GROUP, TileView, block_bytes, block_place};

/// How far ahead (bytes) the kernel prefetches a tile's weights.
const PREFETCH_BYTES: usize = 8192;
use crate::format::TileFormat;
use crate::numerics::{BLOCK, BLOCKS_PER_SEGMENT};

const F32: u8 = 0;
const BF16: u8 = 1;
const F16: u8 = 2;
const MXFP4: u8 = 3;
const MXINT8: u8 = 4;

/// Whether this CPU can run this path.
pub fn available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
    })
}

/// Decoded (even, odd) vectors of the block at `data` (scale byte at `scale`).
///
/// # Safety
/// The block's bytes (and its scale byte, for MX formats) must be readable; AVX-512F/BW,
/// FMA and F16C must be available.
#[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
#[inline]
unsafe fn block<const F: u8>(
    data: *const u8,
    scale: *const u8,
    scaled: &ScaledFp4,
) -> (__m512, __m512) {
    // SAFETY: the caller guarantees the bytes read here are inside the tile.
    unsafe {
        match F {
            F32 => {
                let p = data.cast::<f32>();
                (_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16)))
            }
            BF16 => {
                let v = _mm512_loadu_si512(data.cast());
                let even = _mm512_slli_epi32::<16>(v);
                let odd = _mm512_and_si512(v, _mm512_set1_epi32(0xffff_0000u32 as i32));
                (_mm512_castsi512_ps(even), _mm512_castsi512_ps(odd))
            }
            F16 => {
                let v = _mm512_loadu_si512(data.cast());
                let even = _mm512_cvtepi32_epi16(v);
                let odd = _mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(v));
                (_mm512_cvtph_ps(even), _mm512_cvtph_ps(odd))
            }
            MXFP4 => {
                let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(data.cast()));
                let lo = _mm512_and_si512(v, _mm512_set1_epi32(0x0f));
                let hi = _mm512_srli_epi32::<4>(v);
                // The block's 16 values, already scaled: one aligned load.
                let table = _mm512_load_ps(scaled.0[*scale as usize].as_ptr());
                (
                    _mm512_permutexvar_ps(lo, table),
                    _mm512_permutexvar_ps(hi, table),
                )
            }
            _ => {
                let s = _mm512_set1_ps(model::mxfp4::SCALE_LUT[*scale as usize]);
                let even = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(data.cast())));
                let odd =
                    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(data.add(16).cast())));
                (_mm512_mul_ps(even, s), _mm512_mul_ps(odd, s))
            }
        }
    }
}

/// One register block: rows `r0..r0 + R`, tokens `t0..t0 + T`, every segment of the tile.
///
/// # Safety
/// Rows and tokens must be in range; AVX-512F/BW must be available.
#[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn run_block<const F: u8, const R: usize, const T: usize>(
    tile: &TileView<'_>,
    x: &[f32],
    x_stride: usize,
    r0: usize,
    t0: usize,
    out: &mut [f32],
    scaled: &ScaledFp4,
) {
    let (nb, ns) = (tile.blocks(), tile.segments());
    // Rows of one register block share a row group, hence the strides between blocks.
    let (_, dstride, _, sstride) = block_place(tile.format, tile.rows, nb, r0, 0);
    let bb = block_bytes(tile.format);
    let place = |r: usize| block_place(tile.format, tile.rows, nb, r0 + r, 0);
    let data: [*const u8; R] = std::array::from_fn(|r| tile.data[place(r).0..].as_ptr());
    let scales: [*const u8; R] =
        std::array::from_fn(|r| tile.scales[place(r).2.min(tile.scales.len())..].as_ptr());
    let xs: [*const f32; T] = std::array::from_fn(|t| x[(t0 + t) * x_stride..].as_ptr());
    for s in 0..ns {
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        for b in s * BLOCKS_PER_SEGMENT..((s + 1) * BLOCKS_PER_SEGMENT).min(nb) {
            // Weights stream from memory once: fetch ahead. A tile's row groups follow each
            // other, so the bytes PREFETCH_BYTES past this block of these rows are the ones
            // this thread reads next (in this group or the next).
            let here = b * dstride;
            let mut line = 0;
            while line < R * bb {
                // SAFETY: prefetching never faults, whatever the address.
                _mm_prefetch::<_MM_HINT_T0>(
                    data[0].wrapping_add(here + PREFETCH_BYTES + line).cast(),
                );
                line += 64;
            }
            if sstride > 0 && b % 8 == 0 {
                let ahead = b * sstride + PREFETCH_BYTES / 16;
                _mm_prefetch::<_MM_HINT_T0>(scales[0].wrapping_add(ahead).cast());
            }
            let mut w = [(_mm512_setzero_ps(), _mm512_setzero_ps()); R];
            for r in 0..R {
                // SAFETY: block b < nb of row r0 + r lies inside the tile (see block_place).
                w[r] = unsafe {
                    block::<F>(data[r].add(b * dstride), scales[r].add(b * sstride), scaled)
                };
            }
            for t in 0..T {
                // SAFETY: each input row holds at least nb whole blocks from the tile's column.
                let (xa, xb) = unsafe {
                    (
                        _mm512_loadu_ps(xs[t].add(b * BLOCK)),
                        _mm512_loadu_ps(xs[t].add(b * BLOCK + 16)),
                    )
                };
                for r in 0..R {
                    acc[r][t] = _mm512_fmadd_ps(w[r].0, xa, acc[r][t]);
                    acc[r][t] = _mm512_fmadd_ps(w[r].1, xb, acc[r][t]);
                }
            }
        }
        for r in 0..R {
            for t in 0..T {
                out[(t0 + t) * tile.rows * ns + (r0 + r) * ns + s] = fold(acc[r][t]);
            }
        }
    }
}

/// Segment partials of a tile (see [`super::kernel::tile_partials`]).
///
/// # Safety
/// AVX-512F/BW, FMA and F16C must be available ([`available`]); `x` must hold `tokens` rows of
/// `x_stride` values, each with the tile's whole blocks; `out` must hold the partials.
#[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
pub unsafe fn tile_partials(
    tile: &TileView<'_>,
    x: &[f32],
    x_stride: usize,
    tokens: usize,
    out: &mut [f32],
) {
    let need_x = tokens.saturating_sub(1) * x_stride + tile.blocks() * BLOCK;
    assert!(tokens == 0 || x.len() >= need_x, "tile input too short");
    assert!(
        out.len() >= tokens * tile.rows * tile.segments(),
        "tile output too short"
    );
    assert!(
        tile.data.len() >= tile.rows * tile.format.data_bytes(tile.cols),
        "tile data too short"
    );
    assert!(
        tile.scales.len() >= tile.rows * tile.format.scale_bytes(tile.cols),
        "tile scales too short"
    );
    // The first bytes of the tile are requested all at once (the running prefetch in
    // run_block covers the rest), so the tile's start does not wait line by line.
    let mut line = 0;
    while line < PREFETCH_BYTES.min(tile.data.len()) {
        _mm_prefetch::<_MM_HINT_T0>(tile.data[line..].as_ptr().cast());
        line += 64;
    }
    if let Some(s) = tile.scales.first() {
        _mm_prefetch::<_MM_HINT_T0>((s as *const u8).cast());
    }
    // SAFETY: forwarded; the asserts above bound every pointer the blocks use.
    unsafe {
        match tile.format {
            TileFormat::F32 => rows::<F32>(tile, x, x_stride, tokens, out),
            TileFormat::Bf16 => rows::<BF16>(tile, x, x_stride, tokens, out),
            TileFormat::F16 => rows::<F16>(tile, x, x_stride, tokens, out),
            TileFormat::Mxfp4 => rows::<MXFP4>(tile, x, x_stride, tokens, out),
            TileFormat::Mxint8 => rows::<MXINT8>(tile, x, x_stride, tokens, out),
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
unsafe fn rows<const F: u8>(
    tile: &TileView<'_>,
    x: &[f32],
    x_stride: usize,
    tokens: usize,
    out: &mut [f32],
) {
    // Looked up once per tile, not per register block.
    let scaled = model::mxfp4::scaled_fp4();
    macro_rules! go {
        ($r:literal, $t:literal, $r0:expr, $t0:expr) => {
            // SAFETY: r0 + R <= rows and t0 + T <= tokens by the loop bounds below.
            unsafe { run_block::<F, $r, $t>(tile, x, x_stride, $r0, $t0, out, scaled) }
        };
    }
    if tokens == 1 {
        // One token: 8 independent accumulators keep the fused multiply-adds busy.
        // Register blocks never straddle a row group: 8 rows are one whole group, and the
        // 4-row blocks below start at multiples of 4.
        const _: () = assert!(ROW_GROUP == 8);
        let mut r = 0;
        while r + ROW_GROUP <= tile.rows {
            go!(8, 1, r, 0);
            r += ROW_GROUP;
        }
        while r < tile.rows {
            go!(1, 1, r, 0);
            r += 1;
        }
        return;
    }
    let mut r = 0;
    while r < tile.rows {
        let rr = (tile.rows - r).min(4);
        let mut t = 0;
        while t < tokens {
            let tt = (tokens - t).min(4);
            match (rr, tt) {
                (4, 4) => go!(4, 4, r, t),
                (4, 3) => go!(4, 3, r, t),
                (4, 2) => go!(4, 2, r, t),
                (4, 1) => go!(4, 1, r, t),
                (3, 4) => go!(3, 4, r, t),
                (2, 4) => go!(2, 4, r, t),
                (1, 4) => go!(1, 4, r, t),
                (3, _) => go!(3, 1, r, t),
                (2, _) => go!(2, 1, r, t),
                _ => go!(1, 1, r, t),
            }
            t += if rr < 4 && tt < 4 { 1 } else { tt };
        }
        r += rr;
    }
}
