//! Which matrices a card's share has, and how each is cut into tiles.
//!
//! A tile is a band of rows times a run of whole reduction segments, small enough for one
//! core. By default a tile spans the whole reduction and about `compiler.tile_bytes` of
//! weights (rows in multiples of 16, the kernels' register blocks); the reduction is split only
//! when 16 rows would exceed `compiler.max_tile_bytes`. Both can be forced ([`TilingOptions`]).

use model::ModelConfig;
use model::config::FfnKind;
use serde::{Deserialize, Serialize};

use crate::assignment::{CardAssignment, LayerShare, Span};
use crate::error::{Error, Result};
use crate::format::TileFormat;
use crate::numerics::{SEGMENT, segments};
use crate::profile::HardwareProfile;
use crate::program::MatrixRole;

/// Forced tile shapes (for tests and experiments); `None` lets the compiler choose.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct TilingOptions {
    /// Output rows per tile.
    pub rows_per_tile: Option<usize>,
    /// Reduction segments (of 512) per tile.
    pub segments_per_tile: Option<usize>,
}

/// A matrix before placement.
#[derive(Debug, Clone)]
pub(crate) struct MatrixPlan {
    pub name: String,
    pub role: MatrixRole,
    pub rows: usize,
    pub cols: usize,
    pub format: TileFormat,
    pub source_format: TileFormat,
    /// (rows, segments) of each tile, row band by row band.
    pub tiles: Vec<(Span, Span)>,
    /// Bias length (f32), when the matrix has one.
    pub bias: bool,
    /// Position of the matrix within its layer (spill order).
    pub rank_in_layer: usize,
}

impl MatrixPlan {
    pub fn tile_bytes(&self, rows: Span, segs: Span) -> u64 {
        let cols = (segs.end * SEGMENT).min(self.cols) - segs.start * SEGMENT;
        (rows.len() * self.format.row_bytes(cols)) as u64
    }

    pub fn bytes(&self) -> u64 {
        self.tiles.iter().map(|&(r, s)| self.tile_bytes(r, s)).sum()
    }
}

/// Cuts a `[rows, cols]` matrix in `format` into tiles.
pub(crate) fn tile_grid(
    rows: usize,
    cols: usize,
    format: TileFormat,
    options: &TilingOptions,
    profile: &HardwareProfile,
) -> Result<Vec<(Span, Span)>> {
    let total_segs = segments(cols);
    let settings = &profile.compiler;
    let segs = match options.segments_per_tile {
        Some(s) => s.max(1),
        None => {
            let full = 16 * format.row_bytes(cols) as u64;
            if full <= settings.max_tile_bytes {
                total_segs
            } else {
                let seg_row = 16 * format.row_bytes(SEGMENT.min(cols)) as u64;
                (settings.max_tile_bytes / seg_row.max(1)).max(1) as usize
            }
        }
    }
    .min(total_segs);
    let tile_row_bytes = format.row_bytes((segs * SEGMENT).min(cols)) as u64;
    let band = match options.rows_per_tile {
        Some(r) => r.max(1),
        None => ((settings.tile_bytes / tile_row_bytes.max(1)) as usize / 16 * 16).max(16),
    }
    .min(rows.max(1));
    if band as u64 * tile_row_bytes > profile.core_bytes() {
        return Err(Error::Unsupported(format!(
            "a tile of {band} rows x {segs} segments takes {} bytes, more than one core's SRAM ({} bytes); \
             use fewer rows or segments per tile",
            band as u64 * tile_row_bytes,
            profile.core_bytes()
        )));
    }
    let mut tiles = Vec::new();
    let mut r = 0;
    while r < rows {
        let rs = Span::new(r, (r + band).min(rows));
        let mut s = 0;
        while s < total_segs {
            tiles.push((rs, Span::new(s, (s + segs).min(total_segs))));
            s += segs;
        }
        r += band;
    }
    Ok(tiles)
}

/// The storage formats of a checkpoint, as config.json describes it (weights may be compiled
/// before they are loaded).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredFormats {
    /// Expert weights.
    pub experts: TileFormat,
    /// Dense FFN weights.
    pub dense: TileFormat,
    /// The LM head.
    pub lm_head: TileFormat,
}

impl StoredFormats {
    /// Every tensor in `format`.
    pub fn uniform(format: TileFormat) -> Self {
        StoredFormats {
            experts: format,
            dense: format,
            lm_head: format,
        }
    }

    /// Reads `dtype` / `torch_dtype` of config.json (bf16 when absent), and MXFP4 experts when
    /// the config says the checkpoint is MXFP4-quantized.
    pub fn from_config_json(config_json: &str, config: &ModelConfig) -> Result<Self> {
        let value: serde_json::Value =
            serde_json::from_str(config_json).map_err(Error::ConfigJson)?;
        let dtype = value
            .get("dtype")
            .or_else(|| value.get("torch_dtype"))
            .and_then(|v| v.as_str())
            .unwrap_or("bfloat16");
        let base = match dtype {
            "bfloat16" => TileFormat::Bf16,
            "float32" => TileFormat::F32,
            "float16" => TileFormat::F16,
            other => {
                return Err(Error::Unsupported(format!(
                    "config.json dtype `{other}`: expected bfloat16, float16 or float32"
                )));
            }
        };
        let mut f = Self::uniform(base);
        if config.quantization == model::config::Quantization::Mxfp4 {
            f.experts = TileFormat::Mxfp4;
        }
        Ok(f)
    }
}

/// Every matrix of the card's FFN share (experts and dense slices), in layer order, with the
/// format it is compiled to.
pub(crate) fn ffn_matrices(
    config: &ModelConfig,
    assignment: &CardAssignment,
    formats: (TileFormat, TileFormat),
    stored: &StoredFormats,
    tiling: &TilingOptions,
    profile: &HardwareProfile,
) -> Result<Vec<Vec<MatrixPlan>>> {
    let h = config.hidden_size;
    let (expert_format, dense_format) = formats;
    let mut layers = Vec::with_capacity(config.num_layers());
    for (l, share) in assignment.layers.iter().enumerate() {
        let mut plans = Vec::new();
        let mut push = |name: String, role, rows, cols, format, bias| -> Result<()> {
            let tiles = tile_grid(rows, cols, format, tiling, profile)?;
            let rank_in_layer = plans.len();
            let source_format = match role {
                MatrixRole::GateUp { expert: None, .. } | MatrixRole::Down { expert: None, .. } => {
                    stored.dense
                }
                _ => stored.experts,
            };
            plans.push(MatrixPlan {
                name,
                role,
                rows,
                cols,
                format,
                source_format,
                tiles,
                bias,
                rank_in_layer,
            });
            Ok(())
        };
        let layer = l as u32;
        match share {
            LayerShare::Moe { experts } => {
                let moe = config.moe.ok_or_else(|| {
                    Error::Assignment(format!(
                        "layer {l} has experts but the model has no MoE spec"
                    ))
                })?;
                let i = moe.intermediate_size;
                for &e in experts {
                    let expert = Some(e);
                    let bias = moe.expert_bias;
                    push(
                        format!("L{l}.e{e}.gate_up"),
                        MatrixRole::GateUp { layer, expert },
                        2 * i,
                        h,
                        expert_format,
                        bias,
                    )?;
                    push(
                        format!("L{l}.e{e}.down"),
                        MatrixRole::Down { layer, expert },
                        h,
                        i,
                        expert_format,
                        bias,
                    )?;
                }
            }
            LayerShare::Dense { columns } if !columns.is_empty() => {
                if config.layers[l].ffn != FfnKind::Dense {
                    return Err(Error::Assignment(format!("layer {l} is not dense")));
                }
                let c = columns.len();
                push(
                    format!("L{l}.dense.gate_up"),
                    MatrixRole::GateUp {
                        layer,
                        expert: None,
                    },
                    2 * c,
                    h,
                    dense_format,
                    false,
                )?;
                push(
                    format!("L{l}.dense.down"),
                    MatrixRole::Down {
                        layer,
                        expert: None,
                    },
                    h,
                    c,
                    dense_format,
                    false,
                )?;
            }
            LayerShare::Dense { .. } => {}
        }
        layers.push(plans);
    }
    Ok(layers)
}

/// The LM-head matrix of the shard and its chunks (groups of consecutive row bands streamed
/// together), or `None` when the card holds no rows.
pub(crate) fn lm_head_matrix(
    config: &ModelConfig,
    rows: Span,
    (format, source_format): (TileFormat, TileFormat),
    tiling: &TilingOptions,
    profile: &HardwareProfile,
) -> Result<Option<(MatrixPlan, Vec<Span>)>> {
    if rows.is_empty() {
        return Ok(None);
    }
    let h = config.hidden_size;
    let tiles = tile_grid(rows.len(), h, format, tiling, profile)?;
    let plan = MatrixPlan {
        name: "lm_head".into(),
        role: MatrixRole::LmHead,
        rows: rows.len(),
        cols: h,
        format,
        source_format,
        tiles,
        bias: false,
        rank_in_layer: 0,
    };
    // Chunks: whole row bands, about lm_head_chunk_bytes each.
    let mut chunks = Vec::new();
    let mut start = 0;
    let mut bytes = 0;
    for (i, &(r, s)) in plan.tiles.iter().enumerate() {
        let last_of_band = plan.tiles.get(i + 1).is_none_or(|n| n.0 != r);
        bytes += plan.tile_bytes(r, s);
        if last_of_band
            && (bytes >= profile.compiler.lm_head_chunk_bytes || i + 1 == plan.tiles.len())
        {
            chunks.push(Span::new(start, i + 1));
            start = i + 1;
            bytes = 0;
        }
    }
    Ok(Some((plan, chunks)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_tiles_cover_the_matrix_once() {
        let p = HardwareProfile::default();
        let tiles =
            tile_grid(5760, 2880, TileFormat::Mxfp4, &TilingOptions::default(), &p).unwrap();
        // 64 KiB / 1530 B = 42 rows -> 32-row bands, whole reduction.
        assert_eq!(tiles.len(), 5760 / 32);
        assert!(tiles.iter().all(|(_, s)| *s == Span::new(0, 6)));
        let forced = TilingOptions {
            rows_per_tile: Some(7),
            segments_per_tile: Some(4),
        };
        let tiles = tile_grid(20, 2880, TileFormat::Bf16, &forced, &p).unwrap();
        let mut covered = vec![0u32; 20 * 6];
        for (r, s) in tiles {
            for row in r.start..r.end {
                for seg in s.start..s.end {
                    covered[row * 6 + seg] += 1;
                }
            }
        }
        assert!(covered.iter().all(|&c| c == 1));
    }

    #[test]
    fn the_reduction_is_split_only_when_sixteen_whole_rows_exceed_the_largest_tile() {
        let p = HardwareProfile::default();
        let max = p.compiler.max_tile_bytes;
        // f32 rows of `cols` take 4 * cols bytes: 16 whole rows of exactly `max` fit.
        let cols = (max / 16 / 4) as usize;
        let d = TilingOptions::default();
        let whole = tile_grid(64, cols, TileFormat::F32, &d, &p).unwrap();
        assert!(
            whole
                .iter()
                .all(|(_, s)| *s == Span::new(0, segments(cols)))
        );
        // Twice as wide: each tile takes as many 512-column segments as 16 rows of `max` hold.
        let wide = tile_grid(64, 2 * cols, TileFormat::F32, &d, &p).unwrap();
        let per_tile = (max / (16 * 4 * SEGMENT as u64)) as usize;
        assert!(per_tile > 1 && per_tile < segments(2 * cols));
        assert_eq!(wide[0].1, Span::new(0, per_tile));
        assert!(wide.iter().all(|(_, s)| s.len() <= per_tile));
    }

    #[test]
    fn a_tile_may_fill_one_core_exactly() {
        let p = HardwareProfile::default();
        let row = TileFormat::F32.row_bytes(1024) as u64;
        let rows = (p.core_bytes() / row) as usize;
        assert_eq!(rows as u64 * row, p.core_bytes());
        let forced = |r| TilingOptions {
            rows_per_tile: Some(r),
            segments_per_tile: None,
        };
        assert!(tile_grid(2 * rows, 1024, TileFormat::F32, &forced(rows), &p).is_ok());
        assert!(tile_grid(2 * rows, 1024, TileFormat::F32, &forced(rows + 1), &p).is_err());
    }

    #[test]
    fn oversized_forced_tiles_are_refused() {
        let p = HardwareProfile::default();
        let forced = TilingOptions {
            rows_per_tile: Some(4096),
            segments_per_tile: None,
        };
        assert!(tile_grid(4096, 4096, TileFormat::F32, &forced, &p).is_err());
    }
}
