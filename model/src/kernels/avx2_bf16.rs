//! The AVX2 path of [`super::bf16`], for CPUs without AVX-512 BF16: each lane adds element
//! `2l + 1`'s product and then element `2l`'s as two fused multiply-adds in f32, which is what
//! `vdpbf16ps` computes (a product of two bf16 values is exact in f32) except for its flushing
//! of values below f32's normal range.
//!
//! The flushing is handled without a cost per term. Weights: MXFP4 values come from tables
//! already flushed; bf16 weights and the inputs are watched for their smallest nonzero
//! magnitude. When no input or weight of a segment is below the normal range and every
//! nonzero product is at least 2^-100, no sum can fall below it either: two such sums that
//! nearly cancel are both multiples of 2^-124, so what is left is zero or at least 2^-124. The
//! fused multiply-adds then give the instruction's bits, and a segment where that cannot be
//! shown (inputs or weights within 2^100 of the range's edge) is computed again by the
//! portable definition.

use super::avx2::{
    Block, Fp4Bytes, Layout, add_terms, even_of_pairs, fold_block, layout, lookup, odd_of_pairs,
    pair_nibbles, row_nibbles, row_pairs, sub_blocks, sub_rows_for,
};
use super::avx2_bf16_rows::{row_chunks, row_chunks_fit, rows_in_turn, rows_in_turn_fits};
use super::bf16::portable_segment;
use super::x86::{BF16, MXFP4, MXFP4_PAIRS, MXFP4_PAIRS_SECOND, data_at, prefetch, second_of_pair};
use super::{BLOCK, BlockFormat, BlockRows, Paired as Fused, Reduction, Sink};
use std::arch::x86_64::*;

/// Four registers per block and input, in the order the multiply-adds take them: the first
/// term's two registers, then the second's. Widened input by input, block `b` of input `t` is
/// at `((t * blocks) + b) * 4` ([`Self::at`]); block by block, at `((b * tokens) + t) * 4`
/// ([`Self::block_major`]).
pub(super) struct InputVectors {
    vectors: Vec<__m256>,
    /// Blocks per input.
    blocks: usize,
}

impl InputVectors {
    /// Room for `tokens` inputs of `blocks` blocks, reusing this thread's buffer; the caller
    /// then [`Self::widen`]s every block of input 0, then of input 1, ..., or block 0 of every
    /// input, then block 1, ... (written once, not zeroed first: zeroing cost a few percent of a
    /// card's decode step).
    pub(super) fn take(tokens: usize, blocks: usize) -> Self {
        let mut vectors = SCRATCH.with(|s| std::mem::take(&mut *s.borrow_mut()));
        vectors.clear();
        vectors.reserve(tokens * blocks * 4);
        InputVectors { vectors, blocks }
    }

    /// Appends input `x`'s block `b`, widened to f32 with its odd elements first (in `layout`),
    /// and lowers `smallest` by its magnitudes as [`watch`] does.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(super) fn widen(&mut self, x: &[u16], b: usize, layout: Layout, smallest: &mut __m256i) {
        let block = &x[b * BLOCK..(b + 1) * BLOCK];
        // SAFETY: `block` holds 32 values: two 32-byte loads.
        let (lo, hi) = unsafe {
            let p = block.as_ptr();
            (
                _mm256_loadu_si256(p.cast()),
                _mm256_loadu_si256(p.add(16).cast()),
            )
        };
        *smallest = watch(watch(*smallest, lo), hi);
        let (a, b) = match layout {
            Layout::Natural => (lo, hi),
            Layout::Split => (
                _mm256_permute2x128_si256::<0x20>(lo, hi),
                _mm256_permute2x128_si256::<0x31>(lo, hi),
            ),
        };
        self.vectors.extend_from_slice(&[
            odd_of_pairs(a),
            odd_of_pairs(b),
            even_of_pairs(a),
            even_of_pairs(b),
        ]);
    }

    /// The first float of inputs widened block by block (block `i` of input `t` at `(i * T +
    /// t) * BLOCK` floats), where every block of all `T` inputs has been pushed.
    pub(super) fn block_major<const T: usize>(&self) -> *const f32 {
        assert_eq!(
            self.vectors.len(),
            T * self.blocks * 4,
            "every input's blocks widened"
        );
        self.vectors.as_ptr().cast()
    }

    /// Where block `b` of input `t` starts, the inputs widened input by input: a block's 32
    /// floats, then the next block's, as `add_terms` reads them.
    #[inline(always)]
    fn at(&self, t: usize, b: usize) -> *const f32 {
        // The kernels read all of input t's blocks from here: every one must have been pushed.
        assert!((t + 1) * self.blocks * 4 <= self.vectors.len());
        self.vectors[(t * self.blocks + b) * 4..].as_ptr().cast()
    }
}

impl Drop for InputVectors {
    fn drop(&mut self) {
        let vectors = std::mem::take(&mut self.vectors);
        // A thread being torn down has no buffer to give back to.
        let _ = SCRATCH.try_with(|s| *s.borrow_mut() = vectors);
    }
}

thread_local! {
    /// Each thread's input buffer, kept between calls.
    static SCRATCH: std::cell::RefCell<Vec<__m256>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The smallest biased exponent the smallest nonzero input and weight magnitudes of a segment
/// may add up to for the fused multiply-adds to be exact ([`segment_is_plain`]): products of at
/// least `2^(154 - 254) = 2^-100`.
const PLAIN_EXPONENTS: u32 = 154;

/// See [`super::bf16::bf16_block_sums`].
///
/// # Safety
/// The CPU must have the features of [`super::avx2::available`]; `w` and `x` must hold every
/// block the call reads ([`BlockRows::check`]).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn block_sums<const R: usize, const T: usize>(
    w: &BlockRows<'_, R>,
    x: &[&[u16]; T],
    reduction: &Reduction,
    emit: impl Sink<R, T>,
) {
    let Some(tables) = Fp4Bytes::flushed() else {
        unreachable!("the flushed values have the exact ones' low bytes: zero");
    };
    // The running prefetch is compiled in only where the rows ask for one and their layout
    // has steps to take.
    let prefetch = w.prefetch > 0 && w.prefetch_steps(reduction.blocks.end).is_some();
    macro_rules! go {
        ($path:ident $(, $f:expr)?) => {
            // SAFETY: forwarded from the caller.
            unsafe {
                if prefetch {
                    $path::<$({ $f },)? R, T, true>(w, x, reduction, tables, emit)
                } else {
                    $path::<$({ $f },)? R, T, false>(w, x, reduction, tables, emit)
                }
            }
        };
    }
    match w.format {
        BlockFormat::Mxfp4 => go!(sums, MXFP4),
        BlockFormat::Mxfp4RowPairs if w.pair_offset == 1 => go!(sums, MXFP4_PAIRS_SECOND),
        BlockFormat::Mxfp4RowPairs => go!(sums, MXFP4_PAIRS),
        _ if rows_in_turn_fits::<R, T>(w, reduction) => go!(rows_in_turn),
        // SAFETY: forwarded from the caller.
        _ if row_chunks_fit::<R, T>(w) => unsafe { row_chunks(w, x, reduction, tables, emit) },
        _ => go!(sums, BF16),
    }
}

/// The smallest nonzero magnitude's biased exponent of bf16 values, from the running minimum
/// of their magnitude bits minus one (zeros wrap to the maximum): `None` when all were zero,
/// `Some(0)` when one was below the normal range.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn smallest_exponent(min: __m256i) -> Option<u32> {
    let both = _mm_min_epu16(
        _mm256_castsi256_si128(min),
        _mm256_extracti128_si256::<1>(min),
    );
    let m = _mm_extract_epi16::<0>(_mm_minpos_epu16(both)) as u32;
    (m != 0xffff).then_some((m + 1) >> 7)
}

/// `min` lowered by the magnitude bits minus one of the 16 bf16 values in `v`.
#[target_feature(enable = "avx2")]
#[inline]
fn watch(min: __m256i, v: __m256i) -> __m256i {
    let magnitude = _mm256_and_si256(v, _mm256_set1_epi16(0x7fff));
    _mm256_min_epu16(min, _mm256_sub_epi16(magnitude, _mm256_set1_epi16(1)))
}

/// Whether a segment whose smallest nonzero input and weight magnitudes have these biased
/// exponents (`None`: all zero) takes the plain fused multiply-adds (see the module docs).
pub(super) fn segment_is_plain(input: Option<u32>, weight: Option<u32>) -> bool {
    match (input, weight) {
        (Some(x), Some(w)) => x >= 1 && w >= 1 && x + w >= PLAIN_EXPONENTS,
        _ => true,
    }
}

/// # Safety
/// As [`block_sums`].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn sums<const F: u8, const R: usize, const T: usize, const PREFETCH: bool>(
    w: &BlockRows<'_, R>,
    x: &[&[u16]; T],
    reduction: &Reduction,
    tables: &Fp4Bytes,
    mut emit: impl Sink<R, T>,
) {
    let layout = layout::<F>(true);
    let steps = w.prefetch_steps(reduction.blocks.end).unwrap_or((0, 0));
    let rows_first = w.rows_first::<T>();
    let zero = _mm256_setzero_ps();
    for s in 0..reduction.segments() {
        let segment = reduction.segment_blocks(s);
        // Every row x input's 16 lanes, carried from one chunk of the segment to the next.
        let mut acc = [[[zero; 2]; T]; R];
        let mut smallest = _mm256_set1_epi16(-1);
        let mut weight: Option<u32> = None;
        let mut start = segment.start;
        loop {
            // One input's rows are read front to back, one stream: no chunks.
            let chunk = if rows_first {
                start..segment.end
            } else {
                start..(start + CHUNK_BLOCKS).min(segment.end)
            };
            // This chunk's inputs, odd elements first, and their smallest magnitude.
            let mut inputs = InputVectors::take(T, chunk.len());
            for x in x.iter() {
                for b in chunk.clone() {
                    inputs.widen(x, b, layout, &mut smallest);
                }
            }
            macro_rules! call {
                ($rr:literal, $tt:literal, $r0:expr, $t0:expr) => {{
                    let view = w.rows_from::<$rr>($r0);
                    let fresh = $r0 == 0 && $t0 == 0;
                    let shape = Shape {
                        steps,
                        rows_first,
                        fresh,
                    };
                    let mut part = [[[zero; 2]; $tt]; $rr];
                    for (r, part) in part.iter_mut().enumerate() {
                        part.copy_from_slice(&acc[$r0 + r][$t0..$t0 + $tt]);
                    }
                    // SAFETY: forwarded from the caller; `inputs` holds the chunk's blocks.
                    let smallest: Option<u32> = unsafe {
                        if !matches!(F, MXFP4_PAIRS | MXFP4_PAIRS_SECOND) {
                            sub::<F, $rr, $tt, PREFETCH>(
                                &view, &inputs, $t0, &chunk, tables, &shape, &mut part,
                            )
                        } else if view.pair_offset == 1 {
                            sub::<MXFP4_PAIRS_SECOND, $rr, $tt, PREFETCH>(
                                &view, &inputs, $t0, &chunk, tables, &shape, &mut part,
                            )
                        } else {
                            sub::<MXFP4_PAIRS, $rr, $tt, PREFETCH>(
                                &view, &inputs, $t0, &chunk, tables, &shape, &mut part,
                            )
                        }
                    };
                    weight = match (weight, smallest) {
                        (Some(a), Some(b)) => Some(a.min(b)),
                        (a, b) => a.or(b),
                    };
                    for (r, part) in part.iter().enumerate() {
                        acc[$r0 + r][$t0..$t0 + $tt].copy_from_slice(part);
                    }
                }};
            }
            sub_blocks!(R, T, sub_rows_for::<F>(T, rows_first), call);
            drop(inputs);
            if chunk.end >= segment.end {
                break;
            }
            start = chunk.end;
        }
        let out = if segment_is_plain(smallest_exponent(smallest), weight) {
            fold_block(&acc, layout)
        } else {
            portable_segment(w, x, reduction, s)
        };
        emit.segment(s, &out);
    }
}

/// Blocks of a segment whose inputs are converted at a time, the accumulators carried across:
/// four inputs' 16 blocks take 8 KB, which stays in L1 while every row of the register block
/// reads it, where a 2,880-column row's 90 blocks took 46 KB.
const CHUNK_BLOCKS: usize = 16;

/// What a segment's sub-blocks share.
struct Shape {
    /// The whole register block's prefetch steps (`BlockRows::prefetch_steps`).
    steps: (usize, usize),
    rows_first: bool,
    /// Whether this sub-block starts the register block (and runs its prefetch).
    fresh: bool,
}

/// The block at `data` with its odd elements first (MXFP4: scale byte at `scale`; a row pair's
/// block: its first row's values, or its second's when `second`); a bf16 block lowers
/// `smallest` by its magnitudes as [`watch`] does.
///
/// # Safety
/// The block's bytes (and its scale byte, for MXFP4) must be readable; AVX2 must be available.
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(super) unsafe fn decode<const F: u8>(
    second: bool,
    data: *const u8,
    scale: *const u8,
    tables: &Fp4Bytes,
    smallest: &mut __m256i,
) -> Block {
    // SAFETY: the caller guarantees the bytes read here are inside the rows.
    unsafe {
        match F {
            MXFP4_PAIRS | MXFP4_PAIRS_SECOND => {
                let w = lookup(pair_nibbles(data, second), scale, tables);
                Block {
                    first: [odd_of_pairs(w[0]), odd_of_pairs(w[1])],
                    second: [even_of_pairs(w[0]), even_of_pairs(w[1])],
                }
            }
            MXFP4 => {
                let (even, odd) = row_pairs(lookup(row_nibbles(data), scale, tables));
                Block {
                    first: odd,
                    second: even,
                }
            }
            _ => {
                let (a, b) = (
                    _mm256_loadu_si256(data.cast()),
                    _mm256_loadu_si256(data.add(32).cast()),
                );
                *smallest = watch(watch(*smallest, a), b);
                bf16_halves(a, b)
            }
        }
    }
}

/// The bf16 block at `data` widened, as [`decode`] gives it, without watching its magnitudes
/// (for rows whose smallest is known: [`BlockRows::with_smallest_weight_exponent`]).
///
/// # Safety
/// The block's 64 bytes must be readable; AVX2 must be available.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn bf16_block(data: *const u8) -> Block {
    // SAFETY: the caller guarantees the block's bytes are readable.
    unsafe {
        bf16_halves(
            _mm256_loadu_si256(data.cast()),
            _mm256_loadu_si256(data.add(32).cast()),
        )
    }
}

/// A bf16 block's two 16-value halves widened to f32 by pair position.
#[target_feature(enable = "avx2")]
#[inline]
fn bf16_halves(a: __m256i, b: __m256i) -> Block {
    Block {
        first: [odd_of_pairs(a), odd_of_pairs(b)],
        second: [even_of_pairs(a), even_of_pairs(b)],
    }
}

/// The rows `w` (a sub-block's) against inputs `t0..t0 + TT` over the blocks `segment`, added
/// to `acc`; the biased exponent of the smallest nonzero weight magnitude they met (`None`: all
/// zero).
///
/// # Safety
/// As [`block_sums`]; `inputs` holds the segment's blocks for every input.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn sub<const F: u8, const RR: usize, const TT: usize, const PREFETCH: bool>(
    w: &BlockRows<'_, RR>,
    inputs: &InputVectors,
    t0: usize,
    segment: &std::ops::Range<usize>,
    tables: &Fp4Bytes,
    shape: &Shape,
    acc: &mut [[[__m256; 2]; TT]; RR],
) -> Option<u32> {
    let (data, scales) = (w.data.as_ptr(), w.scales.as_ptr());
    let xs: [*const f32; TT] = std::array::from_fn(|t| inputs.at(t0 + t, 0));
    let mut smallest = _mm256_set1_epi8(-1);
    let mut smallest_scale = u8::MAX;
    // SAFETY (`row`): block b of every row is inside `data` (checked by the caller); the scale
    // address is only read by MXFP4, whose scales were checked too.
    macro_rules! row {
        ($r:expr, $b:expr) => {
            unsafe {
                if F != BF16 {
                    smallest_scale = smallest_scale.min(*scales.add(w.scale_at($r, $b)));
                }
                decode::<F>(
                    second_of_pair::<F>($r),
                    data.add(data_at::<F, RR>(w, $r, $b)),
                    scales.wrapping_add(w.scale_at($r, $b)),
                    tables,
                    &mut smallest,
                )
            }
        };
    }
    if shape.rows_first {
        // Row by row, each front to back (see `BlockRows::rows_first`).
        for (r, acc) in acc.iter_mut().enumerate() {
            for (i, b) in segment.clone().enumerate() {
                let d = row!(r, b);
                // SAFETY: `inputs` holds the segment's blocks of every input.
                unsafe { add_terms::<Fused>(&mut acc[0], &d, xs[0].add(i * BLOCK)) };
            }
        }
    } else {
        for (i, b) in segment.clone().enumerate() {
            if PREFETCH && shape.fresh {
                prefetch::<F, RR>(w, data, scales, shape.steps, b);
            }
            for (r, acc) in acc.iter_mut().enumerate() {
                let d = row!(r, b);
                for (t, acc) in acc.iter_mut().enumerate() {
                    // SAFETY: as above.
                    unsafe { add_terms::<Fused>(acc, &d, xs[t].add(i * BLOCK)) };
                }
            }
        }
    }
    if F == BF16 {
        smallest_exponent(smallest)
    } else if segment.is_empty() {
        None
    } else {
        // The smallest scale byte s: its nonzero values are at least 2^(s - 128), and those
        // below the normal range were flushed to zero in the tables.
        Some(u32::from(smallest_scale).saturating_sub(1).max(1))
    }
}
