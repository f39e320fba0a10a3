//! The compiler: one card's share of the model (from the shape alone) -> a [`Program`].
//!
//! Steps: pick each matrix's format and tiles; lower the share to regions and instructions;
//! derive lifetimes and pack the transient buffers into one SRAM pool; place every resident
//! weight tile on a core (the pool takes whole cores at the top of the card); stream what does
//! not fit from LPDDR when spilling is allowed, else fail with the numbers; place LPDDR
//! regions (LM head, spilled tiles); run the sanitizer and refuse the program on any finding.

mod emit;
mod memory;
#[cfg(test)]
mod tests;
mod tiling;

use model::ModelConfig;
use model::kernels::ActivationDtype;
use serde::{Deserialize, Serialize};

pub(crate) use emit::PROPOSAL_FIXED_BYTES;
pub use tiling::{StoredFormats, TilingOptions};

use crate::assignment::{CardAssignment, LayerShare, PlacementOptions, plan_placement};
use crate::error::{Error, Result};
use crate::format::{FormatChoice, TileFormat};
use crate::profile::HardwareProfile;
use crate::program::{
    ActivationSpec, LayerKind, LayerProgram, LmHeadProgram, MatrixRole, MemoryKind, Program,
    RegionKind,
};
use crate::report::{MemoryUse, human_bytes};
use crate::sanitizer::{self, SanitizerReport};

/// How to compile a card's share.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompileOptions {
    /// Format of expert and dense FFN weights.
    pub format: FormatChoice,
    /// Format of the LM head (streamed from LPDDR). Default: as stored.
    pub lm_head_format: FormatChoice,
    /// Largest number of tokens per step (sizes every activation buffer). Default 64.
    pub max_tokens: usize,
    /// Let expert and dense weights that do not fit in SRAM stream from LPDDR. Default off.
    pub allow_spill: bool,
    /// Forced tile shapes; default: the compiler's choice.
    pub tiling: TilingOptions,
    /// LM-head candidates per token the proposal buffer is sized for. Default 64.
    pub candidates: usize,
    /// What the card's products round their inputs to (bf16: bf16 and MXFP4 tiles use the
    /// bf16 order of [`crate::numerics`]). Default f32.
    #[serde(default)]
    pub activations: ActivationDtype,
}

impl Default for CompileOptions {
    fn default() -> Self {
        CompileOptions {
            format: FormatChoice::AsStored,
            lm_head_format: FormatChoice::AsStored,
            max_tokens: 64,
            allow_spill: false,
            tiling: TilingOptions::default(),
            candidates: 64,
            activations: ActivationDtype::F32,
        }
    }
}

/// Why a share does not fit, with the numbers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FitError {
    /// The card.
    pub card: usize,
    /// Cards in the deployment.
    pub cards: usize,
    /// SRAM the share needs, by region kind (resident weights and the transient pool's peak).
    pub needed: Vec<MemoryUse>,
    /// Total SRAM needed.
    pub needed_bytes: u64,
    /// SRAM per card.
    pub sram_bytes: u64,
    /// Format of the FFN weights.
    pub format: TileFormat,
    /// Whether `--allow-spill` was on (then LPDDR is what ran out).
    pub allow_spill: bool,
    /// What to do.
    pub advice: String,
}

impl std::fmt::Display for FitError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "card {} of {} does not fit: its share needs {} of SRAM ({} weights) but the card has {}",
            self.card,
            self.cards,
            human_bytes(self.needed_bytes),
            self.format,
            human_bytes(self.sram_bytes)
        )?;
        let parts: Vec<String> = self
            .needed
            .iter()
            .filter(|u| u.bytes > 0)
            .map(|u| format!("{} {}", u.kind, human_bytes(u.bytes)))
            .collect();
        write!(f, " [{}]. {}", parts.join(", "), self.advice)
    }
}

/// A compiled program and the sanitizer's verdict on it (always clean: findings fail).
#[derive(Debug, Clone)]
pub struct Compiled {
    /// The program.
    pub program: Program,
    /// What the sanitizer checked.
    pub sanitizer: SanitizerReport,
}

/// Compiles one card's share. Needs only the shape (`config`) and the stored formats.
pub fn compile(
    config: &ModelConfig,
    stored: &StoredFormats,
    assignment: &CardAssignment,
    options: &CompileOptions,
    profile: &HardwareProfile,
) -> Result<Compiled> {
    assignment.validate(config)?;
    if options.max_tokens == 0 {
        return Err(Error::Unsupported("max_tokens must be at least 1".into()));
    }
    let expert_format = TileFormat::resolve(options.format, stored.experts);
    let dense_format = TileFormat::resolve(options.format, stored.dense);
    let lm_format = TileFormat::resolve(options.lm_head_format, stored.lm_head);
    let layers = tiling::ffn_matrices(
        config,
        assignment,
        (expert_format, dense_format),
        stored,
        &options.tiling,
        profile,
    )?;
    let lm = tiling::lm_head_matrix(
        config,
        assignment.lm_head_rows,
        (lm_format, stored.lm_head),
        &options.tiling,
        profile,
    )?;

    // Spill order: the last matrices of each layer first, layer by layer, so the streamed
    // bytes (and their modeled cost) spread evenly over the layers.
    let mut spill_order: Vec<(usize, usize)> = layers
        .iter()
        .enumerate()
        .flat_map(|(l, plans)| plans.iter().map(move |p| (l, p.rank_in_layer)))
        .collect();
    spill_order.sort_by_key(|&(l, rank)| (std::cmp::Reverse(rank), l));
    let mut spilled = 0usize;
    let cores = profile.hierarchy.cores();
    loop {
        let streamed = |l: usize, rank: usize| spill_order[..spilled].contains(&(l, rank));
        let mut program = lower(
            config,
            assignment,
            options,
            profile,
            &layers,
            lm.as_ref(),
            &streamed,
        );
        for m in &mut program.matrices {
            // The numerics of a product are the whole matrix's, not of this card's columns
            // of it: a dense layer's down projection split across cards rounds its inputs as
            // the whole one does (as the reference does), whatever the card count.
            let cols = match m.role {
                MatrixRole::Down { expert: None, .. } => {
                    config.dense_intermediate_size.unwrap_or(m.cols)
                }
                _ => m.cols,
            };
            m.activations = options.activations.numerics(m.format.block_format(), cols);
        }
        memory::derive_lifetimes(&mut program);
        program.pool_bytes = memory::allocate_pool(&mut program);
        let pool_cores = program.pool_bytes.div_ceil(profile.core_bytes()) as usize;
        let placed = if pool_cores < cores {
            memory::place_pool(&mut program, profile, pool_cores);
            memory::place_weights(&mut program, profile, cores - pool_cores).is_ok()
        } else {
            false
        };
        if !placed {
            if options.allow_spill && spilled < spill_order.len() {
                spilled = next_spill(
                    &program,
                    &layers,
                    &spill_order,
                    spilled,
                    profile,
                    pool_cores,
                );
                continue;
            }
            return Err(Error::DoesNotFit(Box::new(fit_error(
                &program,
                assignment,
                expert_format,
                options,
                profile,
            ))));
        }
        let lpddr = memory::place_lpddr(&mut program);
        if lpddr > profile.memory.lpddr_bytes {
            return Err(Error::DoesNotFit(Box::new(FitError {
                advice: format!(
                    "LPDDR holds {} but the streamed weights need {}: use more cards or a smaller format",
                    human_bytes(profile.memory.lpddr_bytes),
                    human_bytes(lpddr)
                ),
                ..fit_error(&program, assignment, expert_format, options, profile)
            })));
        }
        let report = sanitizer::sanitize(&program);
        if !report.findings.is_empty() {
            return Err(Error::Sanitizer {
                card: assignment.card,
                findings: report.findings,
            });
        }
        return Ok(Compiled {
            program,
            sanitizer: report,
        });
    }
}

/// Compiles every card of a deployment placed by [`plan_placement`]: one result per card
/// (a card that does not fit does not stop the others, so a report can show them all).
pub fn compile_deployment(
    config: &ModelConfig,
    stored: &StoredFormats,
    placement: &PlacementOptions,
    options: &CompileOptions,
    profile: &HardwareProfile,
) -> Result<Vec<Result<Compiled>>> {
    let plan = plan_placement(config, placement)?;
    Ok(plan
        .iter()
        .map(|a| compile(config, stored, a, options, profile))
        .collect())
}

/// How many matrices to stream next: enough to cover the SRAM deficit (at least one more).
fn next_spill(
    program: &Program,
    layers: &[Vec<tiling::MatrixPlan>],
    order: &[(usize, usize)],
    spilled: usize,
    profile: &HardwareProfile,
    pool_cores: usize,
) -> usize {
    let capacity =
        profile.core_bytes() * (profile.hierarchy.cores().saturating_sub(pool_cores)) as u64;
    let resident: u64 = program
        .regions
        .iter()
        .filter(|r| r.memory == MemoryKind::Sram && r.kind.is_resident())
        .map(|r| r.bytes.next_multiple_of(memory::ALIGN))
        .sum();
    let mut deficit = resident.saturating_sub(capacity);
    let mut n = spilled;
    loop {
        let (l, rank) = order[n];
        let bytes = layers[l][rank].bytes();
        n += 1;
        if bytes >= deficit || n == order.len() {
            return n;
        }
        deficit -= bytes;
    }
}

fn fit_error(
    program: &Program,
    assignment: &CardAssignment,
    format: TileFormat,
    options: &CompileOptions,
    profile: &HardwareProfile,
) -> FitError {
    let needed = crate::report::sram_use(program);
    let needed_bytes = crate::report::sram_needed(program);
    let sram = profile.memory.sram_bytes;
    let mut advice =
        String::from("Use more cards, --allow-spill to stream what does not fit from LPDDR");
    if format != TileFormat::Mxfp4 {
        advice.push_str(", or a smaller format (--format mxfp4)");
    }
    if options.max_tokens > 64 {
        advice.push_str(", or a smaller --max-tokens");
    }
    advice.push('.');
    FitError {
        card: assignment.card,
        cards: assignment.cards,
        needed,
        needed_bytes,
        sram_bytes: sram,
        format,
        allow_spill: options.allow_spill,
        advice,
    }
}

/// Lowers the share to an unplaced program.
fn lower(
    config: &ModelConfig,
    assignment: &CardAssignment,
    options: &CompileOptions,
    profile: &HardwareProfile,
    layers: &[Vec<tiling::MatrixPlan>],
    lm: Option<&(tiling::MatrixPlan, Vec<crate::assignment::Span>)>,
    streamed: &dyn Fn(usize, usize) -> bool,
) -> Program {
    let top_k = config.moe.map_or(1, |m| m.top_k);
    let activation = config.moe.map_or(ActivationSpec::SwiGlu, |m| {
        ActivationSpec::from(m.activation)
    });
    let mut b = emit::Builder::new(options.max_tokens, config.hidden_size, top_k, activation);
    let mut layer_programs = Vec::with_capacity(layers.len());
    for (l, plans) in layers.iter().enumerate() {
        let ids: Vec<u32> = plans
            .iter()
            .map(|p| b.add_matrix(p, streamed(l, p.rank_in_layer)))
            .collect();
        let start = b.instructions.len();
        let pairs: Vec<(u32, u32)> = ids.chunks_exact(2).map(|c| (c[0], c[1])).collect();
        let (kind, input, slots, output) = match &assignment.layers[l] {
            LayerShare::Moe { experts } => {
                let (x, s, out) = b.moe_layer(l, experts, &pairs);
                (
                    LayerKind::Moe {
                        experts: experts.clone(),
                        matrices: pairs,
                    },
                    x,
                    Some(s),
                    out,
                )
            }
            LayerShare::Dense { columns } => {
                let m = pairs.first().copied();
                let (x, out) = b.dense_layer(l, m);
                (
                    LayerKind::Dense {
                        columns: *columns,
                        matrices: m,
                    },
                    x,
                    None,
                    out,
                )
            }
        };
        let instructions = crate::assignment::Span::new(start, b.instructions.len());
        layer_programs.push(LayerProgram {
            kind,
            instructions,
            input,
            slots,
            output,
        });
    }
    let lm_head = lm.map(|(plan, chunks)| {
        let matrix = b.add_matrix(plan, true);
        let start = b.instructions.len();
        let (input, logits) = b.lm_head(matrix, chunks, options.candidates);
        LmHeadProgram {
            rows: assignment.lm_head_rows,
            matrix,
            instructions: crate::assignment::Span::new(start, b.instructions.len()),
            input,
            logits,
        }
    });
    Program {
        assignment: assignment.clone(),
        profile: profile.clone(),
        hidden: config.hidden_size,
        top_k,
        num_experts: config.moe.map_or(0, |m| m.num_experts),
        max_tokens: options.max_tokens,
        expert_activation: activation,
        regions: b.regions,
        matrices: b.matrices,
        instructions: b.instructions,
        layers: layer_programs,
        lm_head,
        pool_base: 0,
        pool_bytes: 0,
    }
}

/// SRAM bytes of region kind `kind` in `program` (resident regions; see [`crate::report`]).
pub fn resident_sram(program: &Program, kind: RegionKind) -> u64 {
    program.resident_bytes(kind, MemoryKind::Sram)
}
