//! The tile kernel: segment partials of one weight tile against a block of tokens, straight
//! from the tile's storage bytes, by the shared matrix kernel of [`model::kernels`] in the
//! card's [`Paired`] order, or the bf16 or MXINT8 order where the program marks the matrix so
//! ([`TileInput`]); weights are decoded inside the loop, never expanded.
//!
//! Inputs are "pair-ordered": within each 32-element block, the 16 even elements then the 16
//! odd ones ([`pair_order`]), so lane `l` meets element `2l` then `2l + 1`, as the numerics
//! definition says. Every path ([`KernelChoice`]: portable, AVX2, AVX-512) computes the same bits.
//!
//! Tile storage ([`pack_rows`]): rows come in groups of [`ROW_GROUP`]; inside a group the
//! blocks are interleaved (block 0 of every row of the group, then block 1, ...), for the data
//! and for the scales alike, so a kernel running a group of rows reads one sequential stream.
//! Each row's block is laid out as [`crate::format`] describes, except in MXFP4 tiles, where
//! rows `2i` and `2i + 1` of a group share one 32-byte block ([`BlockFormat::Mxfp4RowPairs`]:
//! byte `k` holds element `k` of the first row in its low nibble and of the second in its
//! high one); the last row of a group of odd size keeps the MXFP4 row layout. Decoding a pair
//! takes fewer instructions: one widening gives both rows' nibbles in element order.

pub use model::kernels::KernelChoice;
use model::kernels::{
    BlockFormat, BlockJob, BlockRows, Mxint8Input, Mxint8Row, Paired, Reduction, Sink, Strides,
    bf16_block_sums, bf16_reads_one_input_in_one_pass, block_sums,
    block_sums_read_one_input_in_one_pass, mxint8_block_sums, prefetch_start, register_blocks,
    token_quads,
};

use crate::format::TileFormat;
use crate::numerics::{BLOCK, BLOCKS_PER_SEGMENT, LANES};

/// How far ahead (bytes) the kernel prefetches a tile's weights, except for one token: over
/// the tiles of [`ONE_TOKEN_PREFETCH_BYTES`] and [`ONE_TOKEN_BF16_PREFETCH_BYTES`], or over
/// another dense (bf16, f16, f32) tile, whose stream the hardware prefetcher followed better
/// alone on a 2-core AMD EPYC (Zen 4, AVX-512) VM: bench_expert's GPT-OSS-20B expert in bf16
/// (one thread, one token) streamed at 16.9-17.9 GB/s without the software prefetch against
/// 14.4-15.8 with it (bf16 inputs; f32 inputs 14.6-15.9 against 12.1-12.5), both builds
/// alternated 3 times. MXFP4 tiles, decoded in registers and read more slowly, keep a prefetch
/// (without, their f32-input call took 1.40-1.61 against 1.37-1.51 ms). From two tokens on
/// either way was within the noise.
const PREFETCH_BYTES: usize = 8192;

/// The prefetch distance for one token over an MXFP4 tile (row pairs, a short decode):
/// bench_expert's GPT-OSS-20B expert (bf16 inputs, one thread, Zen 4 VM), the distances taken
/// in turn in one run, took 0.85-0.90 ms a call at 2 KB against 0.92-0.99 at 8 KB, 0.89-0.96 at
/// 4 KB and 0.94-1.08 without (three runs). On a Zen 3 VM with MXINT8 inputs (two processes side
/// by side, as two cards, alternated twice) 2 KB still took 1.07-1.09 ms against 1.11-1.16 at
/// 1 KB and 1.19-1.25 at 512 bytes.
const ONE_TOKEN_PREFETCH_BYTES: usize = 2048;

/// The prefetch distance for one token over a bf16 tile that the kernel reads in one pass
/// ([`bf16_reads_one_input_in_one_pass`] for bf16 inputs, [`block_sums_read_one_input_in_one_pass`]
/// for f32 ones: the AVX2 paths' eight-row sub-blocks), whose eight rows take 512 bytes a
/// block. bench_expert, one token, one thread, Zen 3 VM, ms a call, 1 KB against 2 KB (the
/// distance these tiles shared with MXFP4's before), alternated three times:
/// - the medium Mixtral expert (768 x 2,048), f32 inputs, two processes side by side as two
///   cards: 0.70-0.73 against 0.82-0.87 (768 bytes 0.73-0.80, 1.5 KB 0.83-0.86); alone 0.68-0.70
///   against 0.80-0.81;
/// - GPT-OSS-20B's expert, alone: f32 inputs 3.16-3.36 against 3.68-3.86, bf16 inputs
///   3.72-3.76 against 3.84-4.05.
///
/// Earlier, on the same kind of VM, 2 KB had beaten no prefetch (bf16 inputs: 12.0-12.8 GB/s
/// against 8.4-10.6) and 4 KB; 1 KB had not been tried. From two tokens on, the longer
/// [`PREFETCH_BYTES`] stays: the medium expert at 2 and 4 tokens was slower at every shorter
/// distance tried (1-4 KB).
const ONE_TOKEN_BF16_PREFETCH_BYTES: usize = 1024;

/// Rows per group in tile storage.
pub const ROW_GROUP: usize = 8;

/// Data bytes of one 32-element block of one row.
pub fn block_bytes(format: TileFormat) -> usize {
    format.data_bytes(BLOCK)
}

/// Whether row `r` of a tile of `rows` rows is stored in a row pair: in MXFP4 tiles every row
/// but the last of a group of odd size.
#[inline(always)]
pub fn in_row_pair(format: TileFormat, rows: usize, r: usize) -> bool {
    let g = r / ROW_GROUP * ROW_GROUP;
    let size = ROW_GROUP.min(rows - g);
    format == TileFormat::Mxfp4 && !(size % 2 == 1 && r - g == size - 1)
}

/// Where block `b` of row `r` of a tile of `rows` rows and `blocks` blocks is stored:
/// (data offset, data stride between blocks, scale offset, scale stride). A row of a pair
/// ([`in_row_pair`]) is at its pair's block.
#[inline(always)]
pub fn block_place(
    format: TileFormat,
    rows: usize,
    blocks: usize,
    r: usize,
    b: usize,
) -> (usize, usize, usize, usize) {
    let g = r / ROW_GROUP * ROW_GROUP;
    let size = ROW_GROUP.min(rows - g);
    let bb = block_bytes(format);
    let sb = usize::from(format.has_scales());
    // A pair's block takes both rows' bytes, from the first row's place.
    let at = if in_row_pair(format, rows, r) {
        (r - g) & !1
    } else {
        r - g
    };
    (
        g * blocks * bb + b * size * bb + at * bb,
        size * bb,
        g * blocks * sb + b * size * sb + (r - g) * sb,
        size * sb,
    )
}

/// Packs a tile from its rows: `row(r, data, scales)` writes row `r` in the per-row layout
/// of [`crate::format::encode_row`]; `out` receives the tile storage (data, then scales).
pub fn pack_rows(
    format: TileFormat,
    rows: usize,
    cols: usize,
    row: impl FnMut(usize, &mut [u8], &mut [u8]),
    out: &mut [u8],
) {
    let (data, scales) = out.split_at_mut(rows * format.data_bytes(cols));
    pack_tile(format, rows, cols, row, data, scales);
}

/// [`pack_rows`] with the tile's data and scales in two places (the card's host memory keeps
/// them apart: [`crate::weights::BoundMemory`]).
pub fn pack_tile(
    format: TileFormat,
    rows: usize,
    cols: usize,
    mut row: impl FnMut(usize, &mut [u8], &mut [u8]),
    out_data: &mut [u8],
    out_scales: &mut [u8],
) {
    let (db, sb) = (format.data_bytes(cols), format.scale_bytes(cols));
    let blocks = cols.div_ceil(BLOCK);
    let bb = block_bytes(format);
    let (mut data, mut scales) = (vec![0u8; db], vec![0u8; sb]);
    for r in 0..rows {
        row(r, &mut data, &mut scales);
        let paired = in_row_pair(format, rows, r);
        for b in 0..blocks {
            let (d, _, s, _) = block_place(format, rows, blocks, r, b);
            let block = &data[b * bb..(b + 1) * bb];
            if paired {
                // Byte j (elements 2j, 2j + 1) into bytes 2j and 2j + 1 of the pair's block:
                // the low nibbles for the first row (written first, clearing the bytes), the
                // high ones for the second. (Pairs start at even rows: groups are of 8.)
                let pair = out_data[d..d + 2 * bb].chunks_exact_mut(2).zip(block);
                if r % 2 == 1 {
                    for (two, &byte) in pair {
                        two[0] = two[0] & 0x0f | byte << 4;
                        two[1] = two[1] & 0x0f | byte & 0xf0;
                    }
                } else {
                    for (two, &byte) in pair {
                        two[0] = byte & 0x0f;
                        two[1] = byte >> 4;
                    }
                }
            } else {
                out_data[d..d + bb].copy_from_slice(block);
            }
            if sb > 0 {
                out_scales[s] = scales[b];
            }
        }
    }
}

/// Row `r` of a packed tile, back in the per-row layout of [`crate::format::encode_row`]: the
/// inverse of [`pack_tile`], for checking what a tile holds.
pub fn unpack_row(
    format: TileFormat,
    rows: usize,
    cols: usize,
    r: usize,
    tile_data: &[u8],
    tile_scales: &[u8],
) -> (Vec<u8>, Vec<u8>) {
    let (db, sb) = (format.data_bytes(cols), format.scale_bytes(cols));
    let blocks = cols.div_ceil(BLOCK);
    let bb = block_bytes(format);
    let (mut data, mut scales) = (vec![0u8; db], vec![0u8; sb]);
    let paired = in_row_pair(format, rows, r);
    for b in 0..blocks {
        let (d, _, s, _) = block_place(format, rows, blocks, r, b);
        let block = &mut data[b * bb..(b + 1) * bb];
        if paired {
            // See pack_tile: the first row's nibbles are the low ones, the second's the high.
            for (byte, two) in block
                .iter_mut()
                .zip(tile_data[d..d + 2 * bb].chunks_exact(2))
            {
                *byte = if r % 2 == 1 {
                    two[0] >> 4 | two[1] & 0xf0
                } else {
                    two[0] & 0x0f | (two[1] & 0x0f) << 4
                };
            }
        } else {
            block.copy_from_slice(&tile_data[d..d + bb]);
        }
        if sb > 0 {
            scales[b] = tile_scales[s];
        }
    }
    (data, scales)
}

/// One tile's weights as stored (see [`pack_rows`]): all data, then all scales.
#[derive(Debug, Clone, Copy)]
pub struct TileView<'a> {
    /// Storage format.
    pub format: TileFormat,
    /// Rows of the tile.
    pub rows: usize,
    /// Columns (unpadded).
    pub cols: usize,
    /// `rows * format.data_bytes(cols)` bytes.
    pub data: &'a [u8],
    /// `rows * format.scale_bytes(cols)` bytes.
    pub scales: &'a [u8],
}

impl<'a> TileView<'a> {
    /// A view over the tile bytes `bytes` (data then scales, as [`pack_rows`] writes them).
    ///
    /// # Panics
    /// When `bytes` is shorter than the tile.
    pub fn new(format: TileFormat, rows: usize, cols: usize, bytes: &'a [u8]) -> Self {
        let (data, scales) = bytes.split_at(rows * format.data_bytes(cols));
        Self::from_parts(format, rows, cols, data, scales)
            .expect("tile bytes shorter than the tile")
    }

    /// A view over a tile whose data and scales are stored apart; `None` when either is
    /// shorter than the tile needs.
    pub fn from_parts(
        format: TileFormat,
        rows: usize,
        cols: usize,
        data: &'a [u8],
        scales: &'a [u8],
    ) -> Option<Self> {
        Some(TileView {
            format,
            rows,
            cols,
            data: data.get(..rows * format.data_bytes(cols))?,
            scales: scales.get(..rows * format.scale_bytes(cols))?,
        })
    }

    /// Blocks per row.
    pub fn blocks(&self) -> usize {
        self.cols.div_ceil(BLOCK)
    }

    /// Segments per row.
    pub fn segments(&self) -> usize {
        self.blocks().div_ceil(BLOCKS_PER_SEGMENT)
    }
}

/// Writes `x` (`cols` values) pair-ordered and zero-padded to whole blocks into `out`.
pub fn pair_order(x: &[f32], out: &mut [f32]) {
    out.fill(0.0);
    for (b, block) in out.chunks_exact_mut(BLOCK).enumerate() {
        for l in 0..LANES {
            for half in 0..2 {
                let k = b * BLOCK + 2 * l + half;
                if k < x.len() {
                    block[half * LANES + l] = x[k];
                }
            }
        }
    }
}

/// A tile kernel's input rows.
#[derive(Debug, Clone, Copy)]
pub enum TileInput<'a> {
    /// f32, pair-ordered ([`pair_order`]): the f32 order of the numerics.
    Paired(&'a [f32]),
    /// Rounded to bf16, in element order: the bf16 order (bf16 and MXFP4 tiles only).
    Bf16(&'a [u16]),
    /// Quantized to MXINT8, one row per token, from block `from_block` on: the MXINT8 order
    /// (MXFP4 and MXINT8 tiles only).
    Mxint8 {
        /// The quantized rows.
        input: &'a Mxint8Input,
        /// The tile's first block.
        from_block: usize,
    },
}

impl TileInput<'_> {
    /// The same rows from column `at` on.
    pub fn skip(self, at: usize) -> Self {
        match self {
            TileInput::Paired(x) => TileInput::Paired(&x[at..]),
            TileInput::Bf16(x) => TileInput::Bf16(&x[at..]),
            TileInput::Mxint8 { input, from_block } => TileInput::Mxint8 {
                input,
                from_block: from_block + at / BLOCK,
            },
        }
    }
}

/// What a tile's output holds for each row and token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PartialsLayout {
    /// Each segment's sum: `out[t * rows * segs + r * segs + s]`.
    Segments,
    /// The segments' sums added up in segment order, `((s0 + s1) + s2) + ...`, the additions a
    /// reduce over [`PartialsLayout::Segments`] makes: `out[t * rows + r]`. For a tile that
    /// spans the whole reduction, so that no other tile's partials come before its own.
    Folded,
}

impl PartialsLayout {
    /// Floats a row keeps for each token when the tile has `segments` segments.
    pub fn per_row(self, segments: usize) -> usize {
        match self {
            PartialsLayout::Segments => segments,
            PartialsLayout::Folded => 1,
        }
    }
}

/// Segment partials of `tile` for `tokens` input rows, laid out as `layout` says: row `t` of
/// the input starts at `x[t * x_stride]` (at the tile's first column).
pub fn tile_partials(
    tile: &TileView<'_>,
    x: TileInput<'_>,
    x_stride: usize,
    tokens: usize,
    out: &mut [f32],
    layout: PartialsLayout,
    kernel: KernelChoice,
) {
    let per_row = layout.per_row(tile.segments());
    assert!(
        out.len() >= tokens * tile.rows * per_row,
        "tile output too short"
    );
    // One token over the tiles read in one pass takes their own, shorter distance.
    let prefetch = match (tile.format, x) {
        _ if tokens > 1 => PREFETCH_BYTES,
        (TileFormat::Mxfp4, _) => ONE_TOKEN_PREFETCH_BYTES,
        (TileFormat::Bf16, TileInput::Bf16(_)) if bf16_reads_one_input_in_one_pass(kernel) => {
            ONE_TOKEN_BF16_PREFETCH_BYTES
        }
        (TileFormat::Bf16, TileInput::Paired(_))
            if block_sums_read_one_input_in_one_pass(kernel) =>
        {
            ONE_TOKEN_BF16_PREFETCH_BYTES
        }
        _ if tile.format.has_scales() => PREFETCH_BYTES,
        _ => 0,
    };
    // The first bytes of the tile are requested all at once (the running prefetch in the
    // kernel covers the rest), so the tile's start does not wait line by line.
    if kernel != KernelChoice::Portable && prefetch > 0 {
        prefetch_start(tile.data, prefetch);
        prefetch_start(tile.scales, 1);
    }
    // Register blocks never straddle a row group: the grid's 8-row blocks start at multiples
    // of 8 and its smaller ones at multiples of 4.
    const _: () = assert!(ROW_GROUP == 8);
    let mut job = Partials {
        tile,
        x,
        x_stride,
        out,
        layout,
        kernel,
        prefetch,
    };
    // bf16 tokens over a bf16 tile under the AVX2 path: from 3 tokens on, whole row groups
    // against up to 4 tokens at once (see `quad_blocks`); under the other paths, in pairs.
    let bf16_quads = tokens >= 3
        && tile.format == TileFormat::Bf16
        && matches!(x, TileInput::Bf16(_))
        && bf16_reads_one_input_in_one_pass(kernel);
    let mxint8_quads =
        matches!(x, TileInput::Mxint8 { .. }) && tile.format == TileFormat::Mxfp4 && tokens >= 3;
    let pairs = match x {
        TileInput::Bf16(_) => tokens == 2 || (tokens > 2 && tile.format == TileFormat::Bf16),
        TileInput::Paired(_) => false,
        TileInput::Mxint8 { .. } => tokens >= 2,
    };
    if mxint8_quads || bf16_quads {
        quad_blocks(tile.rows, tokens, &mut job);
    } else if pairs {
        pair_blocks(tile.rows, tokens, &mut job);
    } else {
        register_blocks(tile.rows, tokens, &mut job);
    }
}

/// The register blocks of bf16 tokens over a tile, two at a time: each whole row group (8 rows)
/// takes its tokens pair by pair, then the rows left over do the same; later pairs over a group
/// find its weights in cache. The shared grid's 4-row blocks each read every other cache line
/// of a group. Reading whole lines took GPT-OSS-20B's expert at 2 tokens, one thread, from 1.43
/// to 0.91 ms a call with MXFP4 weights and from 2.95 to 2.07 with bf16 (bench_expert, together
/// with the whole-run prefetch). On a bf16 tile in cache (64 rows, one thread, best of 2,000
/// calls), 4 tokens took 1.7 instead of 2.8 us at 768 columns and 4.4 instead of 7.2 at 2,048;
/// 32 tokens 12.3 instead of 14.0 and 30.4 instead of 36.3.
///
/// MXFP4 tiles take pairs at 2 tokens only: each pass decodes the weights again, which from 3
/// tokens on cost more than the 4 x 4 blocks lose. f32 inputs keep the shared grid: their
/// decoded weights take two registers a row, and 8 rows x 2 tokens would spill. 8 rows x 3 or
/// 4 tokens would not fit the accumulators in registers. MXINT8 inputs take pairs at 2 tokens
/// (their decode is a few instructions a row: the same expert at 4 tokens with MXINT8 inputs
/// took 4.30 against 6.68 ms a call on a Zen 3 VM, one thread, in pairs against the shared
/// grid) and [`quad_blocks`] from 3 on.
fn pair_blocks(rows: usize, tokens: usize, job: &mut impl BlockJob) {
    group_blocks::<false>(rows, tokens, job);
}

/// Whole row groups against up to 4 tokens at a time ([`token_quads`]; see [`pair_blocks`] for
/// the rows), for MXINT8 inputs over MXFP4 tiles: the kernel then takes each row pair against
/// 4 tokens, so a pass decodes the weights once for 4 tokens and reads the inputs of 4
/// (GPT-OSS-20B's expert at 8 tokens, one thread, Zen 3: 7.08-7.21 ms a call, against
/// 7.70-7.89 before the offset kernel; that kernel in pairs took 11.2-11.5: a row group's
/// passes over 8 tokens' inputs, 64 bytes a block with the offset sums, no longer fit L1).
/// Also for 3 or more bf16 tokens over bf16 tiles under the AVX2 path, whose kernel then takes
/// the group's rows in turn against 4 tokens, the inputs widened once a call (the same expert
/// in bf16, one thread, Zen 3 VM, alternated three times: 7.2-7.5 against 8.5-8.9 ms a call at
/// 4 tokens, 11.7-12.3 against 14.4-14.5 at 8).
fn quad_blocks(rows: usize, tokens: usize, job: &mut impl BlockJob) {
    group_blocks::<true>(rows, tokens, job);
}

/// Each whole row group, then 4 rows, then single rows, against every token: in pairs
/// ([`token_pairs`]) or up to four at a time ([`token_quads`]).
fn group_blocks<const QUADS: bool>(rows: usize, tokens: usize, job: &mut impl BlockJob) {
    fn tokens_of<const R: usize, const QUADS: bool>(
        r: usize,
        tokens: usize,
        job: &mut impl BlockJob,
    ) {
        if QUADS {
            token_quads::<R>(r, tokens, job);
        } else {
            token_pairs::<R>(r, tokens, job);
        }
    }
    let mut r = 0;
    while r + ROW_GROUP <= rows {
        tokens_of::<8, QUADS>(r, tokens, job);
        r += ROW_GROUP;
    }
    if r + 4 <= rows {
        tokens_of::<4, QUADS>(r, tokens, job);
        r += 4;
    }
    while r < rows {
        tokens_of::<1, QUADS>(r, tokens, job);
        r += 1;
    }
}

/// Rows `r..r + R` against every token, two at a time (the last one alone when odd).
fn token_pairs<const R: usize>(r: usize, tokens: usize, job: &mut impl BlockJob) {
    let mut t = 0;
    while t + 2 <= tokens {
        job.run::<R, 2>(r, t);
        t += 2;
    }
    if t < tokens {
        job.run::<R, 1>(r, t);
    }
}

/// One tile's partials, register block by register block.
struct Partials<'a, 'b> {
    tile: &'a TileView<'b>,
    x: TileInput<'a>,
    x_stride: usize,
    out: &'a mut [f32],
    layout: PartialsLayout,
    kernel: KernelChoice,
    /// Bytes the first token block over each row group prefetches ahead (0: none).
    prefetch: usize,
}

impl BlockJob for Partials<'_, '_> {
    fn run<const R: usize, const T: usize>(&mut self, r0: usize, t0: usize) {
        let tile = self.tile;
        let paired = in_row_pair(tile.format, tile.rows, r0);
        if R > 1 && paired != in_row_pair(tile.format, tile.rows, r0 + R - 1) {
            // Rows of a pair and the unpaired last row of a group: one layout a call. Only the
            // shared grid's 3-row block over a group of 3 or 7 rows meets this.
            for r in r0..r0 + R {
                self.run::<1, T>(r, t0);
            }
            return;
        }
        let nb = tile.blocks();
        // Rows of one register block share a row group: their blocks lie side by side, one
        // pair of strides apart (a pair's block holds two rows).
        let (data, data_stride, scale, scale_stride) =
            block_place(tile.format, tile.rows, nb, r0, 0);
        let format = if paired {
            BlockFormat::Mxfp4RowPairs
        } else {
            tile.format.block_format()
        };
        let rows = BlockRows::<R>::new(
            format,
            &tile.data[data..],
            Strides {
                row: format.unit_bytes(),
                block: data_stride,
            },
            &tile.scales[scale.min(tile.scales.len())..],
            Strides {
                row: usize::from(tile.format.has_scales()),
                block: scale_stride,
            },
        );
        // Pairs start at even rows (groups are of 8).
        let rows = if paired && r0 % 2 == 1 {
            rows.from_second_of_pair()
        } else {
            rows
        }
        // Only the first pass over these rows streams them from memory; the passes of later
        // tokens find them in cache, where prefetching only costs instructions.
        .with_prefetch(if t0 == 0 { self.prefetch } else { 0 });
        let reduction = Reduction {
            segment: BLOCKS_PER_SEGMENT,
            ..Reduction::whole(0..nb)
        };
        let per_row = self.layout.per_row(tile.segments());
        let emit = TilePartials {
            out: &mut *self.out,
            first: t0 * tile.rows * per_row + r0 * per_row,
            token_stride: tile.rows * per_row,
            row_stride: per_row,
            folded: self.layout == PartialsLayout::Folded,
        };
        let at = |t: usize| (t0 + t) * self.x_stride;
        match self.x {
            TileInput::Paired(x) => {
                let xs: [&[f32]; T] = std::array::from_fn(|t| &x[at(t)..]);
                block_sums::<Paired, R, T>(&rows, &xs, &reduction, self.kernel, emit)
            }
            TileInput::Bf16(x) => {
                let xs: [&[u16]; T] = std::array::from_fn(|t| &x[at(t)..]);
                bf16_block_sums::<R, T>(&rows, &xs, &reduction, self.kernel, emit)
            }
            TileInput::Mxint8 { input, from_block } => {
                let xs: [Mxint8Row<'_>; T] =
                    std::array::from_fn(|t| input.row(t0 + t).from_block(from_block));
                mxint8_block_sums::<R, T>(&rows, &xs, &reduction, self.kernel, emit)
            }
        }
    }
}

/// Where one register block's segment partials go in a tile's output.
struct TilePartials<'a> {
    out: &'a mut [f32],
    /// Index of the block's first token's first row's segment 0.
    first: usize,
    token_stride: usize,
    row_stride: usize,
    /// One float a row and token: segment `s > 0` adds to what segments `0..s` left there
    /// (kernels hand segments over in ascending order).
    folded: bool,
}

impl<const R: usize, const T: usize> Sink<R, T> for TilePartials<'_> {
    #[inline(always)]
    fn segment(&mut self, s: usize, sums: &[[f32; T]; R]) {
        for (r, sums) in sums.iter().enumerate() {
            for (t, q) in sums.iter().enumerate() {
                let at = self.first + t * self.token_stride + r * self.row_stride;
                if !self.folded {
                    self.out[at + s] = *q;
                } else if s == 0 {
                    self.out[at] = *q;
                } else {
                    self.out[at] += *q;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::assignment::Span;
    use crate::format::{card_values, encode_row};
    use crate::synthetic::{SplitMix, random_matrix};
    use model::weights::WeightFormat;

    /// `tokens` random input rows of `cols` values, each padded to whole blocks, in the two
    /// forms the kernel takes: pair-ordered f32 and rounded to bf16.
    fn random_inputs(tokens: usize, cols: usize, rng: &mut SplitMix) -> (Vec<f32>, Vec<u16>) {
        let kp = crate::numerics::padded(cols);
        let values: Vec<f32> = (0..tokens * cols).map(|_| rng.symmetric()).collect();
        let mut paired = vec![0f32; tokens * kp];
        let mut rounded = vec![0u16; tokens * kp];
        for t in 0..tokens {
            let row = &values[t * cols..(t + 1) * cols];
            pair_order(row, &mut paired[t * kp..(t + 1) * kp]);
            for (d, &v) in rounded[t * kp..].iter_mut().zip(row) {
                *d = model::kernels::round_bf16(v);
            }
        }
        (paired, rounded)
    }

    /// Encodes `m` (all rows, all columns) as one tile in `format`.
    fn tile_bytes(m: &model::WeightMatrix, format: TileFormat) -> Vec<u8> {
        let (rows, cols) = (m.rows(), m.cols());
        let mut bytes = vec![0u8; rows * format.row_bytes(cols)];
        let span = Span::new(0, cols);
        pack_rows(
            format,
            rows,
            cols,
            |r, d, s| encode_row(m, r, span, format, 0, cols, d, s),
            &mut bytes,
        );
        bytes
    }

    /// `unpack_row` gives back every row a tile was packed from, in every format, whatever
    /// the rows (row groups, pairs, a lone last row) and columns (a partial last block).
    #[test]
    fn unpacking_a_tile_gives_back_its_rows() {
        let mut rng = SplitMix::new(17, 0);
        for format in [
            TileFormat::F32,
            TileFormat::F16,
            TileFormat::Bf16,
            TileFormat::Mxfp4,
            TileFormat::Mxint8,
        ] {
            for (rows, cols) in [(1, 32), (2, 64), (7, 96), (9, 40), (16, 33), (19, 160)] {
                let (db, sb) = (format.data_bytes(cols), format.scale_bytes(cols));
                let original: Vec<(Vec<u8>, Vec<u8>)> = (0..rows)
                    .map(|_| {
                        let byte = |rng: &mut SplitMix| (rng.next_u64() >> 56) as u8;
                        (
                            (0..db).map(|_| byte(&mut rng)).collect(),
                            (0..sb).map(|_| byte(&mut rng)).collect(),
                        )
                    })
                    .collect();
                let (mut data, mut scales) = (vec![0u8; rows * db], vec![0u8; rows * sb]);
                pack_tile(
                    format,
                    rows,
                    cols,
                    |r, d, s| {
                        d.copy_from_slice(&original[r].0);
                        s.copy_from_slice(&original[r].1);
                    },
                    &mut data,
                    &mut scales,
                );
                for (r, want) in original.iter().enumerate() {
                    let got = unpack_row(format, rows, cols, r, &data, &scales);
                    assert_eq!(&got, want, "{format:?} {rows}x{cols} row {r}");
                }
            }
        }
    }

    #[test]
    fn unit_inputs_read_back_the_exact_dequantized_weights_on_both_paths() {
        let cases = [
            (WeightFormat::Mxfp4, TileFormat::Mxfp4, 64),
            (WeightFormat::Bf16, TileFormat::Bf16, 70),
            (WeightFormat::F16, TileFormat::F16, 45),
            (WeightFormat::F32, TileFormat::F32, 33),
            (WeightFormat::Bf16, TileFormat::Mxint8, 96),
            (WeightFormat::F32, TileFormat::Mxfp4, 40),
        ];
        // 15 rows: a whole group and one of 7, whose last row has no pair in MXFP4 tiles.
        let rows = 15;
        for (stored, format, cols) in cases {
            let mut rng = SplitMix::new(1, cols as u64);
            let m = random_matrix(rows, cols, stored, 0.5, &mut rng);
            let bytes = tile_bytes(&m, format);
            let view = TileView::new(format, rows, cols, &bytes);
            let kp = crate::numerics::padded(cols);
            for k in [0, 1, cols / 2, cols - 1] {
                let mut e = vec![0f32; cols];
                e[k] = 1.0;
                let mut x = vec![0f32; kp];
                pair_order(&e, &mut x);
                for kernel in KernelChoice::ALL {
                    let mut out = vec![0f32; rows];
                    tile_partials(
                        &view,
                        TileInput::Paired(&x),
                        kp,
                        1,
                        &mut out,
                        PartialsLayout::Segments,
                        kernel,
                    );
                    for (r, got) in out.iter().enumerate() {
                        let want = card_values(&m, r, Span::new(0, cols), format)[k];
                        // +0.0 + w: a -0.0 weight reads back as +0.0, as the definition says.
                        assert_eq!(
                            *got,
                            want + 0.0,
                            "{format} from {stored:?}, row {r}, column {k}"
                        );
                        if stored == WeightFormat::Mxfp4 {
                            assert_eq!(*got, m.element(r, k) + 0.0, "MXFP4 dequantized value");
                        }
                    }
                }
            }
        }
    }

    /// Tokens taken together, in pairs of whole row groups or in the shared grid, give each
    /// token the partials it gets alone, to the bit, with bf16 and with f32 inputs.
    #[test]
    fn tokens_together_give_each_token_the_bits_it_gets_alone() {
        // The pairs of 8 x 2 blocks (bf16 inputs; all counts on bf16 tiles, 2 on MXFP4), an odd
        // token left alone, and the shared grid for the rest, up to a prompt chunk's worth.
        for (stored, format) in [
            (WeightFormat::Bf16, TileFormat::Bf16),
            (WeightFormat::Mxfp4, TileFormat::Mxfp4),
            (WeightFormat::F32, TileFormat::F32),
        ] {
            for (rows, cols) in [(21, 2080), (8, 64), (3, 32)] {
                for tokens in [2, 3, 4, 5, 33, 70] {
                    let mut rng = SplitMix::new(5, (rows * cols * tokens) as u64);
                    let m = random_matrix(rows, cols, stored, 1.0, &mut rng);
                    let bytes = tile_bytes(&m, format);
                    let view = TileView::new(format, rows, cols, &bytes);
                    let kp = crate::numerics::padded(cols);
                    let (paired, rounded) = random_inputs(tokens, cols, &mut rng);
                    // bf16 inputs meet bf16 and MXFP4 tiles only.
                    let inputs = if format == TileFormat::F32 {
                        vec![TileInput::Paired(&paired)]
                    } else {
                        vec![TileInput::Paired(&paired), TileInput::Bf16(&rounded)]
                    };
                    for input in inputs {
                        let n = rows * view.segments();
                        let mut together = vec![0f32; tokens * n];
                        tile_partials(
                            &view,
                            input,
                            kp,
                            tokens,
                            &mut together,
                            PartialsLayout::Segments,
                            KernelChoice::Auto,
                        );
                        for t in 0..tokens {
                            let mut alone = vec![0f32; n];
                            tile_partials(
                                &view,
                                input.skip(t * kp),
                                kp,
                                1,
                                &mut alone,
                                PartialsLayout::Segments,
                                KernelChoice::Auto,
                            );
                            let bits =
                                |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                            assert_eq!(
                                bits(&together[t * n..(t + 1) * n]),
                                bits(&alone),
                                "{format}: {rows}x{cols}, token {t} of {tokens}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn both_paths_agree_on_random_tiles_and_token_counts() {
        for (stored, format) in [
            (WeightFormat::Bf16, TileFormat::Bf16),
            (WeightFormat::Mxfp4, TileFormat::Mxfp4),
            (WeightFormat::Bf16, TileFormat::Mxint8),
            (WeightFormat::F32, TileFormat::F32),
            (WeightFormat::F16, TileFormat::F16),
        ] {
            for (rows, cols, tokens) in [
                (1, 32, 1),
                (13, 1120, 5),
                (8, 544, 1),
                (21, 2080, 9),
                (21, 2080, 2),
                (6, 96, 2),
            ] {
                let mut rng = SplitMix::new(7, (rows * cols + tokens) as u64);
                let m = random_matrix(rows, cols, stored, 1.0, &mut rng);
                let bytes = tile_bytes(&m, format);
                let view = TileView::new(format, rows, cols, &bytes);
                let kp = crate::numerics::padded(cols);
                let mut x = vec![0f32; tokens * kp];
                for t in 0..tokens {
                    let row: Vec<f32> = (0..cols).map(|_| rng.symmetric()).collect();
                    pair_order(&row, &mut x[t * kp..(t + 1) * kp]);
                }
                let n = tokens * rows * view.segments();
                let (mut a, mut b) = (vec![0f32; n], vec![0f32; n]);
                tile_partials(
                    &view,
                    TileInput::Paired(&x),
                    kp,
                    tokens,
                    &mut a,
                    PartialsLayout::Segments,
                    KernelChoice::Auto,
                );
                tile_partials(
                    &view,
                    TileInput::Paired(&x),
                    kp,
                    tokens,
                    &mut b,
                    PartialsLayout::Segments,
                    KernelChoice::Portable,
                );
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&a),
                    bits(&b),
                    "{format}: {rows}x{cols}, {tokens} tokens"
                );
            }
        }
    }

    /// A folded tile's sums are its segments added up in segment order, to the bit, on both
    /// paths, with bf16 and f32 inputs, alone and with tokens taken together.
    #[test]
    fn folded_partials_add_the_segments_in_order() {
        for (stored, format) in [
            (WeightFormat::Bf16, TileFormat::Bf16),
            (WeightFormat::Mxfp4, TileFormat::Mxfp4),
            (WeightFormat::F32, TileFormat::F32),
        ] {
            // 1 to 5 segments of 512 columns, whole row groups and a group of 5.
            for (rows, cols, tokens) in [(13, 2080, 1), (21, 1120, 2), (8, 512, 3), (16, 1600, 5)] {
                let mut rng = SplitMix::new(11, (rows * cols + tokens) as u64);
                let m = random_matrix(rows, cols, stored, 1.0, &mut rng);
                let bytes = tile_bytes(&m, format);
                let view = TileView::new(format, rows, cols, &bytes);
                let (kp, ns) = (crate::numerics::padded(cols), view.segments());
                let (paired, rounded) = random_inputs(tokens, cols, &mut rng);
                let mut inputs = vec![TileInput::Paired(&paired)];
                if format != TileFormat::F32 {
                    inputs.push(TileInput::Bf16(&rounded));
                }
                for input in inputs {
                    for kernel in KernelChoice::ALL {
                        let mut segs = vec![0f32; tokens * rows * ns];
                        let layout = PartialsLayout::Segments;
                        tile_partials(&view, input, kp, tokens, &mut segs, layout, kernel);
                        let mut folded = vec![f32::NAN; tokens * rows];
                        let layout = PartialsLayout::Folded;
                        tile_partials(&view, input, kp, tokens, &mut folded, layout, kernel);
                        let want: Vec<u32> = segs
                            .chunks_exact(ns)
                            .map(|s| s[1..].iter().fold(s[0], |v, q| v + q).to_bits())
                            .collect();
                        let got: Vec<u32> = folded.iter().map(|f| f.to_bits()).collect();
                        assert_eq!(got, want, "{format}: {rows}x{cols}, {tokens} tokens");
                    }
                }
            }
        }
    }
}
