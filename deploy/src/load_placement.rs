//! Serving with the experts placed by measured load (`[cards] placement = "load"`, `afd serve
//! --placement load`): the routing record is read when the deployment starts, and every card
//! loads the share the planner's EPLB placement gives it ([`planner::balance`]), the same the
//! `afd plan --expert-load` report shows.

use std::path::{Path, PathBuf};

use corsair_ffn::{CardAssignment, PlacementOptions, plan_placement};
use model::ModelConfig;
use planner::balance::{BalancedPlacement, ExpertLoad};

use crate::error::{Error, Result};

/// Where the load comes from and how many extra copies to place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadPlacement {
    /// A routing record (`afd serve --record-routing`, `afd emulate --record-routing`).
    pub record: PathBuf,
    /// Extra copies per MoE layer beyond one of each expert (vLLM's `num_redundant_experts`).
    pub num_redundant_experts: usize,
    /// Equal groups of cards each expert's copies stay inside (0 or 1: one group).
    pub card_groups: usize,
}

/// The measured load of `record`, checked against `model`'s shape.
pub fn read_load(model: &ModelConfig, record: &Path) -> Result<ExpertLoad> {
    let counts = emulate::record::RoutingCounts::read(record)
        .and_then(|c| {
            let experts = model.moe.map_or(0, |m| m.num_experts);
            c.check_shape(model.num_layers(), experts, record)?;
            Ok(c)
        })
        .map_err(|e| Error::Config(e.to_string()))?;
    Ok(ExpertLoad {
        layers: (0..counts.layers).map(|l| counts.totals(l)).collect(),
    })
}

/// Every card's share on `cards` cards placed by `load`, with the placement (its balancedness
/// before and after) for the log. The shares replace the contiguous placement's experts; its
/// dense columns and LM-head rows stay.
pub fn assignments_by_load(
    model: &ModelConfig,
    cards: usize,
    load: &LoadPlacement,
) -> Result<(Vec<CardAssignment>, BalancedPlacement)> {
    let measured = read_load(model, &load.record)?;
    let contiguous = plan_placement(
        model,
        &PlacementOptions {
            cards,
            replicas: Vec::new(),
        },
    )?;
    let placed = planner::balance::balance(
        model,
        &measured,
        &contiguous,
        load.num_redundant_experts,
        load.card_groups,
    )
    .map_err(|e| {
        Error::Config(format!(
            "placing the experts by the load in {}: {e}",
            load.record.display()
        ))
    })?;
    Ok((placed.assignments(&contiguous), placed))
}
