//! Weight formats on the card: the user's choice ([`FormatChoice`]), the storage format of a
//! tile ([`TileFormat`]), quantizers, the exact values the card computes with ([`card_values`],
//! used by the software model) and the tile storage encoding ([`encode_row`], used when binding).
//!
//! Storage layout of one row of a tile (all little-endian, the row zero-padded to whole blocks):
//! - `F32`, `Mxint8`: per 32-element block, the 16 even elements then the 16 odd ones;
//! - `Bf16`, `F16`: natural order (a 32-bit word holds an (even, odd) pair already);
//! - `Mxfp4`: the Hugging Face packing (byte `j` of a block: element `2j` low nibble, `2j+1` high);
//! - scales (`Mxfp4`, `Mxint8`): one E8M0 byte per block, stored after all rows' data.

use model::WeightMatrix;
use model::mxfp4;
use model::weights::WeightFormat;
use serde::{Deserialize, Serialize};

use crate::assignment::Span;
use crate::numerics::{BLOCK, padded};

/// The weight format asked for on the command line or in a deployment file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum FormatChoice {
    /// Whatever the checkpoint stores (MXFP4 experts stay MXFP4, bf16 stays bf16).
    #[default]
    AsStored,
    /// bfloat16.
    Bf16,
    /// MXFP4: 32 FP4 values and one power-of-two scale per block (4.25 bits per weight).
    Mxfp4,
    /// MXINT8: 32 int8 values and one power-of-two scale per block (8.25 bits per weight).
    Mxint8,
}

impl std::str::FromStr for FormatChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "as-stored" | "as_stored" | "stored" => Ok(FormatChoice::AsStored),
            "bf16" => Ok(FormatChoice::Bf16),
            "mxfp4" => Ok(FormatChoice::Mxfp4),
            "mxint8" => Ok(FormatChoice::Mxint8),
            other => Err(format!(
                "unknown weight format `{other}`: expected as-stored, bf16, mxfp4 or mxint8"
            )),
        }
    }
}

impl std::fmt::Display for FormatChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FormatChoice::AsStored => "as-stored",
            FormatChoice::Bf16 => "bf16",
            FormatChoice::Mxfp4 => "mxfp4",
            FormatChoice::Mxint8 => "mxint8",
        })
    }
}

/// How a tile's weights are stored on the card.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TileFormat {
    /// 32-bit float.
    F32,
    /// bfloat16.
    Bf16,
    /// IEEE half.
    F16,
    /// MXFP4 blocks with E8M0 scales.
    Mxfp4,
    /// MXINT8 blocks with E8M0 scales.
    Mxint8,
}

impl std::fmt::Display for TileFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TileFormat::F32 => "f32",
            TileFormat::Bf16 => "bf16",
            TileFormat::F16 => "f16",
            TileFormat::Mxfp4 => "mxfp4",
            TileFormat::Mxint8 => "mxint8",
        })
    }
}

impl TileFormat {
    /// The tile format of a stored checkpoint format.
    pub fn from_stored(f: WeightFormat) -> Self {
        match f {
            WeightFormat::F32 => TileFormat::F32,
            WeightFormat::Bf16 => TileFormat::Bf16,
            WeightFormat::F16 => TileFormat::F16,
            WeightFormat::Mxfp4 => TileFormat::Mxfp4,
        }
    }

    /// The card format for `choice` when the checkpoint stores `stored`.
    pub fn resolve(choice: FormatChoice, stored: TileFormat) -> Self {
        match choice {
            FormatChoice::AsStored => stored,
            FormatChoice::Bf16 => TileFormat::Bf16,
            FormatChoice::Mxfp4 => TileFormat::Mxfp4,
            FormatChoice::Mxint8 => TileFormat::Mxint8,
        }
    }

    /// The shared kernels' block format of this tile format.
    pub fn block_format(self) -> model::kernels::BlockFormat {
        use model::kernels::BlockFormat;
        match self {
            TileFormat::F32 => BlockFormat::F32,
            TileFormat::Bf16 => BlockFormat::Bf16,
            TileFormat::F16 => BlockFormat::F16,
            TileFormat::Mxfp4 => BlockFormat::Mxfp4,
            TileFormat::Mxint8 => BlockFormat::Mxint8,
        }
    }

    /// Whether values come in scaled blocks of 32.
    pub fn has_scales(self) -> bool {
        matches!(self, TileFormat::Mxfp4 | TileFormat::Mxint8)
    }

    /// Data bytes of a row of `k` elements (padded to whole blocks).
    pub fn data_bytes(self, k: usize) -> usize {
        let kp = padded(k);
        match self {
            TileFormat::F32 => kp * 4,
            TileFormat::Bf16 | TileFormat::F16 => kp * 2,
            TileFormat::Mxfp4 => kp / 2,
            TileFormat::Mxint8 => kp,
        }
    }

    /// Scale bytes of a row of `k` elements.
    pub fn scale_bytes(self, k: usize) -> usize {
        if self.has_scales() {
            padded(k) / BLOCK
        } else {
            0
        }
    }

    /// Bytes of a row of `k` elements, data and scales.
    pub fn row_bytes(self, k: usize) -> usize {
        self.data_bytes(k) + self.scale_bytes(k)
    }

    /// Bits per weight (for reports).
    pub fn bits_per_weight(self) -> f64 {
        self.row_bytes(BLOCK) as f64 * 8.0 / BLOCK as f64
    }
}

/// Quantizes one block (up to 32 values; missing ones count as zero) to MXINT8: the smallest
/// power-of-two scale `2^e` with `max |v| <= 127 * 2^e`, then `q = round(v / 2^e)` (half away
/// from zero) clamped to `[-127, 127]`. Returns the E8M0 scale byte (`e + 127`).
pub fn quantize_mxint8_block(values: &[f32], q: &mut [i8; BLOCK]) -> u8 {
    let max = values.iter().fold(
        0f64,
        |m, v| if v.is_nan() { m } else { m.max(v.abs() as f64) },
    );
    let mut e: i32 = if max > 0.0 && max.is_finite() {
        ((max / 127.0).log2().ceil() as i32).clamp(-127, 127)
    } else if max.is_infinite() {
        127
    } else {
        0
    };
    if max.is_finite() && max > 0.0 {
        while e < 127 && max > 127.0 * 2f64.powi(e) {
            e += 1;
        }
        while e > -127 && max <= 127.0 * 2f64.powi(e - 1) {
            e -= 1;
        }
    }
    let inv = 2f64.powi(-e);
    for (i, out) in q.iter_mut().enumerate() {
        let v = values.get(i).copied().unwrap_or(0.0) as f64;
        *out = if v.is_nan() {
            0
        } else {
            (v * inv).round().clamp(-127.0, 127.0) as i8
        };
    }
    (e + 127) as u8
}

/// Whether columns `cols` of `src` are stored on the card byte for byte in `format` (same
/// format, and for MXFP4 the slice is made of whole blocks of the stored row).
fn copies_as_stored(src: &WeightMatrix, cols: Span, format: TileFormat) -> bool {
    TileFormat::from_stored(src.format()) == format
        && (format != TileFormat::Mxfp4
            || (cols.start.is_multiple_of(BLOCK)
                && (cols.end.is_multiple_of(BLOCK) || cols.end == src.cols())))
}

/// Columns `cols` of row `r` of `src`, the card's row, as the exact f32 values the card
/// computes with in `format` (natural order, `cols.len()` values): decoded when stored as is,
/// else quantized (blocks aligned to the slice, zero-padded) then dequantized. This is the
/// software model's view; the executor never builds it.
pub fn card_values(src: &WeightMatrix, r: usize, cols: Span, format: TileFormat) -> Vec<f32> {
    let mut full = vec![0f32; src.cols()];
    src.decode_row(r, mxfp4::scale_table(), &mut full);
    let mut row = full[cols.start..cols.end].to_vec();
    let k = row.len();
    if copies_as_stored(src, cols, format) {
        return row;
    }
    match format {
        TileFormat::F32 => row,
        TileFormat::Bf16 => row
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_f32())
            .collect(),
        TileFormat::F16 => row
            .iter()
            .map(|&v| half::f16::from_f32(v).to_f32())
            .collect(),
        TileFormat::Mxfp4 => {
            let kp = padded(k);
            row.resize(kp, 0.0);
            let mut blocks = vec![0u8; kp / 2];
            let mut scales = vec![0u8; kp / BLOCK];
            mxfp4::quantize_row(&row, &mut blocks, &mut scales);
            let mut out = vec![0f32; kp];
            mxfp4::decode_row(&blocks, &scales, mxfp4::scale_table(), &mut out);
            out.truncate(k);
            out
        }
        TileFormat::Mxint8 => {
            let mut out = Vec::with_capacity(k);
            for block in row.chunks(BLOCK) {
                let mut q = [0i8; BLOCK];
                let s = quantize_mxint8_block(block, &mut q);
                let scale = mxfp4::SCALE_LUT[s as usize];
                out.extend(q[..block.len()].iter().map(|&v| v as f32 * scale));
            }
            out
        }
    }
}

/// Encodes columns `[k0, k1)` (relative to the card's slice `cols`; `k0` a multiple of 32) of
/// row `r` of `src` in `format`'s tile storage layout: `data` gets
/// [`TileFormat::data_bytes`]`(k1 - k0)` bytes, `scales` one byte per block. Rows stored as is
/// are copied byte for byte; others are converted one row at a time.
#[allow(clippy::too_many_arguments)]
pub fn encode_row(
    src: &WeightMatrix,
    r: usize,
    cols: Span,
    format: TileFormat,
    k0: usize,
    k1: usize,
    data: &mut [u8],
    scales: &mut [u8],
) {
    debug_assert!(k0.is_multiple_of(BLOCK) && k1 <= cols.len() && k0 < k1);
    let n = k1 - k0;
    let kp = padded(n);
    debug_assert_eq!(data.len(), format.data_bytes(n));
    debug_assert_eq!(scales.len(), format.scale_bytes(n));
    let (a, b) = (cols.start + k0, cols.start + k1);
    if copies_as_stored(src, cols, format) && format != TileFormat::F32 {
        // bf16, f16 and MXFP4 are stored on the card exactly as in the checkpoint.
        let bytes = src.row_bytes(r);
        match format {
            TileFormat::Mxfp4 => {
                data[..(b - a).div_ceil(2)].copy_from_slice(&bytes[a / 2..b.div_ceil(2)]);
                data[(b - a).div_ceil(2)..].fill(0);
                let sc = &src.row_scales(r)[a / BLOCK..b.div_ceil(BLOCK)];
                scales.copy_from_slice(sc);
            }
            _ => {
                data[..n * 2].copy_from_slice(&bytes[a * 2..b * 2]);
                data[n * 2..].fill(0);
            }
        }
        return;
    }
    let values = card_values(src, r, cols, format);
    let mut values = values[k0..k1].to_vec();
    values.resize(kp, 0.0);
    match format {
        TileFormat::F32 => {
            for (blk, block) in values.chunks_exact(BLOCK).enumerate() {
                for (i, v) in deinterleave(block).iter().enumerate() {
                    let at = (blk * BLOCK + i) * 4;
                    data[at..at + 4].copy_from_slice(&v.to_le_bytes());
                }
            }
        }
        TileFormat::Bf16 | TileFormat::F16 => {
            for (i, &v) in values.iter().enumerate() {
                let bits = if format == TileFormat::Bf16 {
                    half::bf16::from_f32(v).to_bits()
                } else {
                    half::f16::from_f32(v).to_bits()
                };
                data[2 * i..2 * i + 2].copy_from_slice(&bits.to_le_bytes());
            }
        }
        TileFormat::Mxfp4 => {
            // The values are already MXFP4-exact; quantizing them again reproduces them.
            mxfp4::quantize_row(&values, data, scales)
        }
        TileFormat::Mxint8 => {
            for (blk, block) in values.chunks_exact(BLOCK).enumerate() {
                let mut q = [0i8; BLOCK];
                scales[blk] = quantize_mxint8_block(block, &mut q);
                let qf: [f32; BLOCK] = std::array::from_fn(|i| q[i] as f32);
                for (i, v) in deinterleave(&qf).iter().enumerate() {
                    data[blk * BLOCK + i] = (*v as i8) as u8;
                }
            }
        }
    }
}

/// `[v0, v2, ..., v30, v1, v3, ..., v31]` of one block.
fn deinterleave(block: &[f32]) -> [f32; BLOCK] {
    std::array::from_fn(|i| {
        if i < BLOCK / 2 {
            block[2 * i]
        } else {
            block[2 * (i - BLOCK / 2) + 1]
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mxint8_round_trips_small_integers_and_scales_by_powers_of_two() {
        let vals: Vec<f32> = (0..32).map(|i| (i as f32 - 16.0) * 0.25).collect();
        let mut q = [0i8; BLOCK];
        let s = quantize_mxint8_block(&vals, &mut q);
        let scale = mxfp4::SCALE_LUT[s as usize];
        for (v, q) in vals.iter().zip(q) {
            assert_eq!(q as f32 * scale, *v);
        }
        // max = 4.0: 4 <= 127 * 2^-4 holds, 4 <= 127 * 2^-5 does not, so e = -4.
        assert_eq!(s as i32 - 127, -4);
    }

    #[test]
    fn mxint8_zero_block_and_rounding() {
        let mut q = [0i8; BLOCK];
        assert_eq!(quantize_mxint8_block(&[0.0; 32], &mut q), 127);
        assert!(q.iter().all(|&v| v == 0));
        let s = quantize_mxint8_block(&[127.0, 0.5, -0.5, 1.49], &mut q);
        assert_eq!(s, 127);
        assert_eq!(&q[..4], &[127, 1, -1, 1]);
    }

    #[test]
    fn row_bytes_match_the_published_bit_widths() {
        assert_eq!(TileFormat::Mxfp4.bits_per_weight(), 4.25);
        assert_eq!(TileFormat::Mxint8.bits_per_weight(), 8.25);
        assert_eq!(TileFormat::Bf16.row_bytes(40), 128);
        assert_eq!(TileFormat::Mxfp4.row_bytes(2880), 1530);
    }

    #[test]
    fn format_choice_parses() {
        assert_eq!("mxint8".parse::<FormatChoice>(), Ok(FormatChoice::Mxint8));
        assert!("int4".parse::<FormatChoice>().is_err());
    }
}
