//! The AVX2 bf16 path's loops that keep one row's sums in registers while it runs over its
//! blocks against every input ([`super::avx2_bf16`] decides which rows take them): a card's
//! row group against 2-4 inputs ([`rows_in_turn`]), and a row-major matrix against 1-4
//! ([`row_chunks`]). Both give the bits of the chunked path: each row adds its blocks in the
//! same order, into the same lanes, and folds each segment the same way. Neither reads
//! anything but the rows and inputs the caller checked.

use super::avx2::{Fp4Bytes, add_terms, fold_block, layout};
use super::avx2_bf16::{InputVectors, bf16_block, decode, segment_is_plain, smallest_exponent};
use super::bf16::portable_segment;
use super::x86::{BF16, data_at};
use super::{BLOCK, BlockFormat, BlockRows, Paired as Fused, Reduction, Sink};
use std::arch::x86_64::*;

/// Most segments [`rows_in_turn`] keeps sums of (a 16,384-column reduction in the card's
/// 512-element segments); longer reductions take the chunked path.
const MAX_SEGMENTS_IN_TURN: usize = 32;

/// Whether [`rows_in_turn`] takes these rows: two to four inputs over bf16 rows whose blocks
/// lie side by side (a card's row group), not a row-major matrix ([`row_chunks`]). Two inputs
/// took the chunked path's two-row sub-blocks until [`SpreadPrefetch`]: GPT-OSS-20B's bf16
/// expert at 2 tokens (bench_expert, bf16 inputs, Zen 3 VM) now takes 4.41-4.46 ms a call
/// here against 5.68-6.01 there on one thread (alternated three times), and 2.18-2.27 against
/// 2.91-2.95 on two (twice).
pub(super) fn rows_in_turn_fits<const R: usize, const T: usize>(
    w: &BlockRows<'_, R>,
    reduction: &Reduction,
) -> bool {
    T >= 2
        && w.format == BlockFormat::Bf16
        && w.data_strides.block != BLOCK * 2
        && reduction.segments() <= MAX_SEGMENTS_IN_TURN
}

/// Two to four inputs over bf16 rows side by side: the inputs are widened once for the whole
/// reduction, then in each segment every row in turn runs over the segment's blocks against
/// all of them, its accumulators in registers (one row x four inputs: eight, with the row's
/// block in four more). The chunked path (`avx2_bf16::sums`) widened the inputs again for
/// every register block and 16-block chunk, and carried each sub-block's accumulators through
/// memory. Each row's sums are the same bits: its blocks are added in the same order, into the
/// same lanes, and folded per segment the same way.
///
/// The next segment's run is asked for a line at a time across every row's pass
/// ([`SpreadPrefetch`]), so the later rows find their segment in cache and the memory never
/// waits for the first row. Rows taken whole one after another (each over every segment) read
/// the group in as many strided passes, and were slower (9.6-10 against 8.7-8.8 ms a call at 4
/// tokens).
///
/// # Safety
/// As [`super::avx2_bf16::block_sums`].
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn rows_in_turn<const R: usize, const T: usize, const PREFETCH: bool>(
    w: &BlockRows<'_, R>,
    x: &[&[u16]; T],
    reduction: &Reduction,
    tables: &Fp4Bytes,
    mut emit: impl Sink<R, T>,
) {
    let layout = layout::<BF16>(true);
    let blocks = reduction.blocks.clone();
    let segments = reduction.segments();
    let zero = _mm256_setzero_ps();
    // Every input's blocks widened, block by block (block `i` of input `t` at `(i * T + t) *
    // BLOCK` floats: one pointer for all inputs, where one each did not fit in registers), and
    // each segment's smallest input magnitude.
    let mut inputs = InputVectors::take(T, blocks.len());
    let mut smallest_input = [_mm256_set1_epi16(-1); MAX_SEGMENTS_IN_TURN];
    for (s, smallest) in smallest_input.iter_mut().enumerate().take(segments) {
        for b in reduction.segment_blocks(s) {
            for x in x.iter() {
                inputs.widen(x, b, layout, smallest);
            }
        }
    }
    let xs = inputs.block_major::<T>();
    let steps = w.prefetch_steps(reduction.blocks.end).unwrap_or((0, 0));
    let (data, scales) = (w.data.as_ptr(), w.scales.as_ptr());
    let block_step = w.data_strides.block;
    for (s, smallest_input) in smallest_input.iter().enumerate().take(segments) {
        let mut sums = [[0f32; T]; R];
        let mut smallest_weight = _mm256_set1_epi16(-1);
        let mut ahead = SpreadPrefetch::new::<R>(reduction, s, steps.0);
        let segment = reduction.segment_blocks(s);
        for (r, sums) in sums.iter_mut().enumerate() {
            let mut acc = [[zero; 2]; T];
            // The row's block and the inputs' blocks, stepped through the segment (an offset
            // worked out again each block cost a multiply and reloads of spilled values).
            let mut wp = data.wrapping_add(data_at::<BF16, R>(w, r, segment.start));
            let mut xp = xs.wrapping_add((segment.start - blocks.start) * T * BLOCK);
            for _ in segment.clone() {
                if PREFETCH {
                    ahead.turn(data);
                }
                // SAFETY: `wp` is at one of the segment's blocks of row r, inside `data`
                // (checked by the caller), and `xp` at that block of every input.
                unsafe {
                    let d = decode::<BF16>(false, wp, scales, tables, &mut smallest_weight);
                    for (t, acc) in acc.iter_mut().enumerate() {
                        add_terms::<Fused>(acc, &d, xp.add(t * BLOCK));
                    }
                }
                wp = wp.wrapping_add(block_step);
                xp = xp.wrapping_add(T * BLOCK);
            }
            *sums = fold_block(&[acc], layout)[0];
        }
        let plain = segment_is_plain(
            smallest_exponent(*smallest_input),
            smallest_exponent(smallest_weight),
        );
        if plain {
            emit.segment(s, &sums);
        } else {
            emit.segment(s, &portable_segment(w, x, reduction, s));
        }
    }
}

/// Whether [`row_chunks`] takes these rows: one to six inputs over a row-major bf16 matrix
/// (the reference forward's products, and the attention node's). Six inputs keep twelve
/// accumulators and a block's four weight registers, all in registers.
pub(super) fn row_chunks_fit<const R: usize, const T: usize>(w: &BlockRows<'_, R>) -> bool {
    (1..=6).contains(&T) && w.format == BlockFormat::Bf16 && w.data_strides.block == BLOCK * 2
}

/// Blocks of each row that [`row_chunks`] reads before the next row's. One input's sums take
/// about a quarter of four inputs' time a block, so its chunks are shorter, and its prefetch
/// (a few rows ahead, same chunk) stays about as far ahead in time. Tuned on a 16,384 x 2,880
/// matrix, both threads of a Zen 3 VM (scratch bench, two runs each): one input took 3.2-3.7 ms
/// a product at 4 and 8 blocks, 4.0-4.4 at 16; four inputs 5.2-5.4 at 16 and 32 blocks, 5.7 at
/// 8.
const fn chunk_blocks(tokens: usize) -> usize {
    if tokens == 1 { 8 } else { 16 }
}

/// How many rows ahead of the one it reads [`row_chunks`] asks the cache for the same chunk:
/// 2, 4 and 8 were level within the noise, and 1 was slower.
const ROWS_AHEAD: usize = 4;

/// One to six inputs over a row-major bf16 matrix: every row in turn runs over a chunk of its
/// blocks against all the inputs, its accumulators in registers (loaded and stored once a
/// chunk), then the rows run over the next chunk; each segment's inputs are widened once,
/// block by block. Rows whose smallest weight is known in advance
/// ([`BlockRows::with_smallest_weight_exponent`]) skip watching each block's magnitudes, six
/// instructions a block beside its 4 x T multiply-adds. At each block, the row [`ROWS_AHEAD`]
/// further on is asked for at the same place, a line at a time: read this way, the rows are as
/// many streams broken a chunk at a time, which the hardware prefetcher does not follow far
/// enough ahead.
///
/// It replaced two reads. One input read the rows one after another, one stream left to the
/// hardware prefetcher. Two to four inputs took the chunked path (sub-blocks of one or two
/// rows), which asked for each row's next chunk as it read the current one: too far ahead, as
/// 32 rows' chunks fill L1. bench_kernels (16,384 x 2,880, bf16 x bf16, both threads, Zen 3 VM,
/// alternated three times) took 3.20-3.55 ms a product against 4.30-4.84 at one token,
/// 4.62-5.00 against 6.23-6.61 at 4, 15.2-15.4 against 17.6-17.9 at 16 (four calls of 4 over
/// the same rows, the later ones from L2) and 57.9-58.2 against 63.6-64.4 at 64.
///
/// # Safety
/// As [`super::avx2_bf16::block_sums`].
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn row_chunks<const R: usize, const T: usize>(
    w: &BlockRows<'_, R>,
    x: &[&[u16]; T],
    reduction: &Reduction,
    tables: &Fp4Bytes,
    mut emit: impl Sink<R, T>,
) {
    let layout = layout::<BF16>(true);
    let zero = _mm256_setzero_ps();
    let data = w.data.as_ptr();
    let ahead = ROWS_AHEAD.min(R) * w.data_strides.row;
    let known_weight = w.smallest_weight_exponent;
    for s in 0..reduction.segments() {
        let segment = reduction.segment_blocks(s);
        let mut inputs = InputVectors::take(T, segment.len());
        let mut smallest_input = _mm256_set1_epi16(-1);
        for b in segment.clone() {
            for x in x.iter() {
                inputs.widen(x, b, layout, &mut smallest_input);
            }
        }
        // Each input's segment widened, block by block (block `i` of input `t` at `(i * T + t) *
        // BLOCK` floats).
        let xs = inputs.block_major::<T>();
        let mut smallest_weight = _mm256_set1_epi16(-1);
        let mut acc = [[[zero; 2]; T]; R];
        let mut start = segment.start;
        while start < segment.end {
            let chunk = start..(start + chunk_blocks(T)).min(segment.end);
            for (r, acc) in acc.iter_mut().enumerate() {
                let wp = data.wrapping_add(data_at::<BF16, R>(w, r, chunk.start));
                let xp = xs.wrapping_add((chunk.start - segment.start) * T * BLOCK);
                // SAFETY: forwarded from the caller: the chunk's blocks of row r are inside
                // `data`, and `xs` holds them for every input.
                unsafe {
                    let (blocks, watched) = (chunk.len(), &mut smallest_weight);
                    if known_weight.is_some() {
                        row_chunk::<T, false>(acc, wp, xp, blocks, ahead, tables, watched);
                    } else {
                        row_chunk::<T, true>(acc, wp, xp, blocks, ahead, tables, watched);
                    }
                }
            }
            start = chunk.end;
        }
        let weight = known_weight.unwrap_or_else(|| smallest_exponent(smallest_weight));
        if segment_is_plain(smallest_exponent(smallest_input), weight) {
            emit.segment(s, &fold_block(&acc, layout));
        } else {
            emit.segment(s, &portable_segment(w, x, reduction, s));
        }
    }
}

/// One row of [`row_chunks`] over `blocks` blocks from `wp` against the `T` inputs' widened
/// blocks from `xp`, added to its accumulators `acc`; the weights' magnitudes are watched into
/// `smallest` when `WATCH` (their bound not known in advance).
///
/// # Safety
/// `wp` and `xp` must hold the chunk's blocks (`blocks` of the row, `blocks * T` of the inputs);
/// AVX2, FMA and F16C must be available.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn row_chunk<const T: usize, const WATCH: bool>(
    acc: &mut [[__m256; 2]; T],
    mut wp: *const u8,
    mut xp: *const f32,
    blocks: usize,
    ahead: usize,
    tables: &Fp4Bytes,
    smallest: &mut __m256i,
) {
    let mut a = *acc;
    for _ in 0..blocks {
        // A prefetch never faults, whatever the address (past the last row, it asks for the
        // next rows', which the next register block reads).
        _mm_prefetch::<_MM_HINT_T0>(wp.wrapping_add(ahead).cast());
        // SAFETY: `wp` and `xp` are at one of the chunk's blocks (the caller's guarantee).
        unsafe {
            let d = if WATCH {
                decode::<BF16>(false, wp, std::ptr::null(), tables, smallest)
            } else {
                bf16_block(wp)
            };
            for (t, a) in a.iter_mut().enumerate() {
                add_terms::<Fused>(a, &d, xp.add(t * BLOCK));
            }
        }
        wp = wp.wrapping_add(BLOCK * 2);
        xp = xp.wrapping_add(T * BLOCK);
    }
    *acc = a;
}

/// The prefetch of [`rows_in_turn`]: while the rows take their turns over one segment, the run
/// of the next one (past the last segment, a run as long as the first one past the
/// reduction's end: the next row group's start, where groups lie one after another as in the
/// card's tiles) is asked for a little at every row's block, so that the memory stays busy
/// while the later rows compute from cache. Asked for all at once in the first row's pass, as a
/// running prefetch ahead of it, it came in bursts that the cache's queue of misses could not
/// take, and the memory stood idle through the other rows' passes: GPT-OSS-20B's bf16 expert
/// at 4 bf16 tokens (bench_expert, Zen 3 VM) took 6.92-7.27 ms a call that way and 5.63-5.82
/// this way on one thread (alternated six times), 3.67-3.82 and 2.99-3.04 on two (twice).
struct SpreadPrefetch {
    /// The next byte to ask for, from the rows' base.
    at: usize,
    /// The run's end.
    end: usize,
    /// Bytes asked for at each turn (whole lines).
    per_turn: usize,
}

impl SpreadPrefetch {
    /// The run to fetch during segment `s`, over `R` rows whose blocks are `step` bytes apart.
    fn new<const R: usize>(reduction: &Reduction, s: usize, step: usize) -> Self {
        let this = reduction.segment_blocks(s);
        let next_blocks = if s + 1 < reduction.segments() {
            reduction.segment_blocks(s + 1).len()
        } else {
            reduction.segment_blocks(0).len()
        };
        let bytes = next_blocks * step;
        SpreadPrefetch {
            at: this.end * step,
            end: this.end * step + bytes,
            per_turn: bytes.div_ceil((R * this.len()).max(1)).next_multiple_of(64),
        }
    }

    /// One row's turn at one block: asks for the next share of the run (the last share may
    /// reach past the run's end by less than a share, which is harmless: a prefetch never
    /// faults).
    #[inline(always)]
    fn turn(&mut self, data: *const u8) {
        if self.at >= self.end {
            return;
        }
        let to = self.at + self.per_turn;
        loop {
            // SAFETY: SSE is part of x86-64, and a prefetch never faults, whatever the address.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(data.wrapping_add(self.at).cast()) };
            self.at += 64;
            if self.at >= to {
                break;
            }
        }
    }
}
