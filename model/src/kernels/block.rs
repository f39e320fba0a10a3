//! Block formats, how a block's values reach the lanes, and the rows a kernel reads.

use super::{BLOCK, LANES};
use crate::mxfp4;
use crate::weights::WeightFormat;

/// How a 32-element block of weights is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockFormat {
    /// 32-bit floats.
    F32,
    /// bfloat16.
    Bf16,
    /// IEEE half.
    F16,
    /// MXFP4: 16 bytes of FP4 nibble pairs (element `2j` in the low nibble of byte `j`) and one
    /// E8M0 scale byte.
    Mxfp4,
    /// MXINT8: 32 int8 values and one E8M0 scale byte.
    Mxint8,
    /// MXFP4 with two rows' blocks stored together ([`BlockRows`] of this format read rows in
    /// pairs): 32 bytes for the pair, byte `k` holding element `k` of the first row in its low
    /// nibble and of the second row in its high nibble; each row has its own scale byte. The
    /// same values as [`BlockFormat::Mxfp4`], but one widening of the pair's bytes gives each
    /// row's nibbles in element order, so a block decodes in fewer instructions.
    Mxfp4RowPairs,
}

impl BlockFormat {
    /// The block format of a checkpoint's stored format.
    pub const fn of(format: WeightFormat) -> Self {
        match format {
            WeightFormat::F32 => BlockFormat::F32,
            WeightFormat::Bf16 => BlockFormat::Bf16,
            WeightFormat::F16 => BlockFormat::F16,
            WeightFormat::Mxfp4 => BlockFormat::Mxfp4,
        }
    }

    /// Data bytes of one block.
    pub const fn block_bytes(self) -> usize {
        match self {
            BlockFormat::F32 => BLOCK * 4,
            BlockFormat::Bf16 | BlockFormat::F16 => BLOCK * 2,
            BlockFormat::Mxfp4 | BlockFormat::Mxfp4RowPairs => BLOCK / 2,
            BlockFormat::Mxint8 => BLOCK,
        }
    }

    /// Whether each block has a scale byte.
    pub const fn has_scales(self) -> bool {
        matches!(
            self,
            BlockFormat::Mxfp4 | BlockFormat::Mxint8 | BlockFormat::Mxfp4RowPairs
        )
    }

    /// Bytes one block of a pair of rows takes ([`BlockFormat::Mxfp4RowPairs`]), or of a row.
    pub const fn unit_bytes(self) -> usize {
        match self {
            BlockFormat::Mxfp4RowPairs => BLOCK,
            _ => self.block_bytes(),
        }
    }
}

/// How the 32 stored values of a block fill the two 16-lane vectors a kernel adds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lanes {
    /// Stored values `0..16`, then `16..32`.
    Halves,
    /// Stored even values, then odd ones.
    Pairs,
}

/// Value `i` of stored bytes `data` in `format` (`scale`: the E8M0 scale byte of the value's
/// block, ignored by dense formats). Exact in f32; MX values are `value * 2^(scale - 127)` as
/// one f32 multiply.
#[inline(always)]
pub fn decode_value(format: BlockFormat, data: &[u8], i: usize, scale: u8) -> f32 {
    match format {
        BlockFormat::F32 => f32::from_le_bytes([
            data[4 * i],
            data[4 * i + 1],
            data[4 * i + 2],
            data[4 * i + 3],
        ]),
        BlockFormat::Bf16 => {
            f32::from_bits((u16::from_le_bytes([data[2 * i], data[2 * i + 1]]) as u32) << 16)
        }
        BlockFormat::F16 => half::f16::from_le_bytes([data[2 * i], data[2 * i + 1]]).to_f32(),
        BlockFormat::Mxfp4 => {
            let b = data[i / 2];
            let nibble = if i.is_multiple_of(2) {
                b & 0x0f
            } else {
                b >> 4
            };
            mxfp4::FP4_VALUES[nibble as usize] * mxfp4::SCALE_LUT[scale as usize]
        }
        // One row's nibbles taken out of a pair block ([`BlockRows::block`] does that).
        BlockFormat::Mxfp4RowPairs => unreachable!("decode a row of a pair as MXFP4"),
        BlockFormat::Mxint8 => data[i] as i8 as f32 * mxfp4::SCALE_LUT[scale as usize],
    }
}

/// Decodes one block (`data`: its bytes, `scale`: its scale byte, ignored by dense formats)
/// into the two lane vectors `lanes` says, value by value as [`decode_value`].
#[inline(always)]
pub fn decode_block(
    format: BlockFormat,
    lanes: Lanes,
    data: &[u8],
    scale: u8,
) -> ([f32; LANES], [f32; LANES]) {
    let value = |i: usize| decode_value(format, data, i, scale);
    match lanes {
        Lanes::Halves => (
            std::array::from_fn(value),
            std::array::from_fn(|l| value(LANES + l)),
        ),
        Lanes::Pairs => (
            std::array::from_fn(|l| value(2 * l)),
            std::array::from_fn(|l| value(2 * l + 1)),
        ),
    }
}

/// Row `r` of [`BlockFormat::Mxfp4RowPairs`] rows whose row 0 is at `pair_offset` (0 or 1) in
/// its pair: which pair it is in, counted from row 0's, and whether it is that pair's second.
#[inline(always)]
pub(super) const fn pair_place(r: usize, pair_offset: usize) -> (usize, bool) {
    let q = r + pair_offset;
    (q / 2, q % 2 == 1)
}

/// Where the blocks of a set of rows lie: `row` bytes from one row's block to the next row's
/// same block, `block` bytes from one block of a row to its next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Strides {
    /// Bytes between rows.
    pub row: usize,
    /// Bytes between consecutive blocks of a row.
    pub block: usize,
}

/// `R` weight rows as a kernel reads them: block `b` of row `r` starts at byte
/// `r * data_strides.row + b * data_strides.block` of `data`, and for MX formats its scale is
/// byte `r * scale_strides.row + b * scale_strides.block` of `scales`. One base and two
/// strides (rather than a pointer per row) keep the kernel's loop to one moving address.
///
/// [`BlockFormat::Mxfp4RowPairs`] rows are read a pair at a time: row `r`'s block is in the
/// pair block at `(q / 2) * data_strides.row + b * data_strides.block`, in its low nibbles
/// when `q = r + pair_offset` is even, its high ones when odd ([`Self::from_second_of_pair`]).
#[derive(Debug, Clone, Copy)]
pub struct BlockRows<'a, const R: usize> {
    pub(super) format: BlockFormat,
    pub(super) data: &'a [u8],
    pub(super) data_strides: Strides,
    pub(super) scales: &'a [u8],
    pub(super) scale_strides: Strides,
    /// Bytes ahead of the block being read that the vector paths ask the cache for (0: none;
    /// only for the layouts of [`Self::prefetch_steps`]).
    pub(super) prefetch: usize,
    /// 1 when row 0 is the second row of its pair ([`BlockFormat::Mxfp4RowPairs`]), else 0.
    pub(super) pair_offset: usize,
    /// A bound known in advance on bf16 rows' smallest nonzero magnitude
    /// ([`Self::with_smallest_weight_exponent`]); `None`: not known.
    pub(super) smallest_weight_exponent: Option<Option<u32>>,
}

impl<'a, const R: usize> BlockRows<'a, R> {
    /// Rows of `format` laid out as the type says (scales are ignored by dense formats: pass
    /// an empty slice).
    pub fn new(
        format: BlockFormat,
        data: &'a [u8],
        data_strides: Strides,
        scales: &'a [u8],
        scale_strides: Strides,
    ) -> Self {
        BlockRows {
            format,
            data,
            data_strides,
            scales,
            scale_strides,
            prefetch: 0,
            pair_offset: 0,
            smallest_weight_exponent: None,
        }
    }

    /// The same rows starting from the second row of a pair ([`BlockFormat::Mxfp4RowPairs`]:
    /// `data` starts at that pair's block, row 0 is in its high nibbles).
    pub fn from_second_of_pair(mut self) -> Self {
        self.pair_offset = 1;
        self
    }

    /// The same rows, with the vector paths fetching `bytes` ahead of each block it reads
    /// (streams from memory that the hardware prefetcher does not run far enough ahead of),
    /// when the rows' blocks lie side by side (the card's row groups) or the rows one after
    /// another (a row-major matrix); other layouts leave it to the hardware.
    pub fn with_prefetch(mut self, bytes: usize) -> Self {
        self.prefetch = bytes;
        self
    }

    /// The same bf16 rows, known to hold no nonzero magnitude whose biased exponent is below
    /// `exponent` (`None`: all zero); a bound below the true one is safe. The AVX2 path's
    /// row-major rows, which take their plain fused multiply-adds only where no product can
    /// leave the normal range, then check the bound once a segment instead of watching every
    /// block's weights; the other paths ignore it and watch
    /// ([`crate::weights::WeightMatrix::smallest_exponent`] gives a matrix's).
    pub fn with_smallest_weight_exponent(mut self, exponent: Option<u32>) -> Self {
        self.smallest_weight_exponent = Some(exponent);
        self
    }

    /// The rows' format.
    pub fn format(&self) -> BlockFormat {
        self.format
    }

    /// Where one run of cache lines covers block `b` of every row, the bytes from block `b`'s
    /// run to block `b + 1`'s, in the data and in the scales: rows whose blocks lie side by side
    /// (row `r`'s block `b` right after row `r - 1`'s: the card's row groups) step by the block
    /// stride; consecutive rows stored one after another (a row-major matrix) are one stream
    /// that the register block walks `R` blocks at a time (`blocks`: the whole blocks of a
    /// row). `None` for other layouts.
    pub(super) fn prefetch_steps(&self, blocks: usize) -> Option<(usize, usize)> {
        let (bb, unit) = (self.format.block_bytes(), self.format.unit_bytes());
        let (data, scales) = (self.data_strides, self.scale_strides);
        if data.row == unit && data.block >= R * bb {
            Some((data.block, scales.block))
        } else if unit == bb && data.block == bb && data.row <= (blocks + 1) * bb {
            Some((R * bb, R))
        } else {
            None
        }
    }

    /// Whether a kernel over `T` inputs walks these rows one after another, each front to
    /// back, instead of a block of every row at a time: for one input over rows whose blocks
    /// lie one after another (a row-major matrix), so the rows are read as one stream, which
    /// the hardware prefetcher follows at full speed; a block of every row at a time reads `R`
    /// short streams side by side: on a 2-core AMD EPYC (Zen 4) VM the reference forward of a
    /// medium Mixtral decoded 60-73 tok/s at batch 1 that way, 77-96 with one row a kernel call
    /// and 91-112 with eight rows a call rows first (`bench_reference`, the builds alternated).
    /// Each row's sums are the same bits either way (its blocks are added in the same order);
    /// only the order in which rows take their turns changes. The AVX2 bf16 path's row-major
    /// products read in chunks with a prefetch of their own instead (`avx2_bf16_rows`), which
    /// on a Zen 3 VM took a quarter less time than one stream.
    #[inline(always)]
    pub(super) fn rows_first<const T: usize>(&self) -> bool {
        T == 1 && R > 1 && self.data_strides.block == self.format.block_bytes()
    }

    /// The `N` rows from row `r0` on, with the same strides (the rows must exist).
    pub(super) fn rows_from<const N: usize>(&self, r0: usize) -> BlockRows<'a, N> {
        let (unit, pair_offset) = if self.format == BlockFormat::Mxfp4RowPairs {
            let (pair, second) = pair_place(r0, self.pair_offset);
            (pair, usize::from(second))
        } else {
            (r0, 0)
        };
        let data = (unit * self.data_strides.row).min(self.data.len());
        let scales = (r0 * self.scale_strides.row).min(self.scales.len());
        BlockRows {
            format: self.format,
            data: &self.data[data..],
            data_strides: self.data_strides,
            scales: &self.scales[scales..],
            scale_strides: self.scale_strides,
            prefetch: self.prefetch,
            pair_offset,
            smallest_weight_exponent: self.smallest_weight_exponent,
        }
    }

    /// Checks that every row holds blocks `0..end` (and the first half of block `end`).
    pub(super) fn check(&self, end: usize, half: bool) {
        let (bb, unit) = (self.format.block_bytes(), self.format.unit_bytes());
        let last_row = self.data_at(R - 1, 0);
        let data_need = match (end, half) {
            (_, true) => last_row + end * self.data_strides.block + bb / 2,
            (0, false) => 0,
            (_, false) => last_row + (end - 1) * self.data_strides.block + unit,
        };
        assert!(self.data.len() >= data_need, "kernel weight rows too short");
        if self.format.has_scales() && end > 0 {
            let need = (R - 1) * self.scale_strides.row + (end - 1) * self.scale_strides.block + 1;
            assert!(self.scales.len() >= need, "kernel scale rows too short");
        }
    }

    /// Byte offset of block `b` of row `r` in `data`.
    #[inline(always)]
    pub(super) fn data_at(&self, r: usize, b: usize) -> usize {
        let unit = if self.format == BlockFormat::Mxfp4RowPairs {
            pair_place(r, self.pair_offset).0
        } else {
            r
        };
        unit * self.data_strides.row + b * self.data_strides.block
    }

    /// Whether row `r` is the second of its pair ([`BlockFormat::Mxfp4RowPairs`]).
    #[inline(always)]
    pub(super) fn second_of_pair(&self, r: usize) -> bool {
        pair_place(r, self.pair_offset).1
    }

    /// Byte offset of the scale of block `b` of row `r` in `scales`.
    #[inline(always)]
    pub(super) fn scale_at(&self, r: usize, b: usize) -> usize {
        r * self.scale_strides.row + b * self.scale_strides.block
    }

    /// Decoded lane vectors of block `b` of row `r` (portable path).
    #[inline(always)]
    pub(super) fn block(&self, r: usize, b: usize, lanes: Lanes) -> ([f32; LANES], [f32; LANES]) {
        let (bb, at) = (self.format.block_bytes(), self.data_at(r, b));
        let scale = if self.format.has_scales() {
            self.scales[self.scale_at(r, b)]
        } else {
            0
        };
        if self.format == BlockFormat::Mxfp4RowPairs {
            // The row's 32 nibbles, packed as an MXFP4 block.
            let (pair, shift) = (
                &self.data[at..at + BLOCK],
                4 * u8::from(self.second_of_pair(r)),
            );
            let nibble = |k: usize| (pair[k] >> shift) & 0x0f;
            let row: [u8; BLOCK / 2] =
                std::array::from_fn(|j| nibble(2 * j) | nibble(2 * j + 1) << 4);
            return decode_block(BlockFormat::Mxfp4, lanes, &row, scale);
        }
        decode_block(self.format, lanes, &self.data[at..at + bb], scale)
    }

    /// The first 16 values of block `b` of row `r`, a dense format (portable path).
    #[inline(always)]
    pub(super) fn half_block(&self, r: usize, b: usize) -> [f32; LANES] {
        let (bb, at) = (self.format.block_bytes(), self.data_at(r, b));
        let mut padded = [0u8; BLOCK * 4];
        padded[..bb / 2].copy_from_slice(&self.data[at..at + bb / 2]);
        decode_block(self.format, Lanes::Halves, &padded[..bb], 0).0
    }
}
