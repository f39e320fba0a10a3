//! The performance model: each instruction's modeled time from the hardware profile, summed
//! per layer and per step.
//!
//! - bytes over the bandwidth of the level they touch: the host link (receive, send), LPDDR
//!   (streams), the on-card fabric (broadcasting a matmul's input, collecting partial sums),
//!   SRAM (gathers; each core reads its own tiles at its share of the SRAM bandwidth);
//! - operations over the rate of the weight format (per core, for the tiles it holds) or of
//!   the vector units (activation, scaling, sums, LM-head selection);
//! - fixed latencies per instruction, per tile, per stream and per host transfer.
//!
//! A matmul's cores run in parallel, each through its own tiles one after the other, each tile
//! bound by its SRAM reads or its arithmetic, whichever is slower. Instructions run one after
//! the other. Everything is computed from the program alone (no weights), quickly enough for a
//! planner to call it for many deployments.

use serde::{Deserialize, Serialize};

use crate::program::{Op, Program, RowCount};

/// Rows processed in one call of a layer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerLoad {
    /// Tokens of the step.
    pub tokens: usize,
    /// Rows routed to each local expert (MoE layers; ignored for dense layers).
    pub expert_rows: Vec<usize>,
}

impl LayerLoad {
    /// Uniform routing: every local expert receives `ceil(tokens * top_k / experts)` rows, at
    /// most `tokens` (the balanced case, rounded up: at batch 1 every local expert is busy).
    pub fn uniform(program: &Program, layer: usize, tokens: usize) -> Self {
        let local = match program.layers.get(layer).map(|l| &l.kind) {
            Some(crate::program::LayerKind::Moe { experts, .. }) => experts.len(),
            _ => 0,
        };
        let per = (tokens * program.top_k)
            .div_ceil(program.num_experts.max(1))
            .min(tokens);
        LayerLoad {
            tokens,
            expert_rows: vec![per; local],
        }
    }

    fn rows(&self, r: RowCount) -> usize {
        match r {
            RowCount::Tokens => self.tokens,
            RowCount::Expert(i) => self.expert_rows.get(i as usize).copied().unwrap_or(0),
        }
    }
}

/// Modeled time of one layer (or of the LM head).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LayerTime {
    /// Total seconds.
    pub seconds: f64,
    /// Of which streaming weights from LPDDR.
    pub lpddr_seconds: f64,
    /// Of which matmul tiles.
    pub matmul_seconds: f64,
    /// Of which receiving and sending over the host link.
    pub io_seconds: f64,
}

impl LayerTime {
    fn add(&mut self, op: &Op, s: f64) {
        self.seconds += s;
        match op {
            Op::Stream { .. } => self.lpddr_seconds += s,
            Op::MatMul { .. } => self.matmul_seconds += s,
            Op::Receive { .. } | Op::Send { .. } => self.io_seconds += s,
            _ => {}
        }
    }
}

/// Modeled time of one decode step.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepTime {
    /// Tokens in the step.
    pub tokens: usize,
    /// Per decoder layer.
    pub layers: Vec<LayerTime>,
    /// The LM head (zero without rows).
    pub lm_head: LayerTime,
    /// Everything.
    pub seconds: f64,
    /// Of which LPDDR streaming (spilled weights and the LM head).
    pub lpddr_seconds: f64,
}

/// Seconds of instruction `i` under `load`.
pub fn instruction_seconds(program: &Program, i: usize, load: &LayerLoad) -> f64 {
    let prof = &program.profile;
    let lat = &prof.latency;
    let mem = &prof.memory;
    let vector = prof.compute.vector_elements_per_second;
    let ns = 1e-9;
    let h = program.hidden as f64;
    let n = load.tokens as f64;
    let Some(op) = program.instructions.get(i) else {
        return 0.0;
    };
    let base = lat.instruction_ns * ns;
    match op {
        Op::Receive { slots, .. } => {
            let bytes = n * h * 4.0
                + if slots.is_some() {
                    n * program.top_k as f64 * 8.0
                } else {
                    0.0
                };
            lat.host_link_ns * ns + bytes / mem.host_link_bandwidth
        }
        Op::Send { src } => {
            let per_row = program.regions.get(*src as usize).map_or(0, |r| r.bytes) as f64
                / program.max_tokens as f64;
            lat.host_link_ns * ns + n * per_row / mem.host_link_bandwidth
        }
        Op::Gather { local, .. } => {
            let r = load.rows(RowCount::Expert(*local)) as f64;
            if r == 0.0 {
                0.0
            } else {
                base + 2.0 * r * h * 4.0 / mem.sram_bandwidth
            }
        }
        Op::Stream { matrix, tiles, .. } => {
            let Some(m) = program.matrices.get(*matrix as usize) else {
                return 0.0;
            };
            if expert_idle(program, i, load) {
                return 0.0;
            }
            let bytes: u64 = tiles
                .iter()
                .filter_map(|&t| m.tiles.get(t as usize))
                .map(|t| m.tile_bytes(t))
                .sum();
            lat.dma_setup_ns * ns + bytes as f64 / mem.lpddr_bandwidth
        }
        Op::MatMul {
            matrix,
            rows,
            tiles,
            ..
        } => {
            let r = load.rows(*rows);
            let Some(m) = program.matrices.get(*matrix as usize) else {
                return 0.0;
            };
            if r == 0 {
                return 0.0;
            }
            let core_bw = prof.core_bandwidth();
            let core_flops = prof.core_flops(m.format);
            let mut busy: Vec<(u32, f64)> = Vec::with_capacity(tiles.len());
            for run in tiles {
                let Some(t) = m.tiles.get(run.tile as usize) else {
                    continue;
                };
                let bytes = m.tile_bytes(t) as f64;
                let flops = 2.0 * (t.rows.len() * m.columns(t.segments).len() * r) as f64;
                busy.push((
                    t.core,
                    (bytes / core_bw).max(flops / core_flops) + lat.tile_issue_ns * ns,
                ));
            }
            busy.sort_by_key(|b| b.0);
            let mut slowest = 0f64;
            let mut k = 0;
            while k < busy.len() {
                let core = busy[k].0;
                let mut sum = 0.0;
                while k < busy.len() && busy[k].0 == core {
                    sum += busy[k].1;
                    k += 1;
                }
                slowest = slowest.max(sum);
            }
            base + slowest + r as f64 * m.cols as f64 * 4.0 / mem.noc_bandwidth
        }
        Op::Reduce { matmul, .. } => {
            let Some(Op::MatMul {
                matrix,
                rows,
                tiles,
                ..
            }) = program.instructions.get(*matmul as usize)
            else {
                return 0.0;
            };
            let r = load.rows(*rows) as f64;
            let Some(m) = program.matrices.get(*matrix as usize) else {
                return 0.0;
            };
            if r == 0.0 {
                return 0.0;
            }
            let partials: usize = tiles
                .iter()
                .filter_map(|t| m.tiles.get(t.tile as usize))
                .map(|t| t.rows.len() * t.segments.len())
                .sum();
            base + r * partials as f64 * 4.0 / mem.noc_bandwidth
        }
        Op::Activate { rows, width, .. } => {
            let r = load.rows(*rows) as f64;
            if r == 0.0 {
                0.0
            } else {
                base + r * *width as f64 / vector
            }
        }
        Op::Scale { rows, .. } => {
            let r = load.rows(*rows) as f64;
            if r == 0.0 { 0.0 } else { base + r * h / vector }
        }
        Op::SumSlots { .. } => base + n * program.top_k as f64 * h / vector,
        Op::Fill { .. } => base + n * h / vector,
        Op::Propose { .. } => {
            let rows = program.lm_head.as_ref().map_or(0, |l| l.rows.len()) as f64;
            // Selection, log-sum-exp and the Gumbel draw: a few element-wise passes.
            base + 4.0 * n * rows / vector
        }
    }
}

/// Whether instruction `i` (a stream) belongs to an expert that receives no rows.
fn expert_idle(program: &Program, i: usize, load: &LayerLoad) -> bool {
    // The stream feeds the next matmul.
    match program.instructions.get(i + 1) {
        Some(Op::MatMul { rows, .. }) => load.rows(*rows) == 0,
        _ => false,
    }
}

/// The count an instruction's modeled time depends on: every instruction's time is a function
/// of one count of its layer's load (the step's tokens, or one local expert's rows), which is
/// what lets [`LayerCosts`] tabulate a layer by count.
pub fn instruction_count(program: &Program, i: usize) -> RowCount {
    match program.instructions.get(i) {
        Some(Op::Gather { local, .. }) => RowCount::Expert(*local),
        Some(Op::Stream { .. }) => match program.instructions.get(i + 1) {
            Some(Op::MatMul { rows, .. }) => *rows,
            _ => RowCount::Tokens,
        },
        Some(Op::MatMul { rows, .. } | Op::Activate { rows, .. } | Op::Scale { rows, .. }) => *rows,
        Some(Op::Reduce { matmul, .. }) => match program.instructions.get(*matmul as usize) {
            Some(Op::MatMul { rows, .. }) => *rows,
            _ => RowCount::Tokens,
        },
        _ => RowCount::Tokens,
    }
}

/// One layer's modeled time split by count: the instructions that depend on the step's tokens,
/// and per local expert those that depend on its rows. [`LayerCosts::time`] of a load is
/// [`layer_time`] of it (up to the order of the sums), but costs one table look-up per count
/// once a count has been seen: what timing many loads of one program needs (an emulation
/// times every step of a run).
#[derive(Debug, Clone, Default)]
pub struct LayerCosts {
    /// Instructions of the layer by count: `groups[0]` the tokens', `groups[1 + i]` local
    /// expert `i`'s.
    groups: Vec<Vec<usize>>,
    /// Per group, the time at each count seen so far.
    seen: Vec<std::collections::HashMap<usize, LayerTime>>,
}

impl LayerCosts {
    /// The table of `layer` of `program` (empty for a layer it does not have).
    pub fn new(program: &Program, layer: usize) -> Self {
        let Some(l) = program.layers.get(layer) else {
            return LayerCosts::default();
        };
        let experts = match &l.kind {
            crate::program::LayerKind::Moe { experts, .. } => experts.len(),
            _ => 0,
        };
        let mut groups = vec![Vec::new(); 1 + experts];
        for i in l.instructions.start..l.instructions.end {
            let g = match instruction_count(program, i) {
                RowCount::Tokens => 0,
                RowCount::Expert(e) => 1 + e as usize,
            };
            if let Some(group) = groups.get_mut(g) {
                group.push(i);
            }
        }
        LayerCosts {
            seen: vec![std::collections::HashMap::new(); groups.len()],
            groups,
        }
    }

    /// The time of the instructions of group `g` at count `count`.
    fn group_time(&mut self, program: &Program, g: usize, count: usize) -> LayerTime {
        if let Some(t) = self.seen.get(g).and_then(|s| s.get(&count)) {
            return t.clone();
        }
        let load = match g {
            0 => LayerLoad {
                tokens: count,
                expert_rows: Vec::new(),
            },
            _ => {
                let mut rows = vec![0; g];
                rows[g - 1] = count;
                LayerLoad {
                    tokens: 0,
                    expert_rows: rows,
                }
            }
        };
        let mut t = LayerTime::default();
        for &i in self.groups.get(g).map_or(&[][..], Vec::as_slice) {
            t.add(
                &program.instructions[i],
                instruction_seconds(program, i, &load),
            );
        }
        if let Some(s) = self.seen.get_mut(g) {
            s.insert(count, t.clone());
        }
        t
    }

    /// The rows of one expert whose arithmetic takes as long as computing one row does in all
    /// (the weight pass, the fixed latencies and the row's own work): the break-even the
    /// dispatcher splits a replicated expert's rows at ([`rows_per_weight_read`]). `u32::MAX`
    /// where an expert's time does not grow with its rows up to the program's `max_tokens`
    /// (never worth splitting), or the layer has no experts.
    pub fn rows_per_weight_read(&mut self, program: &Program) -> u32 {
        if self.groups.len() < 2 || program.max_tokens < 2 {
            return u32::MAX;
        }
        // The per-row slope where it is steepest-known: over the upper half of the rows a
        // call can carry (compute bound there if anywhere).
        let top = program.max_tokens;
        let half = top / 2;
        let at = |costs: &mut Self, rows: usize| costs.group_time(program, 1, rows).seconds;
        let per_row = (at(self, top) - at(self, half)) / (top - half) as f64;
        let one = at(self, 1);
        if per_row <= one * 1e-9 {
            return u32::MAX;
        }
        (one / per_row).round().clamp(1.0, f64::from(u32::MAX - 1)) as u32
    }

    /// Of [`Self::rows_per_weight_read`], the rows an expert's copy costs however many rows it
    /// computes: where the compute-bound line of its time (the slope over the upper half of the
    /// rows a call can carry) meets zero rows, in rows of that slope (its instructions' fixed
    /// latencies; the rest of a row's cost is the weight pass, which arithmetic overlaps). What
    /// tells the dispatcher that a second copy of a split expert costs more than its rows. 0
    /// where [`Self::rows_per_weight_read`] is `u32::MAX`; at most one less than it otherwise.
    pub fn fixed_rows_per_copy(&mut self, program: &Program) -> u32 {
        let c = self.rows_per_weight_read(program);
        if c == u32::MAX {
            return 0;
        }
        let top = program.max_tokens;
        let half = top / 2;
        let at = |costs: &mut Self, rows: usize| costs.group_time(program, 1, rows).seconds;
        let per_row = (at(self, top) - at(self, half)) / (top - half) as f64;
        let fixed = at(self, top) - per_row * top as f64;
        (fixed / per_row)
            .round()
            .clamp(0.0, f64::from(c.saturating_sub(1))) as u32
    }

    /// The layer's time under `load` (the same program the table was made of).
    pub fn time(&mut self, program: &Program, load: &LayerLoad) -> LayerTime {
        let mut t = self.group_time(program, 0, load.tokens);
        for g in 1..self.groups.len() {
            let rows = load.expert_rows.get(g - 1).copied().unwrap_or(0);
            let e = self.group_time(program, g, rows);
            t.seconds += e.seconds;
            t.lpddr_seconds += e.lpddr_seconds;
            t.matmul_seconds += e.matmul_seconds;
            t.io_seconds += e.io_seconds;
        }
        t
    }
}

/// Per layer of `program`, the rows one pass over an expert's weights is worth
/// ([`LayerCosts::rows_per_weight_read`]; `u32::MAX` for a dense layer): what the card tells
/// the attention node so its dispatcher splits a hot replicated expert's rows only where that
/// pays.
pub fn rows_per_weight_read(program: &Program) -> Vec<u32> {
    (0..program.layers.len())
        .map(|l| LayerCosts::new(program, l).rows_per_weight_read(program))
        .collect()
}

/// Per layer of `program`, the rows of [`rows_per_weight_read`] a copy of an expert costs
/// however many rows it computes ([`LayerCosts::fixed_rows_per_copy`]; 0 for a dense layer):
/// reported with it, so the dispatcher does not split an expert where a second copy's fixed
/// latencies cost more than the rows it takes over.
pub fn fixed_rows_per_copy(program: &Program) -> Vec<u32> {
    (0..program.layers.len())
        .map(|l| LayerCosts::new(program, l).fixed_rows_per_copy(program))
        .collect()
}

/// Modeled time of layer `layer` under `load`.
pub fn layer_time(program: &Program, layer: usize, load: &LayerLoad) -> LayerTime {
    let mut t = LayerTime::default();
    if let Some(l) = program.layers.get(layer) {
        for i in l.instructions.start..l.instructions.end {
            t.add(
                &program.instructions[i],
                instruction_seconds(program, i, load),
            );
        }
    }
    t
}

/// Modeled time of the LM head for `tokens` tokens.
pub fn lm_head_time(program: &Program, tokens: usize) -> LayerTime {
    let mut t = LayerTime::default();
    let load = LayerLoad {
        tokens,
        expert_rows: Vec::new(),
    };
    if let Some(l) = &program.lm_head {
        for i in l.instructions.start..l.instructions.end {
            t.add(
                &program.instructions[i],
                instruction_seconds(program, i, &load),
            );
        }
    }
    t
}

/// Modeled time of a whole step of `tokens` tokens under uniform routing.
pub fn step_time(program: &Program, tokens: usize) -> StepTime {
    let layers: Vec<LayerTime> = (0..program.layers.len())
        .map(|l| layer_time(program, l, &LayerLoad::uniform(program, l, tokens)))
        .collect();
    let lm_head = lm_head_time(program, tokens);
    let seconds = layers.iter().map(|l| l.seconds).sum::<f64>() + lm_head.seconds;
    let lpddr_seconds = layers.iter().map(|l| l.lpddr_seconds).sum::<f64>() + lm_head.lpddr_seconds;
    StepTime {
        tokens,
        layers,
        lm_head,
        seconds,
        lpddr_seconds,
    }
}

#[cfg(test)]
mod tests;
