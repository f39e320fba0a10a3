//! The AVX2 path of [`super::mxint8`]: a block's 32 weight integers in one register (an MXFP4
//! nibble's value by one `vpshufb`), multiplied with the input's int8 values and summed in
//! pairs by `vpmaddubsw`, the pairs in fours by `vpmaddwd`, which leaves lane `i` the exact
//! sum of elements `4i..4i + 4`; one conversion and one fused multiply-add by the block's
//! scale per lane. An MXFP4 weight decodes in 3 instructions (in row pairs, shared by two
//! rows) where the f32 and bf16 orders take 8 or more.
//!
//! `vpmaddubsw` multiplies unsigned bytes by signed ones, so one operand is made unsigned and
//! the other takes its sign: MXFP4 weights (at most 12 in magnitude) take the input's sign
//! against its magnitude, MXINT8 weights (which may be -128, whose magnitude only fits
//! unsigned) give theirs to the input. No pair of products overflows 16 bits: 128 * 127 * 2.
//!
//! MXFP4 rows in pairs (the card's tiles) take [`sub_offset`] instead, where the inputs are rows
//! of one quantization: weights offset to be unsigned, multiplied by the inputs as stored, and
//! each lane's offset taken away after (GPT-OSS-20B's expert, one thread, Zen 3: 1.05 against
//! 1.24 ms a call at one token, 3.4-3.6 against 4.2-4.3 at four).
//!
//! A plain MXFP4 block is widened 16 bits to 32, which puts element `4i`, `4i + 2`, `4i + 1`
//! and `4i + 3` in lane `i`'s bytes; the input's bytes are swapped to match. The sums are the
//! same: only which products share a lane matters, not their order inside it.

use super::mxint8::{
    FP4_OFFSET_TIMES_TWO, FP4_TIMES_TWO, MX_LANES, Mxint8Row, SCALE_TABLE, WIDE_SCALE_TABLE,
};
use super::x86::{
    MXFP4, MXFP4_PAIRS, MXFP4_PAIRS_SECOND, MXINT8, data_at, prefetch, second_of_pair, unit_of,
};
use super::{BLOCK, BlockFormat, BlockRows, Reduction, Sink};
use std::arch::x86_64::*;

/// See [`super::mxint8::mxint8_block_sums`].
///
/// # Safety
/// The CPU must have the features of [`super::avx2::available`]; `w` and `x` must hold every
/// block the call reads ([`BlockRows::check`]).
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn block_sums<const R: usize, const T: usize>(
    w: &BlockRows<'_, R>,
    x: &[Mxint8Row<'_>; T],
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
        _ => go!(MXINT8),
    }
}

/// Rows of a sub-block for one input.
const SUB_ROWS_ONE_INPUT: usize = 8;

/// What a segment's sub-blocks share.
struct Shape {
    /// The whole register block's prefetch steps (`BlockRows::prefetch_steps`).
    steps: (usize, usize),
    rows_first: bool,
    /// Whether this sub-block starts the register block (and runs its prefetch).
    fresh: bool,
}

/// The most rows a sub-block of a register block takes against `t` inputs: at most 8 products
/// (one accumulator register each). Row pairs against several inputs take a pair of rows at a
/// time against up to 4 inputs, but two pairs against 2 inputs, which fills all 8 (GPT-OSS-20B's
/// expert at 2 tokens, one thread, Zen 3 VM: 2.05-2.15 against 2.39-2.57 ms a call, alternated
/// four times).
const fn rows_per_sub_block(t: usize, pairs: bool) -> usize {
    match t {
        1 => SUB_ROWS_ONE_INPUT,
        2 if pairs => 4,
        2 => 2,
        _ if pairs => 2,
        _ => 1,
    }
}

/// Runs `$call!(rr, tt, r0, t0)` on every sub-block of an `$r` x `$t` register block, rows
/// outer, with at most `$per` rows ([`rows_per_sub_block`]) and 4 inputs a sub-block; `$call`
/// returns the inputs it took.
macro_rules! walk_sub_blocks {
    ($r:expr, $t:expr, $per:expr, $call:ident) => {{
        let (r, t, per) = ($r, $t, $per);
        let mut r0 = 0;
        while r0 < r {
            let rr = [8, 4, 2, 1]
                .into_iter()
                .find(|&n| n <= per && n <= r - r0)
                .unwrap_or(1);
            let mut t0 = 0;
            while t0 < t {
                t0 += match (rr, t - t0) {
                    (8, _) => $call!(8, 1, r0, t0),
                    (4, 1) => $call!(4, 1, r0, t0),
                    (4, _) => $call!(4, 2, r0, t0),
                    (2, 1) => $call!(2, 1, r0, t0),
                    (2, 2) => $call!(2, 2, r0, t0),
                    (2, 3) => $call!(2, 3, r0, t0),
                    (2, _) => $call!(2, 4, r0, t0),
                    (_, 1) => $call!(1, 1, r0, t0),
                    (_, 2) => $call!(1, 2, r0, t0),
                    (_, 3) => $call!(1, 3, r0, t0),
                    _ => $call!(1, 4, r0, t0),
                };
            }
            r0 += rr;
        }
    }};
}

/// [`sub_offset`] on a sub-block `$view`, in the row-pair format its first row's place says:
/// one expression for both of its callers (a macro, not a function, so the call compiles as
/// written where it stands; the one-token path's speed moved with small changes around it).
macro_rules! sub_offset_of {
    (
        $rr:literal, $tt:literal, $prefetch:ident,
        $view:expr, $x0:expr, $spacing:expr, $segment:expr, $shape:expr
    ) => {
        if $view.pair_offset == 1 {
            sub_offset::<MXFP4_PAIRS_SECOND, $rr, $tt, $prefetch>(
                $view, $x0, $spacing, $segment, $shape,
            )
        } else {
            sub_offset::<MXFP4_PAIRS, $rr, $tt, $prefetch>($view, $x0, $spacing, $segment, $shape)
        }
    };
}

/// Segments [`offset_sums`] takes each sub-block through before the next sub-block: a whole
/// row of GPT-OSS-20B's expert tiles (2,880 columns, 6 segments).
const SEGMENTS_AT_ONCE: usize = 6;

/// [`sums`] for 3 or more inputs over rows in pairs laid out as the cards' tiles hold them
/// ([`packed`]), the inputs `spacing` blocks apart ([`spacing`]): each sub-block runs through
/// [`SEGMENTS_AT_ONCE`] segments, a [`sub_offset`] call each, before the next sub-block starts,
/// where [`sums`] runs every sub-block over one segment before the next segment. GPT-OSS-20B's
/// expert (bench_expert, MXINT8 inputs, one thread, Zen 3 VM, alternated three times) took
/// 3.77-3.83 against 3.91-3.99 ms a call at 4 tokens and 7.26-7.34 against 7.48-7.49 at 8.
/// Why was not pinned down (the VM has no hardware counters): the sub-block's rows and inputs
/// stay the same across its six calls. One and two inputs keep the segment order: a version
/// that took them this way, with the segments looped inside one call, ran one token 3% slower.
///
/// # Safety
/// As [`sub_offset`], over every segment of `reduction`.
#[target_feature(enable = "avx2,fma")]
unsafe fn offset_sums<const R: usize, const T: usize, const PREFETCH: bool>(
    w: &BlockRows<'_, R>,
    x: &[Mxint8Row<'_>; T],
    spacing: usize,
    reduction: &Reduction,
    steps: (usize, usize),
    mut emit: impl Sink<R, T>,
) {
    let segments = reduction.segments();
    let mut out = [[[0f32; T]; R]; SEGMENTS_AT_ONCE];
    let mut first = 0;
    while first < segments {
        let group = first..segments.min(first + SEGMENTS_AT_ONCE);
        macro_rules! call {
            ($rr:literal, $tt:literal, $r0:expr, $t0:expr) => {{
                let view = w.rows_from::<$rr>($r0);
                let shape = Shape {
                    steps,
                    rows_first: false,
                    fresh: $r0 == 0 && $t0 == 0,
                };
                for (out, s) in out.iter_mut().zip(group.clone()) {
                    let segment = reduction.segment_blocks(s);
                    // SAFETY: forwarded from the caller.
                    let sums: [[f32; $tt]; $rr] = unsafe {
                        sub_offset_of!(
                            $rr, $tt, PREFETCH, &view, &x[$t0], spacing, &segment, &shape
                        )
                    };
                    for (r, row) in sums.iter().enumerate() {
                        out[$r0 + r][$t0..$t0 + $tt].copy_from_slice(row);
                    }
                }
                $tt
            }};
        }
        walk_sub_blocks!(R, T, rows_per_sub_block(T, true), call);
        for (s, sums) in group.clone().zip(&out) {
            emit.segment(s, sums);
        }
        first = group.end;
    }
}

/// # Safety
/// As [`block_sums`].
#[target_feature(enable = "avx2,fma")]
unsafe fn sums<const F: u8, const R: usize, const T: usize, const PREFETCH: bool>(
    w: &BlockRows<'_, R>,
    x: &[Mxint8Row<'_>; T],
    reduction: &Reduction,
    mut emit: impl Sink<R, T>,
) {
    let pairs = matches!(F, MXFP4_PAIRS | MXFP4_PAIRS_SECOND);
    let steps = w.prefetch_steps(reduction.blocks.end).unwrap_or((0, 0));
    let rows_first = w.rows_first::<T>();
    let spacing = if pairs && packed(w) { spacing(x) } else { None };
    if let Some(spacing) = spacing.filter(|_| T >= 3) {
        // SAFETY: forwarded from the caller; `w` is packed and the inputs `spacing` apart.
        unsafe { offset_sums::<R, T, PREFETCH>(w, x, spacing, reduction, steps, emit) };
        return;
    }
    for s in 0..reduction.segments() {
        let segment = reduction.segment_blocks(s);
        let mut out = [[0f32; T]; R];
        macro_rules! call {
            ($rr:literal, $tt:literal, $r0:expr, $t0:expr) => {{
                let view = w.rows_from::<$rr>($r0);
                let shape = Shape {
                    steps,
                    rows_first,
                    fresh: $r0 == 0 && $t0 == 0,
                };
                let inputs = || -> [Mxint8Row<'_>; $tt] { std::array::from_fn(|t| x[$t0 + t]) };
                // SAFETY: forwarded from the caller.
                let got: [[f32; $tt]; $rr] = unsafe {
                    if let Some(spacing) = spacing {
                        sub_offset_of!(
                            $rr, $tt, PREFETCH, &view, &x[$t0], spacing, &segment, &shape
                        )
                    } else if !pairs {
                        sub::<F, $rr, $tt, PREFETCH>(&view, &inputs(), &segment, &shape)
                    } else if view.pair_offset == 1 {
                        sub::<MXFP4_PAIRS_SECOND, $rr, $tt, PREFETCH>(
                            &view,
                            &inputs(),
                            &segment,
                            &shape,
                        )
                    } else {
                        sub::<MXFP4_PAIRS, $rr, $tt, PREFETCH>(&view, &inputs(), &segment, &shape)
                    }
                };
                for (r, row) in got.iter().enumerate() {
                    out[$r0 + r][$t0..$t0 + $tt].copy_from_slice(row);
                }
                $tt
            }};
        }
        walk_sub_blocks!(R, T, rows_per_sub_block(T, pairs), call);
        emit.segment(s, &out);
    }
}

/// The 32 weight integers of the block at `data` in one register, in the byte order the
/// format widens to (see the module docs); a row pair's block gives its second row's when
/// `second`.
///
/// # Safety
/// The block's bytes must be readable; AVX2 must be available.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn weight_integers<const F: u8>(second: bool, data: *const u8, lut: __m256i) -> __m256i {
    let nibbles = _mm256_set1_epi8(0x0f);
    // SAFETY: the caller guarantees the block's bytes are readable.
    unsafe {
        match F {
            MXFP4_PAIRS | MXFP4_PAIRS_SECOND => {
                let v = _mm256_loadu_si256(data.cast());
                let v = if second { _mm256_srli_epi16::<4>(v) } else { v };
                _mm256_shuffle_epi8(lut, _mm256_and_si256(v, nibbles))
            }
            MXFP4 => {
                let d = _mm256_cvtepu16_epi32(_mm_loadu_si128(data.cast()));
                let spread = _mm256_or_si256(d, _mm256_slli_epi32::<12>(d));
                _mm256_shuffle_epi8(lut, _mm256_and_si256(spread, nibbles))
            }
            _ => _mm256_loadu_si256(data.cast()),
        }
    }
}

/// One input block: its int8 values in the weights' byte order, and their magnitudes.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn input_block<const F: u8>(values: *const i8) -> (__m256i, __m256i) {
    // SAFETY: the caller guarantees the block's 32 bytes are readable.
    let q = unsafe { _mm256_loadu_si256(values.cast()) };
    let q = if F == MXFP4 {
        // Elements 4i, 4i + 2, 4i + 1, 4i + 3 in each 32-bit lane, as the widened nibbles.
        let swap = _mm256_setr_epi8(
            0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15, 0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9,
            11, 12, 14, 13, 15,
        );
        _mm256_shuffle_epi8(q, swap)
    } else {
        q
    };
    (q, _mm256_abs_epi8(q))
}

/// `acc + sums(n * q) * scale`, lane `i` summing elements `4i..4i + 4` of the block.
#[target_feature(enable = "avx2,fma")]
#[inline]
fn add_products<const F: u8>(
    acc: __m256,
    n: __m256i,
    (q, q_magnitude): (__m256i, __m256i),
    scale: __m256,
) -> __m256 {
    let pairs = if F == MXINT8 {
        _mm256_maddubs_epi16(_mm256_abs_epi8(n), _mm256_sign_epi8(q, n))
    } else {
        _mm256_maddubs_epi16(q_magnitude, _mm256_sign_epi8(n, q))
    };
    let fours = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
    _mm256_fmadd_ps(_mm256_cvtepi32_ps(fours), scale, acc)
}

/// The 8 lanes of `acc` folded by the halving tree (widths 4, 2, 1).
#[target_feature(enable = "avx2")]
#[inline]
fn fold(acc: __m256) -> f32 {
    let four = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps::<1>(acc));
    let two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    let one = _mm_add_ss(two, _mm_shuffle_ps::<1>(two, two));
    _mm_cvtss_f32(one)
}

/// Eight accumulators folded at once, each exactly as [`fold`] folds it: the same additions of
/// the same operands in the same order, for all eight in about 20 instructions where eight
/// folds take 48 (a sub-block of 8 products folds once a 16-block segment).
#[target_feature(enable = "avx2")]
#[inline]
fn fold_eight(acc: &[__m256; 8]) -> [f32; 8] {
    // Width 4, two accumulators a register: [a's low half + high half | b's].
    let four = |a: __m256, b: __m256| {
        _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(a, b),
            _mm256_permute2f128_ps::<0x31>(a, b),
        )
    };
    // Width 2, four a register: elements 0, 1 of each four plus its elements 2, 3.
    let two = |x: __m256, y: __m256| {
        let (x, y) = (_mm256_castps_pd(x), _mm256_castps_pd(y));
        _mm256_add_ps(
            _mm256_castpd_ps(_mm256_unpacklo_pd(x, y)),
            _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)),
        )
    };
    let abcd = two(four(acc[0], acc[1]), four(acc[2], acc[3]));
    let efgh = two(four(acc[4], acc[5]), four(acc[6], acc[7]));
    // Width 1: element 0 of each two plus its element 1, in the order a c e g | b d f h.
    let one = _mm256_add_ps(
        _mm256_shuffle_ps::<0b10_00_10_00>(abcd, efgh),
        _mm256_shuffle_ps::<0b11_01_11_01>(abcd, efgh),
    );
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    let mut sums = [0f32; 8];
    // SAFETY: `sums` holds 8 floats.
    unsafe { _mm256_storeu_ps(sums.as_mut_ptr(), _mm256_permutevar8x32_ps(one, order)) };
    sums
}

/// The rows `w` (a sub-block's) against inputs `x` over the blocks `segment`, folded.
///
/// # Safety
/// As [`block_sums`].
#[target_feature(enable = "avx2,fma")]
unsafe fn sub<const F: u8, const RR: usize, const TT: usize, const PREFETCH: bool>(
    w: &BlockRows<'_, RR>,
    x: &[Mxint8Row<'_>; TT],
    segment: &std::ops::Range<usize>,
    shape: &Shape,
) -> [[f32; TT]; RR] {
    let (data, scales) = (w.data.as_ptr(), w.scales.as_ptr());
    // SAFETY: FP4_TIMES_TWO is 16 bytes.
    let lut =
        _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(FP4_TIMES_TWO.as_ptr().cast()) });
    let mut acc = [[_mm256_setzero_ps(); TT]; RR];
    // SAFETY (`weights`, `scale`): block b of every row and its scale byte are inside the rows
    // (checked by the caller); a scale index is a scale byte plus a base, inside the table.
    macro_rules! weights {
        ($r:expr, $b:expr) => {
            unsafe {
                (
                    weight_integers::<F>(
                        second_of_pair::<F>($r),
                        data.add(data_at::<F, RR>(w, $r, $b)),
                        lut,
                    ),
                    usize::from(*scales.add(w.scale_at($r, $b))),
                )
            }
        };
    }
    macro_rules! scale {
        ($byte:expr, $base:expr) => {
            unsafe { _mm256_broadcast_ss(SCALE_TABLE.get_unchecked($byte + $base)) }
        };
    }
    if shape.rows_first {
        // Row by row, each front to back (see `BlockRows::rows_first`); one input.
        for (r, acc) in acc.iter_mut().enumerate() {
            for b in segment.clone() {
                let (n, byte) = weights!(r, b);
                // SAFETY: the input holds block b (checked by the caller).
                let q = unsafe { input_block::<F>(x[0].values.as_ptr().add(b * BLOCK)) };
                let base = usize::from(x[0].bases[b]);
                acc[0] = add_products::<F>(acc[0], n, q, scale!(byte, base));
            }
        }
    } else {
        for b in segment.clone() {
            if PREFETCH && shape.fresh {
                prefetch::<F, RR>(w, data, scales, shape.steps, b);
            }
            // Loops rather than closures: a closure does not inherit the target features, so
            // what it calls would not be inlined.
            let mut inputs = [(_mm256_setzero_si256(), _mm256_setzero_si256()); TT];
            let mut bases = [0usize; TT];
            for t in 0..TT {
                // SAFETY: every input holds block b (checked by the caller).
                inputs[t] = unsafe { input_block::<F>(x[t].values.as_ptr().add(b * BLOCK)) };
                bases[t] = usize::from(x[t].bases[b]);
            }
            for (r, acc) in acc.iter_mut().enumerate() {
                let (n, byte) = weights!(r, b);
                for ((acc, &q), &base) in acc.iter_mut().zip(&inputs).zip(&bases) {
                    *acc = add_products::<F>(*acc, n, q, scale!(byte, base));
                }
            }
        }
    }
    let mut out = [[0f32; TT]; RR];
    for (out, acc) in out.iter_mut().zip(&acc) {
        for (o, &a) in out.iter_mut().zip(acc) {
            *o = fold(a);
        }
    }
    out
}

/// Whether row pairs lie as the cards' tiles hold them, which [`sub_offset`] takes for granted:
/// a block's pairs side by side, and one scale byte a row, the rows' side by side. Other
/// layouts take [`sub`]. With the strides within a block constant, GPT-OSS-20B's expert took
/// 3.42-3.53 against 3.62-3.76 ms a call at 4 tokens and 1.02-1.09 against 1.07-1.10 at one
/// (one thread, Zen 3 VM, bench_expert, six alternations with strides read from `w`).
pub(super) fn packed<const R: usize>(w: &BlockRows<'_, R>) -> bool {
    w.data_strides.row == BLOCK && w.scale_strides.row == 1
}

/// The blocks from one input to the next when the inputs are rows of one [`Mxint8Input`] in
/// order (the same step in all three arrays, views from any one block included), which lets
/// [`sub_offset`] reach every input from the first (a pointer per input and array spilled its
/// registers); `None` for inputs laid out otherwise.
///
/// [`Mxint8Input`]: super::mxint8::Mxint8Input
pub(super) fn spacing<const T: usize>(x: &[Mxint8Row<'_>; T]) -> Option<usize> {
    let first = x.first()?;
    let bytes_after = |p: *const u8, q: *const u8| (q as usize).checked_sub(p as usize);
    let step = match x.get(1) {
        Some(second) => {
            bytes_after(first.values.as_ptr().cast(), second.values.as_ptr().cast())? / BLOCK
        }
        None => 0,
    };
    let evenly = x.iter().enumerate().all(|(t, x)| {
        let blocks = t * step;
        bytes_after(first.values.as_ptr().cast(), x.values.as_ptr().cast()) == Some(blocks * BLOCK)
            && bytes_after(
                first.offset_sums.as_ptr().cast(),
                x.offset_sums.as_ptr().cast(),
            ) == Some(blocks * MX_LANES * 4)
            && bytes_after(first.bases.as_ptr().cast(), x.bases.as_ptr().cast()) == Some(blocks * 2)
    });
    evenly.then_some(step)
}

/// [`sub`] for MXFP4 rows in pairs against `TT` inputs from `x0` on, `spacing` blocks apart
/// ([`spacing`]): the weights decode to their integers plus [`super::mxint8::FP4_OFFSET`]
/// (unsigned), which `vpmaddubsw` multiplies by the inputs as they are stored; each lane then
/// takes away the offset times its inputs' sum ([`Mxint8Row::offset_sums`]), which leaves the
/// exact sums `sub` gets. A product takes 5 instructions, its scale read by the multiply-add
/// itself ([`WIDE_SCALE_TABLE`]), where `sub`'s take 7 and prepare each input's magnitude again
/// for every sub-block.
///
/// The wide scale table, a pair of rows decoded at a time against several inputs, and
/// [`fold_eight`] took GPT-OSS-20B's expert (bench_expert, MXINT8 inputs, Zen 3 VM, the builds
/// alternated three times) at one token to 1.08 ms a call from 1.15-1.21 on one thread, and to
/// 0.64-0.67 from 0.69-0.73 on two; at two tokens to 2.10-2.12 from 2.19-2.25, and to 1.13-1.23
/// from 1.25-1.28. From four tokens on the two were level: there the multiply-adds' port
/// (`vpmaddubsw` and `vpmaddwd` share one, a cycle each) holds a product to two cycles at best.
///
/// # Safety
/// As [`block_sums`]; `F` is [`MXFP4_PAIRS`] or [`MXFP4_PAIRS_SECOND`]; `w` is [`packed`]; the
/// `TT` inputs hold every block of `segment`.
#[target_feature(enable = "avx2,fma")]
unsafe fn sub_offset<const F: u8, const RR: usize, const TT: usize, const PREFETCH: bool>(
    w: &BlockRows<'_, RR>,
    x0: &Mxint8Row<'_>,
    spacing: usize,
    segment: &std::ops::Range<usize>,
    shape: &Shape,
) -> [[f32; TT]; RR] {
    const { assert!(matches!(F, MXFP4_PAIRS | MXFP4_PAIRS_SECOND)) };
    debug_assert!(packed(w), "sub_offset takes the tile layout");
    let (data, scales) = (w.data.as_ptr(), w.scales.as_ptr());
    // SAFETY: FP4_OFFSET_TIMES_TWO is 16 bytes.
    let lut = _mm256_broadcastsi128_si256(unsafe {
        _mm_loadu_si128(FP4_OFFSET_TIMES_TWO.as_ptr().cast())
    });
    let ones = _mm256_set1_epi16(1);
    // A scale entry's bytes: one register.
    const ENTRY: usize = MX_LANES * 4;
    let table = WIDE_SCALE_TABLE.0.as_ptr().cast::<u8>();
    let (values, sums, bases) = (
        x0.values.as_ptr(),
        x0.offset_sums.as_ptr(),
        x0.bases.as_ptr(),
    );
    let mut acc = [[_mm256_setzero_ps(); TT]; RR];
    for b in segment.clone() {
        if PREFETCH && shape.fresh {
            prefetch::<F, RR>(w, data, scales, shape.steps, b);
        }
        // SAFETY: block b of every row and its scale byte are inside the rows (checked by the
        // caller); the inputs hold block b; a scale index is a scale byte plus a base, inside
        // the table, so each row's entry plus an input's base lies inside it too.
        unsafe {
            // The tile layout's strides within a block are constants (see `packed`), which
            // makes each row's offset an immediate.
            let (d, sc) = (
                data.add(b * w.data_strides.block),
                scales.add(b * w.scale_strides.block),
            );
            // Several inputs over more than two rows take the rows two at a time, each pair
            // decoded just before its products: with every row's integers held at once, 4 rows x
            // 2 inputs kept two accumulators on the stack.
            let pairs = TT >= 2 && RR > 2 && RR.is_multiple_of(2);
            for r0 in (0..RR).step_by(if pairs { 2 } else { RR }) {
                let mut u = [_mm256_setzero_si256(); RR];
                let mut row_scales = [table; RR];
                for r in r0..if pairs { r0 + 2 } else { RR } {
                    let at = unit_of::<F>(r) * BLOCK;
                    u[r] = weight_integers::<F>(second_of_pair::<F>(r), d.add(at), lut);
                    row_scales[r] = table.add(usize::from(*sc.add(r)) * ENTRY);
                }
                // `t` places the input's block and picks each row's accumulator.
                #[allow(clippy::needless_range_loop)]
                for t in 0..TT {
                    let at = t * spacing + b;
                    let q = _mm256_loadu_si256(values.add(at * BLOCK).cast());
                    let offset = _mm256_loadu_si256(sums.add(at * MX_LANES).cast());
                    let base = usize::from(*bases.add(at)) * ENTRY;
                    for r in r0..if pairs { r0 + 2 } else { RR } {
                        let fours = _mm256_madd_epi16(_mm256_maddubs_epi16(u[r], q), ones);
                        let exact = _mm256_sub_epi32(fours, offset);
                        let scale = _mm256_loadu_ps(row_scales[r].add(base).cast());
                        acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), scale, acc[r][t]);
                    }
                }
            }
        }
    }
    folded(&acc)
}

/// Every accumulator of a sub-block folded ([`fold`]), eight at a time where there are eight.
#[target_feature(enable = "avx2")]
#[inline]
fn folded<const RR: usize, const TT: usize>(acc: &[[__m256; TT]; RR]) -> [[f32; TT]; RR] {
    let mut out = [[0f32; TT]; RR];
    if RR * TT == 8 {
        let sums = fold_eight(&std::array::from_fn(|k| acc[k / TT][k % TT]));
        for (k, sum) in sums.into_iter().enumerate() {
            out[k / TT][k % TT] = sum;
        }
    } else {
        for (out, acc) in out.iter_mut().zip(acc) {
            for (o, &a) in out.iter_mut().zip(acc) {
                *o = fold(a);
            }
        }
    }
    out
}
