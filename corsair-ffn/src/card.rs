//! [`Card`]: a compiled program, its bound weights, the executor and the card's statistics;
//! the methods the card service calls.

use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::executor::{Call, ExecOptions, Executor, Produced, Slot};
use crate::lm_head::{CandidateOptions, LmProposal, RowSampling};
use crate::perf::{self, LayerLoad};
use crate::program::{LayerKind, Program};
use crate::report::{MemoryUse, lpddr_use, sram_needed, sram_use};
use crate::sanitizer::sanitize;
use crate::weights::{WeightSource, bind};

/// How a card runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CardOptions {
    /// Executor threads and kernel.
    pub exec: ExecOptions,
    /// LM-head candidates per token.
    pub candidates: CandidateOptions,
}

/// Counters of one layer (or of the LM head).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct LayerStats {
    /// Calls.
    pub calls: u64,
    /// Tokens received.
    pub tokens: u64,
    /// Rows computed by experts (MoE layers).
    pub expert_rows: u64,
    /// Wall-clock seconds on this CPU.
    pub wall_seconds: f64,
    /// Seconds the performance model gives the card for the same calls.
    pub modeled_seconds: f64,
}

/// What a card reports.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CardStats {
    /// The card.
    pub card: usize,
    /// Per decoder layer.
    pub layers: Vec<LayerStats>,
    /// The LM head.
    pub lm_head: LayerStats,
    /// SRAM per card.
    pub sram_capacity: u64,
    /// SRAM used by the program.
    pub sram_used: u64,
    /// SRAM by region kind.
    pub sram: Vec<MemoryUse>,
    /// LPDDR by region kind.
    pub lpddr: Vec<MemoryUse>,
}

/// One simulated Corsair card running its program.
pub struct Card {
    exec: Executor,
    options: CardOptions,
    stats: CardStats,
}

impl Card {
    /// Checks `program` with the sanitizer, writes its weights from `weights` into the card's
    /// memories, and starts its executor.
    pub fn new(program: Program, weights: &dyn WeightSource, options: CardOptions) -> Result<Self> {
        let report = sanitize(&program);
        if !report.is_clean() {
            return Err(Error::Sanitizer {
                card: program.assignment.card,
                findings: report.findings,
            });
        }
        let memory = bind(&program, weights)?;
        let stats = CardStats {
            card: program.assignment.card,
            layers: vec![LayerStats::default(); program.layers.len()],
            lm_head: LayerStats::default(),
            sram_capacity: program.profile.memory.sram_bytes,
            sram_used: sram_needed(&program),
            sram: sram_use(&program),
            lpddr: lpddr_use(&program),
        };
        Ok(Card {
            exec: Executor::new(program, memory, options.exec)?,
            options,
            stats,
        })
    }

    /// The program.
    pub fn program(&self) -> &Program {
        &self.exec.program
    }

    /// Statistics so far.
    pub fn stats(&self) -> CardStats {
        self.stats.clone()
    }

    fn tokens(&self, x: &[f32]) -> Result<usize> {
        let h = self.exec.program.hidden;
        if !x.len().is_multiple_of(h) {
            return Err(Error::Request(format!(
                "{} values is not a whole number of rows of {h}",
                x.len()
            )));
        }
        let n = x.len() / h;
        if n > self.exec.program.max_tokens {
            return Err(Error::Request(format!(
                "{n} tokens in one call, but the program was compiled for at most {}; recompile with a larger --max-tokens or split the step",
                self.exec.program.max_tokens
            )));
        }
        Ok(n)
    }

    /// A MoE layer: `rows` holds `n` hidden states (`[n, hidden]`), `slots` holds `top_k` slots
    /// per token (experts of this card, or [`Slot::EMPTY`]). Returns the `[n, hidden]` partial
    /// sums: per token, the sum over its local slots, in slot order, of weight * expert output.
    pub fn moe_layer(&mut self, layer: usize, rows: &[f32], slots: &[Slot]) -> Result<Vec<f32>> {
        let n = self.tokens(rows)?;
        let p = &self.exec.program;
        let Some(LayerKind::Moe { experts, .. }) = p.layers.get(layer).map(|l| &l.kind) else {
            return Err(Error::Request(format!(
                "layer {layer} is not a MoE layer of this card's program"
            )));
        };
        if slots.len() != n * p.top_k {
            return Err(Error::Request(format!(
                "{} slots for {n} tokens; expected {} per token",
                slots.len(),
                p.top_k
            )));
        }
        if let Some(s) = slots
            .iter()
            .find(|s| *s != &Slot::EMPTY && !experts.contains(&s.expert))
        {
            return Err(Error::Request(format!(
                "layer {layer}: expert {} is not on card {} (it holds {experts:?})",
                s.expert, p.assignment.card
            )));
        }
        for (t, token) in slots.chunks_exact(p.top_k).enumerate() {
            for (j, s) in token.iter().enumerate() {
                if *s != Slot::EMPTY && token[..j].iter().any(|o| o.expert == s.expert) {
                    return Err(Error::Request(format!(
                        "token {t} lists expert {} twice; a token's experts must be distinct",
                        s.expert
                    )));
                }
            }
        }
        let call = Call {
            tokens: n,
            x: rows,
            slots: Some(slots),
            sampling: &[],
            candidates: self.options.candidates,
        };
        Ok(self.run_layer(layer, &call)?.sent)
    }

    /// A dense layer slice: `[n, hidden]` in, `[n, hidden]` partial sum out.
    pub fn dense_layer(&mut self, layer: usize, x: &[f32]) -> Result<Vec<f32>> {
        let n = self.tokens(x)?;
        if !matches!(
            self.exec.program.layers.get(layer).map(|l| &l.kind),
            Some(LayerKind::Dense { .. })
        ) {
            return Err(Error::Request(format!(
                "layer {layer} is not a dense layer of this card's program"
            )));
        }
        let call = Call {
            tokens: n,
            x,
            slots: None,
            sampling: &[],
            candidates: self.options.candidates,
        };
        Ok(self.run_layer(layer, &call)?.sent)
    }

    fn run_layer(&mut self, layer: usize, call: &Call<'_>) -> Result<Produced> {
        let span = self.exec.program.layers[layer].instructions;
        let start = Instant::now();
        let produced = if call.tokens == 0 {
            Produced::default()
        } else {
            self.exec.run(span, call)?
        };
        let load = LayerLoad {
            tokens: call.tokens,
            expert_rows: produced.expert_rows.clone(),
        };
        let modeled = if call.tokens == 0 {
            0.0
        } else {
            perf::layer_time(&self.exec.program, layer, &load).seconds
        };
        let s = &mut self.stats.layers[layer];
        s.calls += 1;
        s.tokens += call.tokens as u64;
        s.expert_rows += produced.expert_rows.iter().sum::<usize>() as u64;
        s.wall_seconds += start.elapsed().as_secs_f64();
        s.modeled_seconds += modeled;
        Ok(produced)
    }

    /// The LM-head shard: `[n, hidden]` normed hidden states and one sampling row per token in;
    /// one proposal per token out (see [`crate::lm_head`] for what the attention node can merge
    /// exactly).
    pub fn lm_head(&mut self, x: &[f32], rows: &[RowSampling]) -> Result<Vec<LmProposal>> {
        self.lm_head_candidates(x, rows, self.options.candidates.candidates)
    }

    /// [`Self::lm_head`] with at most `candidates` per proposal (fewer than the compiled
    /// default when the rows need fewer, e.g. one for greedy rows without logprobs).
    pub fn lm_head_candidates(
        &mut self,
        x: &[f32],
        rows: &[RowSampling],
        candidates: usize,
    ) -> Result<Vec<LmProposal>> {
        let n = self.tokens(x)?;
        if rows.len() != n {
            return Err(Error::Request(format!(
                "{} sampling rows for {n} tokens",
                rows.len()
            )));
        }
        let Some(lm) = self.exec.program.lm_head.as_ref() else {
            return Err(Error::Request(format!(
                "card {} holds no LM-head rows",
                self.exec.program.assignment.card
            )));
        };
        let span = lm.instructions;
        let start = Instant::now();
        let call = Call {
            tokens: n,
            x,
            slots: None,
            sampling: rows,
            candidates: CandidateOptions {
                candidates: candidates.min(self.options.candidates.candidates),
            },
        };
        let produced = if n == 0 {
            Produced::default()
        } else {
            self.exec.run(span, &call)?
        };
        let s = &mut self.stats.lm_head;
        s.calls += 1;
        s.tokens += n as u64;
        s.wall_seconds += start.elapsed().as_secs_f64();
        s.modeled_seconds += perf::lm_head_time(&self.exec.program, n).seconds;
        Ok(produced.proposals)
    }

    /// The shard's full logits `[n, shard rows]` (the fallback when proposals cannot decide).
    pub fn lm_head_logits(&mut self, x: &[f32]) -> Result<Vec<f32>> {
        let n = self.tokens(x)?;
        self.lm_head(x, &vec![RowSampling::default(); n])?;
        self.exec.logits(n)
    }
}
