//! The tile kernel: segment partials of one weight tile against a block of tokens, straight
//! from the tile's storage bytes (weights are decoded inside the loop, never expanded).
//!
//! Inputs are "pair-ordered": within each 32-element block, the 16 even elements then the 16
//! odd ones ([`pair_order`]), so lane `l` meets element `2l` then `2l + 1`, as the numerics
//! definition says. Both paths (portable, AVX-512) compute the same bits: the same decoded
//! weights, fused multiply-adds in the same order, the same lane tree.
//!
//! Tile storage ([`pack_rows`]): rows come in groups of [`ROW_GROUP`]; inside a group the
//! blocks are interleaved (block 0 of every row of the group, then block 1, ...), for the data
//! and for the scales alike, so a kernel running a group of rows reads one sequential stream.
//! Each row's block is laid out as [`crate::format`] describes.

use crate::format::TileFormat;
use crate::numerics::{BLOCK, BLOCKS_PER_SEGMENT, LANES, fold_lanes};

/// Which implementation runs the tiles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KernelChoice {
    /// The widest this CPU supports.
    #[default]
    Auto,
    /// Plain Rust (same bits, slower).
    Portable,
}

/// Rows per group in tile storage.
pub const ROW_GROUP: usize = 8;

/// Data bytes of one 32-element block of one row.
pub fn block_bytes(format: TileFormat) -> usize {
    format.data_bytes(BLOCK)
}

/// Where block `b` of row `r` of a tile of `rows` rows and `blocks` blocks is stored:
/// (data offset, data stride between blocks, scale offset, scale stride).
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
    (
        g * blocks * bb + b * size * bb + (r - g) * bb,
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
    mut row: impl FnMut(usize, &mut [u8], &mut [u8]),
    out: &mut [u8],
) {
    let (db, sb) = (format.data_bytes(cols), format.scale_bytes(cols));
    let blocks = cols.div_ceil(BLOCK);
    let bb = block_bytes(format);
    let (mut data, mut scales) = (vec![0u8; db], vec![0u8; sb]);
    let (out_data, out_scales) = out.split_at_mut(rows * db);
    for r in 0..rows {
        row(r, &mut data, &mut scales);
        for b in 0..blocks {
            let (d, _, s, _) = block_place(format, rows, blocks, r, b);
            out_data[d..d + bb].copy_from_slice(&data[b * bb..(b + 1) * bb]);
            if sb > 0 {
                out_scales[s] = scales[b];
            }
        }
    }
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
    /// A view over the tile bytes `bytes` (data then scales).
    pub fn new(format: TileFormat, rows: usize, cols: usize, bytes: &'a [u8]) -> Self {
        let (data, scales) = bytes.split_at(rows * format.data_bytes(cols));
        TileView {
            format,
            rows,
            cols,
            data,
            scales: &scales[..rows * format.scale_bytes(cols)],
        }
    }

    /// Blocks per row.
    pub fn blocks(&self) -> usize {
        self.cols.div_ceil(BLOCK)
    }

    /// Segments per row.
    pub fn segments(&self) -> usize {
        self.blocks().div_ceil(BLOCKS_PER_SEGMENT)
    }

    /// Decoded (even, odd) values of block `b` of row `r`.
    #[inline(always)]
    pub fn block(&self, r: usize, b: usize) -> ([f32; LANES], [f32; LANES]) {
        let (d, _, s, _) = block_place(self.format, self.rows, self.blocks(), r, b);
        let row = &self.data[d..d + block_bytes(self.format)];
        let scale = || model::mxfp4::SCALE_LUT[self.scales[s] as usize];
        match self.format {
            TileFormat::F32 => {
                let f = |i: usize| {
                    f32::from_le_bytes(row[4 * i..4 * i + 4].try_into().unwrap_or([0; 4]))
                };
                (
                    std::array::from_fn(f),
                    std::array::from_fn(|i| f(i + LANES)),
                )
            }
            TileFormat::Bf16 => {
                let f = |i: usize| {
                    f32::from_bits((u16::from_le_bytes([row[2 * i], row[2 * i + 1]]) as u32) << 16)
                };
                (
                    std::array::from_fn(|l| f(2 * l)),
                    std::array::from_fn(|l| f(2 * l + 1)),
                )
            }
            TileFormat::F16 => {
                let f = |i: usize| half::f16::from_le_bytes([row[2 * i], row[2 * i + 1]]).to_f32();
                (
                    std::array::from_fn(|l| f(2 * l)),
                    std::array::from_fn(|l| f(2 * l + 1)),
                )
            }
            TileFormat::Mxfp4 => {
                let s = scale();
                let bytes = &row[..16];
                let fp4 = &model::mxfp4::FP4_VALUES;
                (
                    std::array::from_fn(|l| fp4[(bytes[l] & 0x0f) as usize] * s),
                    std::array::from_fn(|l| fp4[(bytes[l] >> 4) as usize] * s),
                )
            }
            TileFormat::Mxint8 => {
                let s = scale();
                let bytes = &row[..BLOCK];
                (
                    std::array::from_fn(|l| bytes[l] as i8 as f32 * s),
                    std::array::from_fn(|l| bytes[l + LANES] as i8 as f32 * s),
                )
            }
        }
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

/// Segment partials of `tile` for `tokens` pair-ordered input rows: row `t` of the input starts
/// at `x[t * x_stride]` (at the tile's first column). `out[t * rows * segs + r * segs + s]`.
pub fn tile_partials(
    tile: &TileView<'_>,
    x: &[f32],
    x_stride: usize,
    tokens: usize,
    out: &mut [f32],
    kernel: KernelChoice,
) {
    debug_assert!(out.len() >= tokens * tile.rows * tile.segments());
    #[cfg(target_arch = "x86_64")]
    if kernel == KernelChoice::Auto && super::avx512::available() {
        // SAFETY: the CPU features were just detected; sizes are checked by the caller and
        // re-checked (debug) above.
        return unsafe { super::avx512::tile_partials(tile, x, x_stride, tokens, out) };
    }
    let _ = kernel;
    portable(tile, x, x_stride, tokens, out)
}

fn portable(tile: &TileView<'_>, x: &[f32], x_stride: usize, tokens: usize, out: &mut [f32]) {
    let (nb, ns) = (tile.blocks(), tile.segments());
    for r in 0..tile.rows {
        for s in 0..ns {
            let blocks = s * BLOCKS_PER_SEGMENT..((s + 1) * BLOCKS_PER_SEGMENT).min(nb);
            for t in 0..tokens {
                let xt = &x[t * x_stride..];
                let mut acc = [0f32; LANES];
                for b in blocks.clone() {
                    let (wa, wb) = tile.block(r, b);
                    let xb = &xt[b * BLOCK..(b + 1) * BLOCK];
                    for l in 0..LANES {
                        acc[l] = wa[l].mul_add(xb[l], acc[l]);
                    }
                    for l in 0..LANES {
                        acc[l] = wb[l].mul_add(xb[LANES + l], acc[l]);
                    }
                }
                out[t * tile.rows * ns + r * ns + s] = fold_lanes(acc);
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
        for (stored, format, cols) in cases {
            let mut rng = SplitMix::new(1, cols as u64);
            let m = random_matrix(9, cols, stored, 0.5, &mut rng);
            let bytes = tile_bytes(&m, format);
            let view = TileView::new(format, 9, cols, &bytes);
            let kp = crate::numerics::padded(cols);
            for k in [0, 1, cols / 2, cols - 1] {
                let mut e = vec![0f32; cols];
                e[k] = 1.0;
                let mut x = vec![0f32; kp];
                pair_order(&e, &mut x);
                for kernel in [KernelChoice::Auto, KernelChoice::Portable] {
                    let mut out = vec![0f32; 9];
                    tile_partials(&view, &x, kp, 1, &mut out, kernel);
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

    #[test]
    fn both_paths_agree_on_random_tiles_and_token_counts() {
        for (stored, format) in [
            (WeightFormat::Bf16, TileFormat::Bf16),
            (WeightFormat::Mxfp4, TileFormat::Mxfp4),
            (WeightFormat::Bf16, TileFormat::Mxint8),
            (WeightFormat::F32, TileFormat::F32),
            (WeightFormat::F16, TileFormat::F16),
        ] {
            for (rows, cols, tokens) in [(1, 32, 1), (13, 1120, 5), (8, 544, 1), (21, 2080, 9)] {
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
                tile_partials(&view, &x, kp, tokens, &mut a, KernelChoice::Auto);
                tile_partials(&view, &x, kp, tokens, &mut b, KernelChoice::Portable);
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&a),
                    bits(&b),
                    "{format}: {rows}x{cols}, {tokens} tokens"
                );
            }
        }
    }
}
