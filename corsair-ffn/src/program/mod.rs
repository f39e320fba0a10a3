//! A compiled card program: regions (every weight tile, bias, activation and scratch buffer with
//! its memory, address, location and lifetime), matrices and their tiles, and one flat
//! instruction stream (layers in order, then the LM head).
//!
//! Each instruction states what it reads and writes ([`Program::accesses`]), at the program's largest
//! shape (`max_tokens` tokens, every local expert receiving every token): that is what the
//! sanitizer proves. At run time the row counts are smaller and every instruction of an expert
//! uses the same count, so the proof covers them.

use serde::{Deserialize, Serialize};

use crate::assignment::{CardAssignment, Span};
use crate::format::TileFormat;
use crate::numerics::segments;
use crate::profile::{HardwareProfile, SramLocation};

mod access;
pub use access::{Access, InstructionAccesses, MissingRef};

/// Index of a region in [`Program::regions`].
pub type RegionId = u32;

/// What a region holds (the unit of the memory report).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RegionKind {
    /// Expert weight tiles (resident).
    ExpertWeight,
    /// Dense FFN weight tiles (resident).
    DenseWeight,
    /// LM-head weight tiles (resident in LPDDR).
    LmHeadWeight,
    /// Biases (resident).
    Bias,
    /// Rows received from and results sent to the attention node.
    Io,
    /// Per-expert inputs, outputs and routing maps.
    Activation,
    /// Segment partial sums of matmul tiles.
    Partial,
    /// SRAM buffers that weights streamed from LPDDR land in.
    Staging,
    /// LM-head logits of the shard.
    Logits,
}

impl RegionKind {
    /// Whether the region is loaded once and stays (weights, biases).
    pub fn is_resident(self) -> bool {
        matches!(
            self,
            RegionKind::ExpertWeight
                | RegionKind::DenseWeight
                | RegionKind::LmHeadWeight
                | RegionKind::Bias
        )
    }

    /// Every kind, in report order.
    pub const ALL: [RegionKind; 9] = [
        RegionKind::ExpertWeight,
        RegionKind::DenseWeight,
        RegionKind::LmHeadWeight,
        RegionKind::Bias,
        RegionKind::Io,
        RegionKind::Activation,
        RegionKind::Partial,
        RegionKind::Staging,
        RegionKind::Logits,
    ];
}

impl std::fmt::Display for RegionKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RegionKind::ExpertWeight => "expert weights",
            RegionKind::DenseWeight => "dense weights",
            RegionKind::LmHeadWeight => "LM-head weights",
            RegionKind::Bias => "biases",
            RegionKind::Io => "io buffers",
            RegionKind::Activation => "activations",
            RegionKind::Partial => "partial sums",
            RegionKind::Staging => "staging",
            RegionKind::Logits => "logits",
        })
    }
}

/// Which memory a region lives in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MemoryKind {
    /// On-chip SRAM.
    Sram,
    /// LPDDR5X capacity memory.
    Lpddr,
}

/// When a region holds live data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Lifetime {
    /// Loaded before the first instruction and never released.
    Resident,
    /// Between two instruction indices (inclusive).
    Transient {
        /// First instruction using it.
        first: u32,
        /// Last instruction using it.
        last: u32,
    },
}

/// A named byte range of one memory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Region {
    /// Human-readable name (`L3.e5.gate_up.t12`).
    pub name: String,
    /// What it holds.
    pub kind: RegionKind,
    /// Which memory.
    pub memory: MemoryKind,
    /// Card-linear byte address in that memory.
    pub address: u64,
    /// Size in bytes.
    pub bytes: u64,
    /// Where its first byte is (SRAM only).
    pub location: Option<SramLocation>,
    /// When it is live.
    pub lifetime: Lifetime,
}

/// What a matrix is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MatrixRole {
    /// Gate and up projections fused: rows `[0, I)` gate, `[I, 2I)` up.
    GateUp {
        /// Decoder layer.
        layer: u32,
        /// Expert id (`None`: dense layer).
        expert: Option<u32>,
    },
    /// Down projection.
    Down {
        /// Decoder layer.
        layer: u32,
        /// Expert id (`None`: dense layer).
        expert: Option<u32>,
    },
    /// The LM head's rows of this card.
    LmHead,
}

/// One weight tile: rows `[rows.start, rows.end)` x segments `[segments.start, segments.end)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tile {
    /// The resident region holding it (SRAM, or LPDDR when spilled / streamed).
    pub region: RegionId,
    /// Output rows.
    pub rows: Span,
    /// Reduction segments.
    pub segments: Span,
    /// Card-wide index of the core that computes it.
    pub core: u32,
}

/// A weight matrix `[rows, cols]` (out x in) of the card's share, cut into tiles.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Matrix {
    /// Name (`L3.e5.gate_up`).
    pub name: String,
    /// What it is.
    pub role: MatrixRole,
    /// Output rows.
    pub rows: usize,
    /// Reduction length (unpadded).
    pub cols: usize,
    /// Storage format on the card.
    pub format: TileFormat,
    /// Format the checkpoint stores it in (checked when weights are bound).
    pub source_format: TileFormat,
    /// Tiles, row band by row band, segments ascending within a band.
    pub tiles: Vec<Tile>,
    /// Bias region (`rows` f32), if any.
    pub bias: Option<RegionId>,
    /// Whether the tiles live in LPDDR and are streamed in before use.
    pub streamed: bool,
    /// What products with this matrix round their inputs to (set by the compiler; bf16 only
    /// for bf16 and MXFP4 tiles).
    #[serde(default)]
    pub activations: model::kernels::ActivationDtype,
}

impl Matrix {
    /// Segments of the reduction.
    pub fn segments(&self) -> usize {
        segments(self.cols)
    }

    /// Columns covered by segments `s`.
    pub fn columns(&self, s: Span) -> Span {
        Span::new(
            s.start * crate::numerics::SEGMENT,
            (s.end * crate::numerics::SEGMENT).min(self.cols),
        )
    }

    /// Whether tile `t` spans the whole reduction, so that it alone makes its rows' sums: the
    /// executor then adds its segments up as they are computed and keeps one partial a row.
    pub fn tile_folds_segments(&self, t: &Tile) -> bool {
        t.segments.start == 0 && self.columns(t.segments).end >= self.cols
    }

    /// Bytes of tile `t` (data then scales).
    pub fn tile_bytes(&self, t: &Tile) -> u64 {
        (t.rows.len() * self.format.row_bytes(self.columns(t.segments).len())) as u64
    }

    /// Bytes of all tiles.
    pub fn bytes(&self) -> u64 {
        self.tiles.iter().map(|t| self.tile_bytes(t)).sum()
    }
}

/// Where a tile's weights are read from by a matmul.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TileRun {
    /// Index of the tile in its matrix.
    pub tile: u32,
    /// Region holding its bytes when it runs (its own region, or a staging buffer).
    pub weights: RegionId,
    /// Byte offset of the tile in `weights`.
    pub weights_offset: u64,
    /// Byte offset of its segment partials (`[max_tokens, rows, segments]` f32) in the partial region.
    pub partial_offset: u64,
}

/// How many rows an instruction processes at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RowCount {
    /// Every token of the step.
    Tokens,
    /// The rows routed to local expert `i` (its index in the layer's expert list).
    Expert(u32),
}

/// Where a reduce writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OutLayout {
    /// `out[t * matrix.rows + n]`.
    TokenMajor,
    /// `out[n * tokens + t]`, where `tokens` is the call's token count (LM-head logits: a
    /// chunk of rows is one contiguous range, and a call with fewer tokens than the program's
    /// maximum keeps its logits compact instead of spreading them over the whole region).
    RowMajor,
}

/// One instruction.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Op {
    /// Rows arrive from the attention node: hidden states `[n, hidden]` f32 into `x` and, for
    /// MoE layers, `top_k` slots per token (expert id u32, weight f32) into `slots`.
    Receive {
        /// Hidden states.
        x: RegionId,
        /// Routing slots.
        slots: Option<RegionId>,
    },
    /// Copies the rows routed to local expert `local` into `rows` (token order) and writes
    /// `map` (per row: token index u32, routing weight f32).
    Gather {
        /// Index in the layer's expert list.
        local: u32,
        /// Global expert id.
        expert: u32,
        /// Routing slots.
        slots: RegionId,
        /// Hidden states of all tokens.
        x: RegionId,
        /// Gathered rows.
        rows: RegionId,
        /// Row map.
        map: RegionId,
    },
    /// Copies a streamed matrix's tiles from LPDDR into a staging buffer.
    Stream {
        /// The matrix.
        matrix: u32,
        /// Tiles streamed (indices in the matrix).
        tiles: Vec<u32>,
        /// Staging region.
        staging: RegionId,
        /// Byte offset of each tile in the staging region.
        offsets: Vec<u64>,
    },
    /// Tiled matmul: each tile writes its segment partials for every row of `input`.
    MatMul {
        /// The matrix.
        matrix: u32,
        /// Rows of the input.
        rows: RowCount,
        /// Input `[rows, cols]` f32.
        input: RegionId,
        /// Partial sums.
        partials: RegionId,
        /// Tiles run, and where each reads and writes.
        tiles: Vec<TileRun>,
    },
    /// Sums the segment partials of a matmul in segment order and adds the bias.
    Reduce {
        /// Instruction index of the matmul whose partials it reduces.
        matmul: u32,
        /// Output region.
        out: RegionId,
        /// Output layout.
        layout: OutLayout,
    },
    /// `out[r, i] = act(gate_up[r, i], gate_up[r, width + i])`.
    Activate {
        /// Rows.
        rows: RowCount,
        /// Gate and up values `[rows, 2 * width]`.
        gate_up: RegionId,
        /// Activations `[rows, width]`.
        out: RegionId,
        /// Intermediate width.
        width: u32,
        /// The gated activation.
        activation: ActivationSpec,
    },
    /// Multiplies each row of `values` by its routing weight from `map`, in place.
    Scale {
        /// Rows of local expert.
        rows: RowCount,
        /// Expert outputs `[rows, hidden]`.
        values: RegionId,
        /// Row map of the expert.
        map: RegionId,
    },
    /// Per token, the sum over its local slots (slot order) of the scaled expert rows.
    SumSlots {
        /// Routing slots.
        slots: RegionId,
        /// Per local expert: (global id, row map, scaled outputs).
        experts: Vec<(u32, RegionId, RegionId)>,
        /// Partial sums `[n, hidden]`.
        out: RegionId,
    },
    /// Writes zeros over a whole region (an empty dense slice still answers).
    Fill {
        /// The region.
        region: RegionId,
    },
    /// Sends a region's rows back to the attention node.
    Send {
        /// The region.
        src: RegionId,
    },
    /// LM head: candidates, log-sum-exp and Gumbel proposal per token from the shard's logits.
    Propose {
        /// Logits `[shard rows, max_tokens]`.
        logits: RegionId,
        /// Proposal buffer sent back.
        out: RegionId,
    },
}

/// What the program does in one decoder layer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum LayerKind {
    /// Local experts (possibly none) of a MoE layer.
    Moe {
        /// Global ids, ascending; local index = position.
        experts: Vec<u32>,
        /// Per local expert: (gate_up matrix, down matrix).
        matrices: Vec<(u32, u32)>,
    },
    /// A column slice of a dense FFN layer.
    Dense {
        /// Intermediate columns.
        columns: Span,
        /// Gate_up and down matrices (`None` when the slice is empty).
        matrices: Option<(u32, u32)>,
    },
}

/// One layer's part of the instruction stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerProgram {
    /// What it computes.
    pub kind: LayerKind,
    /// Its instructions `[start, end)` in [`Program::instructions`].
    pub instructions: Span,
    /// Region receiving the hidden states.
    pub input: RegionId,
    /// Region receiving the slots (MoE).
    pub slots: Option<RegionId>,
    /// Region sent back.
    pub output: RegionId,
}

/// The LM head's part of the program.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LmHeadProgram {
    /// Vocabulary rows of the shard.
    pub rows: Span,
    /// The matrix (streamed from LPDDR chunk by chunk).
    pub matrix: u32,
    /// Its instructions.
    pub instructions: Span,
    /// Region receiving the normed hidden states.
    pub input: RegionId,
    /// Logits region.
    pub logits: RegionId,
}

/// The model's gated activation, serializable.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ActivationSpec {
    /// `silu(gate) * up`.
    SwiGlu,
    /// GPT-OSS's clamped SwiGLU with `+1` on up.
    ClampedSwiGlu {
        /// Sigmoid slope.
        alpha: f32,
        /// Clamp limit.
        limit: f32,
    },
}

impl From<model::config::Activation> for ActivationSpec {
    fn from(a: model::config::Activation) -> Self {
        match a {
            model::config::Activation::SwiGlu => ActivationSpec::SwiGlu,
            model::config::Activation::ClampedSwiGlu { alpha, limit } => {
                ActivationSpec::ClampedSwiGlu { alpha, limit }
            }
        }
    }
}

impl From<ActivationSpec> for model::config::Activation {
    fn from(a: ActivationSpec) -> Self {
        match a {
            ActivationSpec::SwiGlu => model::config::Activation::SwiGlu,
            ActivationSpec::ClampedSwiGlu { alpha, limit } => {
                model::config::Activation::ClampedSwiGlu { alpha, limit }
            }
        }
    }
}

/// A compiled card program.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Program {
    /// The share it was compiled from.
    pub assignment: CardAssignment,
    /// The hardware it targets.
    pub profile: HardwareProfile,
    /// Width of the residual stream.
    pub hidden: usize,
    /// Slots per token in MoE layers.
    pub top_k: usize,
    /// Experts per MoE layer in the whole model (0 without MoE layers).
    pub num_experts: usize,
    /// Largest number of tokens per step.
    pub max_tokens: usize,
    /// The experts' gated activation (dense layers use SwiGLU).
    pub expert_activation: ActivationSpec,
    /// Every region.
    pub regions: Vec<Region>,
    /// Every weight matrix.
    pub matrices: Vec<Matrix>,
    /// The instruction stream.
    pub instructions: Vec<Op>,
    /// Per decoder layer.
    pub layers: Vec<LayerProgram>,
    /// The LM head, when the card holds rows of it.
    pub lm_head: Option<LmHeadProgram>,
    /// SRAM address of the transient pool (activations, partials, staging, logits).
    pub pool_base: u64,
    /// Bytes of the transient pool.
    pub pool_bytes: u64,
}

impl Program {
    /// The region `id`.
    pub fn region(&self, id: RegionId) -> &Region {
        &self.regions[id as usize]
    }

    /// SRAM bytes of resident regions of `kind`.
    pub fn resident_bytes(&self, kind: RegionKind, memory: MemoryKind) -> u64 {
        self.regions
            .iter()
            .filter(|r| r.kind == kind && r.memory == memory)
            .map(|r| r.bytes)
            .sum()
    }
}
