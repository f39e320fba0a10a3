//! The AVX2 path of the matrix kernel, for x86-64 CPUs without AVX-512 (AMD Zen 2 and 3, many
//! Intel cores): the same terms in the same order as [`super::portable`], eight lanes to a
//! 256-bit register, so one 16-lane vector of the fixed orders is two registers.
//!
//! With 16 registers instead of AVX-512's 32, a register block of the shared grid is cut into
//! sub-blocks of at most four row x input products (eight accumulators), and the inputs come
//! from memory: the multiply-adds of f32 inputs read each block's 32 values where they are in
//! the input; the bf16 path (`avx2_bf16`) widens its inputs into a buffer first.
//!
//! MXFP4 is decoded by byte lookups: every FP4 value times an E8M0 scale is a bf16 value
//! widened to f32 (its low 16 bits are zero), so two `vpshufb` find the high two bytes of 32
//! values in two 16-entry tables of the block's scale ([`Fp4Bytes`]). Interleaving those bytes
//! gives the 32 values as bf16 words; a row pair's words come out in the order of
//! [`Layout::Split`]. The f32 path puts them back in order with two cross-lane permutes a
//! block (GPT-OSS-20B's expert with f32 inputs, one thread: 1.3-1.9x faster from 2 tokens on
//! than laying every register block's inputs out in that order, 4-10% at one token); the bf16
//! path lays its inputs out in it, as it widens them anyway.

use super::x86::{
    BF16, F16, F32, MXFP4, MXFP4_PAIRS, MXFP4_PAIRS_SECOND, MXINT8, data_at, prefetch,
    second_of_pair,
};
use super::{BLOCK, BlockFormat, BlockRows, Reduction, Sink, SumOrder};
use crate::mxfp4;
use std::arch::x86_64::*;

/// Whether this CPU can run this path.
pub(super) fn available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
            && Fp4Bytes::exact().is_some()
    })
}

/// The high two bytes of every FP4 value times every scale: entry `s` holds, for the 16
/// nibbles, byte 2 of the f32 value's bits (`[s][0]`) and byte 3 (`[s][1]`); its low two bytes
/// are zero. One 32-byte entry a scale, so a block's tables are two 16-byte loads.
#[repr(C, align(32))]
pub(super) struct Fp4Bytes([[[u8; 16]; 2]; 256]);

impl Fp4Bytes {
    /// The tables of `value(nibble, scale)`, or `None` if some value has nonzero low bytes.
    fn build(value: impl Fn(usize, usize) -> f32) -> Option<Box<Self>> {
        let mut t = Box::new(Fp4Bytes([[[0; 16]; 2]; 256]));
        for (s, entry) in t.0.iter_mut().enumerate() {
            let [low, high] = entry;
            for (n, (low, high)) in low.iter_mut().zip(high.iter_mut()).enumerate() {
                let bits = value(n, s).to_bits();
                if bits & 0xffff != 0 {
                    return None;
                }
                (*low, *high) = ((bits >> 16) as u8, (bits >> 24) as u8);
            }
        }
        Some(t)
    }

    /// The exact products of [`mxfp4::scaled_fp4`], which the f32 orders add.
    pub(super) fn exact() -> Option<&'static Self> {
        static TABLE: std::sync::OnceLock<Option<Box<Fp4Bytes>>> = std::sync::OnceLock::new();
        TABLE
            .get_or_init(|| {
                let scaled = mxfp4::scaled_fp4();
                Self::build(|n, s| scaled.0[s][n])
            })
            .as_deref()
    }

    /// The products with values below f32's normal range read as zero (keeping the sign), as
    /// the bf16 order takes its weights.
    pub(super) fn flushed() -> Option<&'static Self> {
        static TABLE: std::sync::OnceLock<Option<Box<Fp4Bytes>>> = std::sync::OnceLock::new();
        TABLE
            .get_or_init(|| {
                let scaled = mxfp4::scaled_fp4();
                Self::build(|n, s| {
                    let v = scaled.0[s][n];
                    if v.is_subnormal() {
                        0f32.copysign(v)
                    } else {
                        v
                    }
                })
            })
            .as_deref()
    }
}

/// Which lanes of a 16-lane vector each of its two registers holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Layout {
    /// Lanes 0-7, then lanes 8-15.
    Natural,
    /// Lanes 0-3 and 8-11, then lanes 4-7 and 12-15: the order in which interleaving a row
    /// pair's looked-up bytes ([`MXFP4_PAIRS`]) gives its words, in-lane.
    Split,
}

/// The layout format `F`'s blocks decode to in the bf16 path (`avx2_bf16`), in lane pairs
/// (`pairs`) or halves; this path's [`decode`] gives every format in the natural layout.
pub(super) const fn layout<const F: u8>(pairs: bool) -> Layout {
    if pairs && matches!(F, MXFP4_PAIRS | MXFP4_PAIRS_SECOND) {
        Layout::Split
    } else {
        Layout::Natural
    }
}

/// A decoded block: the vector whose terms each lane takes first, then the second one, each
/// as two registers in the block's [`Layout`].
#[derive(Clone, Copy)]
pub(super) struct Block {
    pub first: [__m256; 2],
    pub second: [__m256; 2],
}

/// See [`super::block_sums`].
///
/// # Safety
/// The CPU must have the features of [`available`]; `w` and `x` must hold every block (and half
/// block) the call reads ([`BlockRows::check`]).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn block_sums<O: SumOrder, const R: usize, const T: usize>(
    w: &BlockRows<'_, R>,
    x: &[&[f32]; T],
    reduction: &Reduction,
    emit: impl Sink<R, T>,
) {
    let Some(tables) = Fp4Bytes::exact() else {
        unreachable!("available() checked the tables");
    };
    macro_rules! go {
        ($f:expr) => {
            // SAFETY: forwarded from the caller.
            unsafe {
                if w.prefetch > 0 && w.prefetch_steps(reduction.blocks.end).is_some() {
                    sums::<O, { $f }, R, T, true>(w, x, reduction, tables, emit)
                } else {
                    sums::<O, { $f }, R, T, false>(w, x, reduction, tables, emit)
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

/// Eight bf16 words widened to f32.
#[target_feature(enable = "avx2")]
#[inline]
fn widen(words: __m128i) -> __m256 {
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(words)))
}

/// Element `2l` of the bf16 pairs in each 32-bit lane of `v`, as f32.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn even_of_pairs(v: __m256i) -> __m256 {
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(v))
}

/// Element `2l + 1` of the bf16 pairs in each 32-bit lane of `v`, as f32.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn odd_of_pairs(v: __m256i) -> __m256 {
    _mm256_castsi256_ps(_mm256_and_si256(
        v,
        _mm256_set1_epi32(0xffff_0000u32 as i32),
    ))
}

/// The bf16 words of the 32 nibbles `idx` (one a byte, `< 16`), looked up in the tables of
/// scale byte `*scale`: words of bytes 0-7 and 16-23, then of bytes 8-15 and 24-31.
///
/// # Safety
/// The scale byte must be readable; AVX2 must be available.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn lookup(idx: __m256i, scale: *const u8, tables: &Fp4Bytes) -> [__m256i; 2] {
    // SAFETY: the caller guarantees the scale byte is readable; the entry is inside the table.
    let entry = &tables.0[unsafe { *scale } as usize];
    // SAFETY: each table is 16 readable bytes.
    let (low, high) = unsafe {
        (
            _mm256_broadcastsi128_si256(_mm_loadu_si128(entry[0].as_ptr().cast())),
            _mm256_broadcastsi128_si256(_mm_loadu_si128(entry[1].as_ptr().cast())),
        )
    };
    let (l, h) = (
        _mm256_shuffle_epi8(low, idx),
        _mm256_shuffle_epi8(high, idx),
    );
    [_mm256_unpacklo_epi8(l, h), _mm256_unpackhi_epi8(l, h)]
}

/// The 32 nibbles of an MXFP4 row pair's block at `data`: its first row's (low nibbles) or its
/// second's, one a byte in element order.
///
/// # Safety
/// 32 bytes at `data` must be readable; AVX2 must be available.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn pair_nibbles(data: *const u8, second: bool) -> __m256i {
    // SAFETY: forwarded from the caller.
    let v = unsafe { _mm256_loadu_si256(data.cast()) };
    let v = if second { _mm256_srli_epi16::<4>(v) } else { v };
    _mm256_and_si256(v, _mm256_set1_epi8(0x0f))
}

/// The nibbles of an MXFP4 block at `data` (16 bytes): its even elements' (low nibbles) in
/// the low 128 bits, its odd elements' in the high 128.
///
/// # Safety
/// 16 bytes at `data` must be readable; AVX2 must be available.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn row_nibbles(data: *const u8) -> __m256i {
    // SAFETY: forwarded from the caller.
    let v = unsafe { _mm_loadu_si128(data.cast()) };
    let low = _mm_set1_epi8(0x0f);
    let (even, odd) = (
        _mm_and_si128(v, low),
        _mm_and_si128(_mm_srli_epi16::<4>(v), low),
    );
    _mm256_set_m128i(odd, even)
}

/// The lane pairs of an MXFP4 block's looked-up words ([`row_nibbles`]): element `2l` of every
/// lane, then element `2l + 1`, in the natural layout.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn row_pairs(words: [__m256i; 2]) -> ([__m256; 2], [__m256; 2]) {
    let lo = |v: __m256i| _mm256_castsi256_si128(v);
    let hi = |v: __m256i| _mm256_extracti128_si256::<1>(v);
    (
        [widen(lo(words[0])), widen(lo(words[1]))],
        [widen(hi(words[0])), widen(hi(words[1]))],
    )
}

/// The two halves of a block of format `F` at `data`, or its lane pairs when `pairs` (bf16,
/// f16, MXFP4), in the natural layout; a row pair's block gives its first row's values, or its
/// second's when `second`.
///
/// # Safety
/// The block's bytes (and its scale byte, for MX formats) must be readable; the CPU must have
/// the features of [`available`].
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn decode<const F: u8>(
    pairs: bool,
    second: bool,
    data: *const u8,
    scale: *const u8,
    tables: &Fp4Bytes,
) -> Block {
    let lo = |v: __m256i| _mm256_castsi256_si128(v);
    let hi = |v: __m256i| _mm256_extracti128_si256::<1>(v);
    // SAFETY: the caller guarantees the bytes read here are inside the rows.
    unsafe {
        match F {
            MXFP4_PAIRS | MXFP4_PAIRS_SECOND => {
                let w = lookup(pair_nibbles(data, second), scale, tables);
                if pairs {
                    // The words of elements 0-7 | 16-23 and 8-15 | 24-31, put back in order
                    // (elements 0-15, 16-31), so the lanes take the natural layout.
                    let (a, b) = (
                        _mm256_permute2x128_si256::<0x20>(w[0], w[1]),
                        _mm256_permute2x128_si256::<0x31>(w[0], w[1]),
                    );
                    Block {
                        first: [even_of_pairs(a), even_of_pairs(b)],
                        second: [odd_of_pairs(a), odd_of_pairs(b)],
                    }
                } else {
                    // Words of elements 0-7 | 16-23 and 8-15 | 24-31.
                    Block {
                        first: [widen(lo(w[0])), widen(lo(w[1]))],
                        second: [widen(hi(w[0])), widen(hi(w[1]))],
                    }
                }
            }
            MXFP4 => {
                let w = lookup(row_nibbles(data), scale, tables);
                if pairs {
                    let (first, second) = row_pairs(w);
                    Block { first, second }
                } else {
                    // w[0]: words of elements 0, 2, .., 14 | 1, 3, .., 15; w[1]: of 16, .., 30
                    // | 17, .., 31. Interleaved back, elements 0-15 then 16-31.
                    let ordered = |v: __m256i| {
                        let (even, odd) = (lo(v), hi(v));
                        [
                            widen(_mm_unpacklo_epi16(even, odd)),
                            widen(_mm_unpackhi_epi16(even, odd)),
                        ]
                    };
                    Block {
                        first: ordered(w[0]),
                        second: ordered(w[1]),
                    }
                }
            }
            F32 => {
                let p = data.cast::<f32>();
                Block {
                    first: [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))],
                    second: [_mm256_loadu_ps(p.add(16)), _mm256_loadu_ps(p.add(24))],
                }
            }
            BF16 if pairs => {
                let (a, b) = (
                    _mm256_loadu_si256(data.cast()),
                    _mm256_loadu_si256(data.add(32).cast()),
                );
                Block {
                    first: [even_of_pairs(a), even_of_pairs(b)],
                    second: [odd_of_pairs(a), odd_of_pairs(b)],
                }
            }
            BF16 => {
                let w = |k: usize| widen(_mm_loadu_si128(data.add(16 * k).cast()));
                Block {
                    first: [w(0), w(1)],
                    second: [w(2), w(3)],
                }
            }
            F16 if pairs => {
                // Each 32-bit lane holds a pair: the low halves of eight lanes are the evens.
                let halves = |v: __m256i| {
                    let pack = |v: __m256i| _mm256_cvtph_ps(_mm_packus_epi32(lo(v), hi(v)));
                    let mask = _mm256_set1_epi32(0xffff);
                    (
                        pack(_mm256_and_si256(v, mask)),
                        pack(_mm256_srli_epi32::<16>(v)),
                    )
                };
                let (a, b) = (
                    halves(_mm256_loadu_si256(data.cast())),
                    halves(_mm256_loadu_si256(data.add(32).cast())),
                );
                Block {
                    first: [a.0, b.0],
                    second: [a.1, b.1],
                }
            }
            F16 => {
                let h = |k: usize| _mm256_cvtph_ps(_mm_loadu_si128(data.add(16 * k).cast()));
                Block {
                    first: [h(0), h(1)],
                    second: [h(2), h(3)],
                }
            }
            _ => {
                let s = _mm256_set1_ps(mxfp4::SCALE_LUT[*scale as usize]);
                let v = |k: usize| {
                    let b = _mm_loadl_epi64(data.add(8 * k).cast());
                    _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), s)
                };
                Block {
                    first: [v(0), v(1)],
                    second: [v(2), v(3)],
                }
            }
        }
    }
}

/// One term per lane: `acc + w * x` as the order rounds it.
#[target_feature(enable = "avx2,fma")]
#[inline]
fn term<O: SumOrder>(acc: __m256, w: __m256, x: __m256) -> __m256 {
    if O::FUSED {
        _mm256_fmadd_ps(w, x, acc)
    } else {
        _mm256_add_ps(acc, _mm256_mul_ps(w, x))
    }
}

/// A 16-lane vector's two registers in `layout` folded by [`super::fold_lanes`]'s halving tree:
/// lanes `l` and `l + 8` meet first, so the natural layout adds its registers and the split
/// one each register's halves; then 4, 2 and 1 as in the AVX-512 path's fold.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn fold(acc: [__m256; 2], layout: Layout) -> f32 {
    let v8 = match layout {
        Layout::Natural => _mm256_add_ps(acc[0], acc[1]),
        Layout::Split => _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(acc[0], acc[1]),
            _mm256_permute2f128_ps::<0x31>(acc[0], acc[1]),
        ),
    };
    let v4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps::<1>(v8));
    let v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
    _mm_cvtss_f32(_mm_add_ss(v2, _mm_movehdup_ps(v2)))
}

/// Every accumulator pair of a sub-block folded by [`fold`].
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn fold_block<const RR: usize, const TT: usize>(
    acc: &[[[__m256; 2]; TT]; RR],
    layout: Layout,
) -> [[f32; TT]; RR] {
    let mut out = [[0f32; TT]; RR];
    for r in 0..RR {
        for t in 0..TT {
            out[r][t] = fold(acc[r][t], layout);
        }
    }
    out
}

/// A decoded block's terms added to one input's accumulators, the first vector's before the
/// second's in each lane (`x`: the input's 32 values for the block as four registers, straight
/// from the input or from the bf16 path's widened copy).
///
/// # Safety
/// 32 floats at `x` must be readable; AVX2 and FMA must be available.
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(super) unsafe fn add_terms<O: SumOrder>(acc: &mut [__m256; 2], d: &Block, x: *const f32) {
    // SAFETY: forwarded from the caller.
    unsafe {
        acc[0] = term::<O>(acc[0], d.first[0], _mm256_loadu_ps(x));
        acc[1] = term::<O>(acc[1], d.first[1], _mm256_loadu_ps(x.add(8)));
        acc[0] = term::<O>(acc[0], d.second[0], _mm256_loadu_ps(x.add(16)));
        acc[1] = term::<O>(acc[1], d.second[1], _mm256_loadu_ps(x.add(24)));
    }
}

/// Rows per sub-block for `T` inputs: at most four row x input products, eight accumulators,
/// and for one input two rows, whose inputs the compiler keeps in four registers.
pub(super) const fn sub_rows(tokens: usize) -> usize {
    match tokens {
        1 => 2,
        2 => 2,
        _ => 1,
    }
}

/// Rows per sub-block for `tokens` inputs over rows of format `F` (this path's f32 inputs and
/// the bf16 path's): [`sub_rows`], except one input over bf16 rows read a block of every row at
/// a time (not `rows_first`, a card's tile), which takes eight rows at once, so a card's group
/// of eight rows is read in one pass, one sequential stream, instead of four passes each over
/// a quarter of every block's bytes. The sixteen accumulators do not all fit in registers, and
/// some live on the stack, which costs less than the passes. GPT-OSS-20B's bf16 expert in
/// bench_expert (one token, one thread, Zen 3 VM), with the 2 KB prefetch of one-token tiles
/// (then `ONE_TOKEN_PREFETCH_BYTES` in corsair-ffn's executor; 1 KB since, in
/// `ONE_TOKEN_BF16_PREFETCH_BYTES`): bf16 inputs streamed 12.0-13.7 GB/s
/// against 8.0-10.1 in two-row sub-blocks and 8.7-12.2 in four-row ones (builds alternated
/// three times); f32 inputs 12.5-14.3 against 7.9-9.7 (six times, level in one).
pub(super) const fn sub_rows_for<const F: u8>(tokens: usize, rows_first: bool) -> usize {
    if F == BF16 && tokens == 1 && !rows_first {
        8
    } else {
        sub_rows(tokens)
    }
}

/// Calls `sub::<RR, TT>(r0, t0)` over rows `0..R` and inputs `0..T` in sub-blocks of at most
/// `per` rows ([`sub_rows`] unless a path knows better) and four inputs: `RR x TT` in (8, 1),
/// (4, 1), (2, 2), (1, 4) and what is left at the edges.
macro_rules! sub_blocks {
    ($r:expr, $t:expr, $call:ident) => {
        sub_blocks!($r, $t, sub_rows($t), $call)
    };
    ($r:expr, $t:expr, $per:expr, $call:ident) => {{
        let (rows, tokens, per) = ($r, $t, $per);
        let mut r0 = 0;
        while r0 < rows {
            // The widest sub-block there is an arm for: 5-7 rows left take 4, then the rest.
            let rr = [8, 4, 3, 2, 1]
                .into_iter()
                .find(|&n| n <= per && n <= rows - r0)
                .unwrap_or(1);
            let mut t0 = 0;
            while t0 < tokens {
                let tt = (tokens - t0).min(4);
                match (rr, tt) {
                    (8, _) => $call!(8, 1, r0, t0),
                    (4, _) => $call!(4, 1, r0, t0),
                    (3, _) => $call!(3, 1, r0, t0),
                    (2, 1) => $call!(2, 1, r0, t0),
                    (2, _) => $call!(2, 2, r0, t0),
                    (_, 1) => $call!(1, 1, r0, t0),
                    (_, 2) => $call!(1, 2, r0, t0),
                    (_, 3) => $call!(1, 3, r0, t0),
                    _ => $call!(1, 4, r0, t0),
                }
                t0 += if rr >= 3 {
                    1
                } else if rr == 2 {
                    tt.min(2)
                } else {
                    tt
                };
            }
            r0 += rr;
        }
    }};
}
pub(super) use sub_blocks;

/// # Safety
/// As [`block_sums`].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn sums<O: SumOrder, const F: u8, const R: usize, const T: usize, const PREFETCH: bool>(
    w: &BlockRows<'_, R>,
    x: &[&[f32]; T],
    reduction: &Reduction,
    tables: &Fp4Bytes,
    mut emit: impl Sink<R, T>,
) {
    let pairs = O::PAIRED && matches!(F, BF16 | F16 | MXFP4 | MXFP4_PAIRS | MXFP4_PAIRS_SECOND);
    let blocks = &reduction.blocks;
    let half = reduction.half && matches!(F, F32 | BF16 | F16);
    // Every format decodes to the natural layout here, so the multiply-adds read each block's
    // 32 values where they are in the input. (Laying every register block's inputs out first
    // took a third of a batched decode step's kernel time: medium Mixtral, 16 sequences, 2
    // cards.)
    let starts: [*const f32; T] = std::array::from_fn(|t| x[t][blocks.start * BLOCK..].as_ptr());
    let shape = Shape {
        pairs,
        half,
        steps: w.prefetch_steps(blocks.end).unwrap_or((0, 0)),
        rows_first: w.rows_first::<T>(),
    };
    for s in 0..reduction.segments() {
        let segment = reduction.segment_blocks(s);
        let mut out = [[0f32; T]; R];
        macro_rules! call {
            ($rr:literal, $tt:literal, $r0:expr, $t0:expr) => {{
                let view = w.rows_from::<$rr>($r0);
                let fresh = $r0 == 0 && $t0 == 0;
                // SAFETY: forwarded from the caller; `starts` hold every block of the call.
                let got: [[f32; $tt]; $rr] = unsafe {
                    if !matches!(F, MXFP4_PAIRS | MXFP4_PAIRS_SECOND) {
                        sub::<O, F, $rr, $tt, PREFETCH>(
                            &view, &starts, $t0, &segment, reduction, tables, &shape, fresh,
                        )
                    } else if view.pair_offset == 1 {
                        sub::<O, MXFP4_PAIRS_SECOND, $rr, $tt, PREFETCH>(
                            &view, &starts, $t0, &segment, reduction, tables, &shape, fresh,
                        )
                    } else {
                        sub::<O, MXFP4_PAIRS, $rr, $tt, PREFETCH>(
                            &view, &starts, $t0, &segment, reduction, tables, &shape, fresh,
                        )
                    }
                };
                for (r, row) in got.iter().enumerate() {
                    out[$r0 + r][$t0..$t0 + $tt].copy_from_slice(row);
                }
            }};
        }
        sub_blocks!(R, T, sub_rows_for::<F>(T, shape.rows_first), call);
        emit.segment(s, &out);
    }
}

/// Bytes ahead of the block being read that rows read one after another ask the cache for,
/// when a block is one line (bf16 and f16 weights): the hardware prefetcher alone left the
/// stream short of the read limit. bench_kernels (16,384 x 2,880 bf16 weights, f32 inputs, one
/// token, both threads, Zen 3 VM) took 3.75-4.05 ms a product without, 3.21-3.53 at 512 bytes
/// ahead, 3.21-3.30 at 1 KB, 3.48-3.96 at 2-8 KB. f32 weights (two lines a block, already at
/// the read limit) were slower with it from 1 KB on, and MXFP4's decoding bounds its time.
const STREAM_AHEAD: usize = 1024;

/// What a call's sub-blocks share.
struct Shape {
    pairs: bool,
    /// Whether the reduction's half block is added (dense formats only).
    half: bool,
    /// The whole register block's prefetch steps (`BlockRows::prefetch_steps`).
    steps: (usize, usize),
    rows_first: bool,
}

/// The rows `w` (a sub-block's) against inputs `t0..t0 + TT` over the blocks `segment`,
/// folded; the sub-block that starts the register block (`fresh`) runs its prefetch.
///
/// # Safety
/// As [`block_sums`]; `starts[t]` holds every block of the reduction (and its half block) of
/// input `t`, 32 floats a block from `reduction.blocks.start`.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn sub<O: SumOrder, const F: u8, const RR: usize, const TT: usize, const PREFETCH: bool>(
    w: &BlockRows<'_, RR>,
    starts: &[*const f32],
    t0: usize,
    segment: &std::ops::Range<usize>,
    reduction: &Reduction,
    tables: &Fp4Bytes,
    shape: &Shape,
    fresh: bool,
) -> [[f32; TT]; RR] {
    let (data, scales) = (w.data.as_ptr(), w.scales.as_ptr());
    let first = reduction.blocks.start;
    let xs: [*const f32; TT] = std::array::from_fn(|t| starts[t0 + t]);
    let zero = _mm256_setzero_ps();
    let mut acc = [[[zero; 2]; TT]; RR];
    // SAFETY (`row`): block b of every row is inside `data` (checked by the caller); the
    // scale address is only read by MX formats, whose scales were checked too.
    macro_rules! row {
        ($r:expr, $b:expr) => {
            unsafe {
                decode::<F>(
                    shape.pairs,
                    second_of_pair::<F>($r),
                    data.add(data_at::<F, RR>(w, $r, $b)),
                    scales.wrapping_add(w.scale_at($r, $b)),
                    tables,
                )
            }
        };
    }
    if shape.rows_first {
        // Row by row, each front to back (see `BlockRows::rows_first`).
        for (r, acc) in acc.iter_mut().enumerate() {
            for b in segment.clone() {
                if matches!(F, BF16 | F16) {
                    // A prefetch never faults, whatever the address.
                    let ahead = data.wrapping_add(data_at::<F, RR>(w, r, b) + STREAM_AHEAD);
                    _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
                }
                let d = row!(r, b);
                // SAFETY: `starts` hold every block of every input.
                unsafe { add_terms::<O>(&mut acc[0], &d, xs[0].add((b - first) * BLOCK)) };
            }
        }
    } else {
        for b in segment.clone() {
            if PREFETCH && fresh {
                prefetch::<F, RR>(w, data, scales, shape.steps, b);
            }
            for (r, acc) in acc.iter_mut().enumerate() {
                let d = row!(r, b);
                for (t, acc) in acc.iter_mut().enumerate() {
                    // SAFETY: as above.
                    unsafe { add_terms::<O>(acc, &d, xs[t].add((b - first) * BLOCK)) };
                }
            }
        }
    }
    if shape.half && segment.end == reduction.blocks.end {
        let b = reduction.blocks.end;
        for (r, acc) in acc.iter_mut().enumerate() {
            // SAFETY: the first half of block `end` is inside every row and input (checked).
            let d = unsafe { decode_half::<F>(data.add(data_at::<F, RR>(w, r, b))) };
            for (t, acc) in acc.iter_mut().enumerate() {
                // SAFETY: as above.
                unsafe {
                    let x = xs[t].add((b - first) * BLOCK);
                    acc[0] = term::<O>(acc[0], d[0], _mm256_loadu_ps(x));
                    acc[1] = term::<O>(acc[1], d[1], _mm256_loadu_ps(x.add(8)));
                }
            }
        }
    }
    fold_block(&acc, Layout::Natural)
}

/// The first 16 values of a dense block at `data`, in the natural layout.
///
/// # Safety
/// Half the block's bytes must be readable; the CPU must have the features of [`available`].
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn decode_half<const F: u8>(data: *const u8) -> [__m256; 2] {
    // SAFETY: forwarded from the caller.
    unsafe {
        match F {
            F32 => {
                let p = data.cast::<f32>();
                [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))]
            }
            BF16 => [
                widen(_mm_loadu_si128(data.cast())),
                widen(_mm_loadu_si128(data.add(16).cast())),
            ],
            _ => [
                _mm256_cvtph_ps(_mm_loadu_si128(data.cast())),
                _mm256_cvtph_ps(_mm_loadu_si128(data.add(16).cast())),
            ],
        }
    }
}
