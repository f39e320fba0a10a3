//! What a compiled program uses and how fast it is modeled to run, as plain data (the card's
//! stats, `afd compile`, the planner).

use serde::{Deserialize, Serialize};

use crate::assignment::LayerShare;
use crate::compiler::Compiled;
use crate::perf::{self, StepTime};
use crate::program::{Lifetime, MemoryKind, Program, RegionKind};
use crate::sanitizer::SanitizerReport;

/// Bytes used by one kind of region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryUse {
    /// The kind.
    pub kind: RegionKind,
    /// Bytes: the sum for resident kinds, the peak of live bytes for transient kinds.
    pub bytes: u64,
}

/// `1.27 GB`-style sizes (decimal units).
pub fn human_bytes(b: u64) -> String {
    let b = b as f64;
    if b >= 1e9 {
        format!("{:.2} GB", b / 1e9)
    } else if b >= 1e6 {
        format!("{:.1} MB", b / 1e6)
    } else if b >= 1e3 {
        format!("{:.1} KB", b / 1e3)
    } else {
        format!("{b} B")
    }
}

fn use_in(program: &Program, memory: MemoryKind) -> Vec<MemoryUse> {
    RegionKind::ALL
        .iter()
        .map(|&kind| {
            let regions = program
                .regions
                .iter()
                .filter(|r| r.kind == kind && r.memory == memory);
            let bytes = if kind.is_resident() {
                regions.map(|r| r.bytes).sum()
            } else {
                // Peak of simultaneously live bytes of this kind.
                let mut events: Vec<(u32, i64)> = Vec::new();
                for r in regions {
                    if let Lifetime::Transient { first, last } = r.lifetime {
                        events.push((first, r.bytes as i64));
                        events.push((last + 1, -(r.bytes as i64)));
                    }
                }
                events.sort();
                let (mut live, mut peak) = (0i64, 0i64);
                for (_, d) in events {
                    live += d;
                    peak = peak.max(live);
                }
                peak as u64
            };
            MemoryUse { kind, bytes }
        })
        .filter(|u| u.bytes > 0)
        .collect()
}

/// SRAM use by region kind.
pub fn sram_use(program: &Program) -> Vec<MemoryUse> {
    use_in(program, MemoryKind::Sram)
}

/// LPDDR use by region kind.
pub fn lpddr_use(program: &Program) -> Vec<MemoryUse> {
    use_in(program, MemoryKind::Lpddr)
}

/// SRAM the program needs: resident regions plus the transient pool.
pub fn sram_needed(program: &Program) -> u64 {
    program
        .regions
        .iter()
        .filter(|r| r.memory == MemoryKind::Sram && r.kind.is_resident())
        .map(|r| r.bytes)
        .sum::<u64>()
        + program.pool_bytes
}

/// Everything `afd compile` prints about one card.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CardSummary {
    /// The card.
    pub card: usize,
    /// Cards in the deployment.
    pub cards: usize,
    /// The share in words.
    pub share: String,
    /// Weight matrices.
    pub matrices: usize,
    /// Weight tiles.
    pub tiles: usize,
    /// Cores holding weights.
    pub weight_cores: usize,
    /// Regions.
    pub regions: usize,
    /// Instructions.
    pub instructions: usize,
    /// SRAM per card.
    pub sram_capacity: u64,
    /// SRAM used (resident + transient pool).
    pub sram_used: u64,
    /// Transient pool.
    pub pool_bytes: u64,
    /// SRAM by kind.
    pub sram: Vec<MemoryUse>,
    /// LPDDR by kind.
    pub lpddr: Vec<MemoryUse>,
    /// Matrices streamed from LPDDR because they did not fit.
    pub spilled: Vec<String>,
    /// Their bytes.
    pub spilled_bytes: u64,
    /// Modeled step at 1 token.
    pub batch_one: StepTime,
    /// Modeled step at the largest batch.
    pub batch_max: StepTime,
    /// The sanitizer's counts (findings are empty: compilation fails otherwise).
    pub sanitizer: SanitizerReport,
}

/// Summarizes a compiled program.
pub fn summarize(compiled: &Compiled) -> CardSummary {
    let p = &compiled.program;
    let a = &p.assignment;
    let mut moe = Vec::new();
    let mut dense = Vec::new();
    for (l, share) in a.layers.iter().enumerate() {
        match share {
            LayerShare::Moe { experts } => moe.push((l, experts.clone())),
            LayerShare::Dense { columns } => dense.push((l, *columns)),
        }
    }
    let mut parts = Vec::new();
    if !moe.is_empty() {
        let same = moe.windows(2).all(|w| w[0].1 == w[1].1);
        let first = &moe[0].1;
        if same {
            parts.push(format!(
                "experts {} in each of {} MoE layers",
                ids(first),
                moe.len()
            ));
        } else {
            let total: usize = moe.iter().map(|m| m.1.len()).sum();
            parts.push(format!(
                "{total} experts over {} MoE layers (uneven)",
                moe.len()
            ));
        }
    }
    if !dense.is_empty() {
        parts.push(format!(
            "columns {} of {} dense layers",
            dense[0].1,
            dense.len()
        ));
    }
    parts.push(format!("LM-head rows {}", a.lm_head_rows));
    let spilled: Vec<&crate::program::Matrix> = p
        .matrices
        .iter()
        .filter(|m| m.streamed && m.role != crate::program::MatrixRole::LmHead)
        .collect();
    let mut cores: Vec<u32> = p
        .matrices
        .iter()
        .filter(|m| !m.streamed)
        .flat_map(|m| m.tiles.iter().map(|t| t.core))
        .collect();
    cores.sort_unstable();
    cores.dedup();
    CardSummary {
        card: a.card,
        cards: a.cards,
        share: parts.join("; "),
        matrices: p.matrices.len(),
        tiles: p.matrices.iter().map(|m| m.tiles.len()).sum(),
        weight_cores: cores.len(),
        regions: p.regions.len(),
        instructions: p.instructions.len(),
        sram_capacity: p.profile.memory.sram_bytes,
        sram_used: sram_needed(p),
        pool_bytes: p.pool_bytes,
        sram: sram_use(p),
        lpddr: lpddr_use(p),
        spilled: spilled.iter().map(|m| m.name.clone()).collect(),
        spilled_bytes: spilled.iter().map(|m| m.bytes()).sum(),
        batch_one: perf::step_time(p, 1),
        batch_max: perf::step_time(p, p.max_tokens),
        sanitizer: compiled.sanitizer.clone(),
    }
}

fn ids(experts: &[u32]) -> String {
    match experts {
        [] => "none".into(),
        [a] => a.to_string(),
        _ if experts.windows(2).all(|w| w[1] == w[0] + 1) => {
            format!("{}-{}", experts[0], experts[experts.len() - 1])
        }
        _ => format!("{experts:?}"),
    }
}

fn us(s: f64) -> String {
    format!("{:.2} us", s * 1e6)
}

impl std::fmt::Display for CardSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "card {} of {}: {}", self.card, self.cards, self.share)?;
        writeln!(
            f,
            "  placement: {} matrices in {} tiles on {} cores, {} regions, {} instructions",
            self.matrices, self.tiles, self.weight_cores, self.regions, self.instructions
        )?;
        writeln!(
            f,
            "  SRAM: {} of {} ({:.2}%), transient pool {}",
            human_bytes(self.sram_used),
            human_bytes(self.sram_capacity),
            100.0 * self.sram_used as f64 / self.sram_capacity as f64,
            human_bytes(self.pool_bytes)
        )?;
        for u in &self.sram {
            let note = if u.kind.is_resident() {
                ""
            } else {
                " (peak live)"
            };
            writeln!(
                f,
                "    {:<16} {:>10}{note}",
                u.kind.to_string(),
                human_bytes(u.bytes)
            )?;
        }
        let lpddr: u64 = self.lpddr.iter().map(|u| u.bytes).sum();
        write!(f, "  LPDDR: {}", human_bytes(lpddr))?;
        let parts: Vec<String> = self
            .lpddr
            .iter()
            .map(|u| format!("{} {}", u.kind, human_bytes(u.bytes)))
            .collect();
        writeln!(f, " ({})", parts.join(", "))?;
        if self.spilled.is_empty() {
            writeln!(f, "  spilled to LPDDR: nothing")?;
        } else {
            writeln!(
                f,
                "  spilled to LPDDR: {} matrices, {} (streamed every step: {} at batch 1)",
                self.spilled.len(),
                human_bytes(self.spilled_bytes),
                us(self.batch_one.lpddr_seconds - self.batch_one.lm_head.lpddr_seconds)
            )?;
        }
        for (label, t) in [
            ("batch 1", &self.batch_one),
            (
                &*format!("batch {}", self.batch_max.tokens),
                &self.batch_max,
            ),
        ] {
            let layers = t.layers.len().max(1) as f64;
            let ffn: f64 = t.layers.iter().map(|l| l.seconds).sum();
            let slowest = t.layers.iter().map(|l| l.seconds).fold(0.0, f64::max);
            writeln!(
                f,
                "  modeled {label}: {} per layer (mean; slowest {}), LM head {}, step {} (LPDDR {})",
                us(ffn / layers),
                us(slowest),
                us(t.lm_head.seconds),
                us(t.seconds),
                us(t.lpddr_seconds)
            )?;
        }
        write!(
            f,
            "  sanitizer: clean ({} instructions, {} regions, {} accesses checked)",
            self.sanitizer.instructions, self.sanitizer.regions, self.sanitizer.accesses
        )
    }
}
