//! The planner's shell: a deployment file as the planner's [`Target`], its profiles read, the
//! plan made by the `planner` crate, and the card losses the attention node's rules survive.

pub mod seed;

use corsair_ffn::assignment::PlacementOptions;
use corsair_ffn::compiler::StoredFormats;
use model::ModelConfig;
use planner::{
    AttentionTarget, CardLoss, CardsTarget, DeviceProfile, NetworkProfile, Target, load_profile,
};
pub use planner::{Plan, Profiles};

use crate::deployment::{BUNDLED_MODEL, Deployment};
use crate::error::{Error, Result};

/// What the planner needs to know of `d`.
pub fn target(d: &Deployment) -> Target {
    let model_name = match (&d.model.shape, &d.model.path) {
        (Some(s), _) => format!("shape {s}"),
        (None, Some(p)) => p.display().to_string(),
        (None, None) => BUNDLED_MODEL.to_string(),
    };
    let a = &d.attention;
    Target {
        source: d.source.display().to_string(),
        model_name,
        attention: AttentionTarget {
            nodes: a.nodes,
            max_num_seqs: a.max_num_seqs,
            max_model_len: a.max_model_len,
            kv_cache_memory_mib: a.kv_cache_memory,
            max_num_batched_tokens: a.max_num_batched_tokens,
            wire_bytes: a.wire_dtype.size(),
        },
        cards: CardsTarget {
            count: d.cards.count,
            format: d.model.format,
            allow_spill: d.cards.allow_spill,
            replicas: d.cards.listed_replicas(),
            replicate_experts: d.cards.replicate_experts,
            groups: d.cards.groups,
        },
        micro_batches: d.overlap.micro_batches.0,
        workload: planner::PlannedWorkload {
            batch: d.workload.batch,
            input_len: d.workload.input_len,
            output_len: d.workload.output_len,
        },
    }
}

/// Reads the profiles a deployment names (built-in names or files).
pub fn load_profiles(d: &Deployment) -> Result<Profiles> {
    Ok(Profiles {
        device: load_profile(
            &d.attention.profile,
            "attention.profile",
            DeviceProfile::builtin,
            DeviceProfile::from_toml,
        )?,
        card: d.card_profile()?,
        network: load_profile(
            &d.transport.profile,
            "transport.profile",
            NetworkProfile::builtin,
            NetworkProfile::from_toml,
        )?,
    })
}

/// For each card, whether a node keeps serving without it under `placement` (its experts
/// covered by replicas, its LM-head rows by the attention node).
pub fn card_losses(config: &ModelConfig, placement: &PlacementOptions) -> Result<Vec<CardLoss>> {
    let assignments =
        corsair_ffn::plan_placement(config, placement).map_err(|source| Error::Cards {
            what: "placing the model on the cards".into(),
            source: Box::new(source),
        })?;
    let layout = crate::cluster::card_layout(config, &assignments)?;
    Ok((0..placement.cards)
        .map(|card| {
            let outcome = layout.coverage(&[card]);
            CardLoss {
                card,
                survived: outcome.is_ok(),
                reason: outcome.err().map(|(_, why)| why),
            }
        })
        .collect())
}

/// Plans `d` for the model `config` (stored formats `stored`) with `profiles`, card losses
/// included.
pub fn plan(
    d: &Deployment,
    config: &ModelConfig,
    stored: &StoredFormats,
    profiles: &Profiles,
) -> Result<Plan> {
    let t = target(d);
    let mut plan = planner::plan(&t, config, stored, profiles)?;
    if !t.is_monolithic() {
        let cards = planner::compile_cards(&t, config, stored, &profiles.card)?;
        plan.card_losses = card_losses(config, &cards.placement)?;
    }
    Ok(plan)
}

/// The model's configuration and stored formats of `d` (family checked).
pub fn model_shape(d: &Deployment) -> Result<(ModelConfig, StoredFormats)> {
    let (text, path) = d.model_config_text()?;
    let config = d.model_config()?;
    let stored =
        StoredFormats::from_config_json(&text, &config).map_err(|source| Error::Cards {
            what: path.display().to_string(),
            source: Box::new(source),
        })?;
    Ok((config, stored))
}

/// `afd plan --expert-load FILE`: `d`'s experts placed by the load a routing record holds
/// (`afd serve --record-routing` or `afd emulate --record-routing`), with `redundant` extra
/// copies per MoE layer.
pub fn plan_deployment_by_load(
    d: &Deployment,
    record: &std::path::Path,
    redundant: usize,
) -> Result<planner::LoadPlan> {
    let (config, stored) = model_shape(d)?;
    let profiles = load_profiles(d)?;
    let load = crate::load_placement::read_load(&config, record)?;
    planner::plan_by_load(
        &target(d),
        &config,
        &stored,
        &profiles.card,
        &load,
        redundant,
        &record.display().to_string(),
    )
    .map_err(|e| Error::from(e).within(d.source.display().to_string()))
}

/// The shell: reads the model's config and the profiles a deployment names, then plans it.
pub fn plan_deployment(d: &Deployment) -> Result<Plan> {
    let (config, stored) = model_shape(d)?;
    let profiles = load_profiles(d)?;
    plan(d, &config, &stored, &profiles).map_err(|e| e.within(d.source.display().to_string()))
}

#[cfg(test)]
mod tests;
