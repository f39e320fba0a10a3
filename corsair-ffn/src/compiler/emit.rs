//! Lowering a card's share to regions, matrices and the instruction stream (addresses come
//! later, from the memory plan).
//!
//! MoE layer: receive rows -> per local expert: gather its rows -> [stream weights] -> gate_up
//! tiles -> reduce (+bias) -> activation -> down tiles -> reduce (+bias) -> scale by routing
//! weight; then the per-token sum over slots -> send. Dense layer: receive -> gate_up -> reduce
//! -> activation -> down -> reduce -> send. LM head: receive -> per chunk: stream, tiles,
//! reduce into the shard's logits -> propose -> send.

use crate::assignment::Span;
use crate::program::{
    ActivationSpec, Lifetime, Matrix, MatrixRole, MemoryKind, Op, OutLayout, Region, RegionId,
    RegionKind, RowCount, Tile, TileRun,
};

use super::tiling::MatrixPlan;

/// Bytes per token of an LM-head proposal buffer, beyond the candidates: log-sum-exps and the
/// Gumbel winner.
pub(crate) const PROPOSAL_FIXED_BYTES: u64 = 32;

/// Regions, matrices and instructions under construction.
pub(crate) struct Builder {
    pub regions: Vec<Region>,
    pub matrices: Vec<Matrix>,
    pub instructions: Vec<Op>,
    pub max_tokens: u64,
    pub hidden: u64,
    pub top_k: u64,
    pub expert_activation: ActivationSpec,
}

impl Builder {
    pub fn new(
        max_tokens: usize,
        hidden: usize,
        top_k: usize,
        expert_activation: ActivationSpec,
    ) -> Self {
        Builder {
            regions: Vec::new(),
            matrices: Vec::new(),
            instructions: Vec::new(),
            max_tokens: max_tokens as u64,
            hidden: hidden as u64,
            top_k: top_k as u64,
            expert_activation,
        }
    }

    fn region(
        &mut self,
        name: String,
        kind: RegionKind,
        memory: MemoryKind,
        bytes: u64,
    ) -> RegionId {
        let lifetime = if kind.is_resident() {
            Lifetime::Resident
        } else {
            Lifetime::Transient { first: 0, last: 0 }
        };
        self.regions.push(Region {
            name,
            kind,
            memory,
            address: 0,
            bytes,
            location: None,
            lifetime,
        });
        (self.regions.len() - 1) as RegionId
    }

    /// A transient SRAM buffer.
    pub fn transient(&mut self, kind: RegionKind, name: String, bytes: u64) -> RegionId {
        self.region(name, kind, MemoryKind::Sram, bytes)
    }

    fn emit(&mut self, op: Op) -> u32 {
        self.instructions.push(op);
        (self.instructions.len() - 1) as u32
    }

    /// Adds a matrix with one resident region per tile (SRAM, or LPDDR when `streamed`).
    pub fn add_matrix(&mut self, plan: &MatrixPlan, streamed: bool) -> u32 {
        let kind = match plan.role {
            MatrixRole::LmHead => RegionKind::LmHeadWeight,
            MatrixRole::GateUp {
                expert: Some(_), ..
            }
            | MatrixRole::Down {
                expert: Some(_), ..
            } => RegionKind::ExpertWeight,
            _ => RegionKind::DenseWeight,
        };
        let memory = if streamed {
            MemoryKind::Lpddr
        } else {
            MemoryKind::Sram
        };
        let mut tiles = Vec::with_capacity(plan.tiles.len());
        for (i, &(rows, segments)) in plan.tiles.iter().enumerate() {
            let bytes = plan.tile_bytes(rows, segments);
            let region = self.region(format!("{}.t{i}", plan.name), kind, memory, bytes);
            tiles.push(Tile {
                region,
                rows,
                segments,
                core: 0,
            });
        }
        let bias = plan.bias.then(|| {
            self.region(
                format!("{}.bias", plan.name),
                RegionKind::Bias,
                MemoryKind::Sram,
                plan.rows as u64 * 4,
            )
        });
        self.matrices.push(Matrix {
            name: plan.name.clone(),
            role: plan.role,
            rows: plan.rows,
            cols: plan.cols,
            format: plan.format,
            source_format: plan.source_format,
            tiles,
            bias,
            streamed,
            activations: Default::default(),
        });
        (self.matrices.len() - 1) as u32
    }

    /// Stream (when needed), tiles and reduce of `tiles` of matrix `m` on `input` into `out`.
    fn matmul(
        &mut self,
        m: u32,
        tiles: Span,
        rows: RowCount,
        input: RegionId,
        out: RegionId,
        layout: OutLayout,
    ) {
        let mx = &self.matrices[m as usize];
        let name = mx.name.clone();
        let streamed = mx.streamed;
        let sel: Vec<(u32, Tile, u64)> = (tiles.start..tiles.end)
            .map(|t| {
                let tile = mx.tiles[t];
                (t as u32, tile, mx.tile_bytes(&tile))
            })
            .collect();
        let staging = if streamed {
            let mut offsets = Vec::with_capacity(sel.len());
            let mut at = 0u64;
            for &(_, _, b) in &sel {
                offsets.push(at);
                at += b.next_multiple_of(64);
            }
            let staging = self.transient(
                RegionKind::Staging,
                format!("{name}.staging{}", tiles.start),
                at,
            );
            self.emit(Op::Stream {
                matrix: m,
                tiles: sel.iter().map(|s| s.0).collect(),
                staging,
                offsets: offsets.clone(),
            });
            Some((staging, offsets))
        } else {
            None
        };
        let mut runs = Vec::with_capacity(sel.len());
        let mut partial_at = 0u64;
        for (i, &(t, tile, _)) in sel.iter().enumerate() {
            let (weights, weights_offset) = match &staging {
                Some((region, offsets)) => (*region, offsets[i]),
                None => (tile.region, 0),
            };
            runs.push(TileRun {
                tile: t,
                weights,
                weights_offset,
                partial_offset: partial_at,
            });
            partial_at += self.max_tokens * tile.rows.len() as u64 * tile.segments.len() as u64 * 4;
        }
        let partials = self.transient(
            RegionKind::Partial,
            format!("{name}.partials{}", tiles.start),
            partial_at,
        );
        let matmul = self.emit(Op::MatMul {
            matrix: m,
            rows,
            input,
            partials,
            tiles: runs,
        });
        self.emit(Op::Reduce {
            matmul,
            out,
            layout,
        });
    }

    fn whole(&self, m: u32) -> Span {
        Span::new(0, self.matrices[m as usize].tiles.len())
    }

    /// One MoE layer with local experts `experts` (global ids) and their (gate_up, down) matrices.
    /// Returns (input, slots, output) regions.
    pub fn moe_layer(
        &mut self,
        l: usize,
        experts: &[u32],
        matrices: &[(u32, u32)],
    ) -> (RegionId, RegionId, RegionId) {
        let (m, h, k) = (self.max_tokens, self.hidden, self.top_k);
        let x = self.transient(RegionKind::Io, format!("L{l}.x"), m * h * 4);
        let slots = self.transient(RegionKind::Io, format!("L{l}.slots"), m * k * 8);
        self.emit(Op::Receive {
            x,
            slots: Some(slots),
        });
        let mut outputs = Vec::with_capacity(experts.len());
        for (local, (&e, &(gate_up, down))) in experts.iter().zip(matrices).enumerate() {
            let rows = RowCount::Expert(local as u32);
            let gathered =
                self.transient(RegionKind::Activation, format!("L{l}.e{e}.rows"), m * h * 4);
            let map = self.transient(RegionKind::Activation, format!("L{l}.e{e}.map"), m * 8);
            self.emit(Op::Gather {
                local: local as u32,
                expert: e,
                slots,
                x,
                rows: gathered,
                map,
            });
            let act = self.expert_activation;
            let y = self.ffn(
                &format!("L{l}.e{e}"),
                (gate_up, down),
                act,
                rows,
                gathered,
                RegionKind::Activation,
            );
            self.emit(Op::Scale {
                rows,
                values: y,
                map,
            });
            outputs.push((e, map, y));
        }
        let out = self.transient(RegionKind::Io, format!("L{l}.out"), m * h * 4);
        self.emit(Op::SumSlots {
            slots,
            experts: outputs,
            out,
        });
        self.emit(Op::Send { src: out });
        (x, slots, out)
    }

    /// gate_up -> activation -> down on `input`; returns the output region (of `out_kind`).
    fn ffn(
        &mut self,
        name: &str,
        (gate_up, down): (u32, u32),
        activation: ActivationSpec,
        rows: RowCount,
        input: RegionId,
        out_kind: RegionKind,
    ) -> RegionId {
        let m = self.max_tokens;
        let width = self.matrices[down as usize].cols as u64;
        let gu = self.transient(
            RegionKind::Activation,
            format!("{name}.gate_up_out"),
            m * 2 * width * 4,
        );
        self.matmul(
            gate_up,
            self.whole(gate_up),
            rows,
            input,
            gu,
            OutLayout::TokenMajor,
        );
        let act = self.transient(RegionKind::Activation, format!("{name}.act"), m * width * 4);
        self.emit(Op::Activate {
            rows,
            gate_up: gu,
            out: act,
            width: width as u32,
            activation,
        });
        let y = self.transient(out_kind, format!("{name}.y"), m * self.hidden * 4);
        self.matmul(down, self.whole(down), rows, act, y, OutLayout::TokenMajor);
        y
    }

    /// One dense layer slice; `matrices` is `None` for an empty slice (the card sends zeros).
    pub fn dense_layer(&mut self, l: usize, matrices: Option<(u32, u32)>) -> (RegionId, RegionId) {
        let (m, h) = (self.max_tokens, self.hidden);
        let x = self.transient(RegionKind::Io, format!("L{l}.x"), m * h * 4);
        self.emit(Op::Receive { x, slots: None });
        let out = match matrices {
            Some(pair) => {
                let name = format!("L{l}.dense");
                self.ffn(
                    &name,
                    pair,
                    ActivationSpec::SwiGlu,
                    RowCount::Tokens,
                    x,
                    RegionKind::Io,
                )
            }
            None => {
                let out = self.transient(RegionKind::Io, format!("L{l}.out"), m * h * 4);
                self.emit(Op::Fill { region: out });
                out
            }
        };
        self.emit(Op::Send { src: out });
        (x, out)
    }

    /// The LM head over `chunks` of the matrix's tiles. Returns (input, logits).
    pub fn lm_head(
        &mut self,
        matrix: u32,
        chunks: &[Span],
        candidates: usize,
    ) -> (RegionId, RegionId) {
        let (m, h) = (self.max_tokens, self.hidden);
        let rows = self.matrices[matrix as usize].rows as u64;
        let x = self.transient(RegionKind::Io, "lm.x".into(), m * h * 4);
        self.emit(Op::Receive { x, slots: None });
        let logits = self.transient(RegionKind::Logits, "lm.logits".into(), rows * m * 4);
        for &chunk in chunks {
            self.matmul(
                matrix,
                chunk,
                RowCount::Tokens,
                x,
                logits,
                OutLayout::RowMajor,
            );
        }
        let out = self.transient(
            RegionKind::Io,
            "lm.proposals".into(),
            m * (candidates as u64 * 8 + PROPOSAL_FIXED_BYTES),
        );
        self.emit(Op::Propose { logits, out });
        self.emit(Op::Send { src: out });
        (x, logits)
    }
}
