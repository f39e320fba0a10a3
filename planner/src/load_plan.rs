//! `afd plan --expert-load FILE`: a deployment's experts placed by a measured load
//! ([`crate::balance`]), compiled to see that each card's share fits, and the cards' modeled
//! decode step under that load with the deployment's placement and with the new one.

use corsair_ffn::HardwareProfile;
use corsair_ffn::compiler::{StoredFormats, compile};
use model::ModelConfig;
use serde::Serialize;

use crate::balance::{self, BalancedPlacement, ExpertLoad};
use crate::error::{Error, Result};
use crate::{CardMemory, CardSet, Target, compile_cards};

/// The placement by load of a deployment, against its own.
#[derive(Debug, Clone, Serialize)]
pub struct LoadPlan {
    /// Where the load came from (a routing record's path).
    pub expert_load: String,
    /// The placement and its balancedness before and after.
    #[serde(flatten)]
    pub placement: BalancedPlacement,
    /// Tokens of the decode step the modeled times are for (one attention node's batch, one
    /// micro-batch).
    pub tokens: usize,
    /// The cards' modeled time per decode step under the load with the deployment's placement
    /// (ms; per MoE layer the slowest card in expectation over routings drawn from the load).
    pub cards_step_ms_before: Option<f64>,
    /// The same with the placement by load (ms).
    pub cards_step_ms_after: Option<f64>,
    /// Each card's memory with the placement by load (a share that does not fit says why).
    pub cards: Vec<CardMemory>,
    /// Whether every card's share fits.
    pub fits: bool,
    /// Why not, one line each.
    pub problems: Vec<String>,
}

/// Places `target`'s experts by `load` with `redundant` extra copies per MoE layer (see
/// [`crate::balance`]); `source` names the load in the report.
pub fn plan_by_load(
    target: &Target,
    config: &ModelConfig,
    stored: &StoredFormats,
    card: &HardwareProfile,
    load: &ExpertLoad,
    redundant: usize,
    source: &str,
) -> Result<LoadPlan> {
    if target.is_monolithic() || config.moe.is_none() {
        return Err(Error::Config(
            "placement by load needs cards and a model with experts".into(),
        ));
    }
    let current = compile_cards(target, config, stored, card)?;
    let default =
        corsair_ffn::plan_placement(config, &current.placement).map_err(|source| Error::Cards {
            what: "placing the model on the cards".into(),
            source: Box::new(source),
        })?;
    let placement = balance::balance(config, load, &default, redundant, target.cards.groups)?;
    let options = target.compile_options();
    let mut cards = Vec::new();
    let mut programs = Vec::new();
    let mut problems = Vec::new();
    for share in placement.assignments(&default) {
        match compile(config, stored, &share, &options, card) {
            Ok(c) => {
                cards.extend(CardSet::memory(std::slice::from_ref(&c)));
                programs.push(c.program);
            }
            Err(e) => {
                problems.push(format!("card {}: {e}", share.card));
                cards.push(CardMemory::failed(
                    share.card,
                    card.memory.sram_bytes,
                    e.to_string(),
                ));
            }
        }
    }
    let tokens = target
        .workload
        .batch
        .div_ceil(target.attention.nodes.max(1))
        .max(1);
    let ms = |set: &CardSet| balance::cards_step_seconds(set, load, tokens) * 1e3;
    let after = (programs.len() == default.len()).then(|| ms(&CardSet::new(programs)));
    Ok(LoadPlan {
        expert_load: source.to_string(),
        cards_step_ms_before: current.set.as_ref().map(ms),
        cards_step_ms_after: after,
        placement,
        tokens,
        fits: problems.is_empty(),
        cards,
        problems,
    })
}

impl std::fmt::Display for LoadPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let p = &self.placement;
        let worst = |xs: &[f64]| xs.iter().copied().fold(1.0, f64::min);
        writeln!(
            f,
            "Placement by load ({}; {} extra copies per MoE layer on {} cards)",
            self.expert_load, p.redundant_experts, p.cards
        )?;
        writeln!(
            f,
            "  balancedness (mean card load / largest, per MoE layer): {:.3} mean, {:.3} worst \
             layer with the deployment's placement; {:.3} mean, {:.3} worst by load",
            p.mean_before(),
            worst(&p.before),
            p.mean_after(),
            worst(&p.after)
        )?;
        match (self.cards_step_ms_before, self.cards_step_ms_after) {
            (Some(before), Some(after)) => writeln!(
                f,
                "  the cards' modeled decode step under this load ({}): {before:.3} ms with the \
                 deployment's placement, {after:.3} ms by load ({:.2}x)",
                if self.tokens == 1 {
                    "one token".to_string()
                } else {
                    format!("{} tokens", self.tokens)
                },
                after / before
            )?,
            _ => writeln!(
                f,
                "  the cards' modeled decode step: not computed (a share does not compile)"
            )?,
        }
        if self.fits {
            let most = self
                .cards
                .iter()
                .map(|c| c.sram_bytes_needed as f64 / c.sram_bytes_available.max(1) as f64)
                .fold(0.0, f64::max);
            let spilled: usize = self.cards.iter().map(|c| c.spilled_matrices).sum();
            writeln!(
                f,
                "  every card's share fits (the fullest card uses {:.0}% of its SRAM{})",
                most * 100.0,
                if spilled > 0 {
                    format!("; {spilled} matrices stream from LPDDR")
                } else {
                    String::new()
                }
            )
        } else {
            writeln!(f, "  does not fit: {}", self.problems.join("; "))
        }
    }
}
