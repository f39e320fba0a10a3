//! The planner: what a deployment fits and how fast it runs on real hardware.
//!
//! [`plan`] is the I/O-free core: from the model's shape, the deployment and the three profiles
//! (attention device, cards, network) it compiles every card's share with corsair-ffn's compiler
//! (SRAM by region kind, spills), sizes the attention device's memory (weights plus the KV cache
//! of `max_num_seqs` x `max_model_len`), and predicts decode steps, TPOT and throughput with the
//! system model ([`system`]). [`plan_deployment`] is the thin shell that reads the files.

pub mod cards;
pub mod gpu;
pub mod profiles;
mod report;
pub mod seed;
pub mod system;

use corsair_ffn::HardwareProfile;
use corsair_ffn::assignment::{ExpertReplica, PlacementOptions};
use corsair_ffn::compiler::{CompileOptions, StoredFormats, compile_deployment};
use model::ModelConfig;
use serde::{Deserialize, Serialize};

pub use cards::{CardMemory, CardSet};
pub use profiles::{DeviceProfile, NetworkProfile};
pub use system::{StepTime, System};

use crate::deployment::{Deployment, is_path_like};
use crate::error::{Error, Result};
use crate::replication::{self, CardsToFit};

/// Decode steps sampled over the output to average TPOT (the step time is piecewise linear
/// in the context).
const CONTEXT_SAMPLES: usize = 32;

/// The profiles a plan is made with.
#[derive(Debug, Clone)]
pub struct Profiles {
    /// The attention device.
    pub device: DeviceProfile,
    /// The cards.
    pub card: HardwareProfile,
    /// The data plane.
    pub network: NetworkProfile,
}

/// The attention device's memory, per node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttentionMemory {
    /// The device profile.
    pub device: String,
    /// Attention nodes.
    pub nodes: usize,
    /// Weights held (attention, router, embedding; the whole model without cards).
    pub weight_bytes: u64,
    /// KV cache for `max_num_seqs` sequences of `max_model_len` tokens (sliding-window layers
    /// keep their window), or `kv_cache_memory` when that is larger.
    pub kv_bytes: u64,
    /// Kept free for the runtime (profile).
    pub reserved_bytes: u64,
    /// Weights + KV + reserved.
    pub total_bytes: u64,
    /// The device's memory.
    pub available_bytes: u64,
    /// Sequences of `max_model_len` that fit beside the weights (at least `max_num_seqs` when
    /// it fits).
    pub max_sequences_that_fit: u64,
}

/// The predictions.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Predicted {
    /// Mean time per output token of one sequence, ms (the decode step, averaged over the
    /// output's contexts).
    pub tpot_ms: f64,
    /// One decode step at the prompt's context (`input_len`), ms.
    pub step_ms: f64,
    /// Output tokens per second over all sequences: the whole run (prefill, then
    /// `output_len - 1` decode steps) when `output_len > 0`, else one decode step.
    pub output_tokens_per_s: f64,
    /// Output tokens per second of one sequence (1000 / TPOT).
    pub per_user_tokens_per_s: f64,
    /// Prefill of every prompt, ms (0 when `output_len` is 0).
    pub prefill_ms: f64,
    /// Time to the first token (prefill), ms.
    pub ttft_ms: f64,
    /// Where the time of the first decode step goes.
    pub breakdown: StepTime,
}

/// The workload the prediction is for.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PlannedWorkload {
    /// Sequences decoding together over all nodes.
    pub batch: usize,
    /// Prompt tokens.
    pub input_len: usize,
    /// Output tokens (0: one decode step at `input_len`).
    pub output_len: usize,
}

/// A plan: fit and predictions.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// The deployment file.
    pub deployment: String,
    /// The model in words.
    pub model: String,
    /// Cards (0: the attention device alone).
    pub cards: usize,
    /// Whether everything fits.
    pub fits: bool,
    /// Why not, one line each.
    pub problems: Vec<String>,
    /// The operating point.
    pub workload: PlannedWorkload,
    /// The attention device's memory.
    pub attention: AttentionMemory,
    /// Every card's memory.
    pub per_card: Vec<CardMemory>,
    /// Whether the deployment keeps serving when each card alone is lost (one entry per
    /// card; empty without cards).
    #[serde(default)]
    pub card_losses: Vec<CardLoss>,
    /// Whether the cards hold a copy of every expert (`cards.replicate_experts`).
    #[serde(default)]
    pub experts_replicated: bool,
    /// Why (or why not), in words; absent without cards.
    #[serde(default)]
    pub replication: Option<String>,
    /// Predictions (absent when a card's share does not compile).
    pub predicted: Option<Predicted>,
    /// Profile keys fitted on seed figures (`profile: key`).
    pub calibrated: Vec<String>,
    /// Profile keys that are assumptions (`profile: key`).
    pub assumed: Vec<String>,
}

/// What losing one card does to a deployment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CardLoss {
    /// The card.
    pub card: usize,
    /// Whether the others (replicas; the attention node for the LM-head rows) cover it.
    pub survived: bool,
    /// Why not, when not.
    pub reason: Option<String>,
}

/// For each card, whether a node keeps serving without it under `placement`.
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

/// Plans `deployment` for the model `config` (stored formats `stored`) with `profiles`.
pub fn plan(
    deployment: &Deployment,
    config: &ModelConfig,
    stored: &StoredFormats,
    profiles: &Profiles,
) -> Result<Plan> {
    let d = deployment;
    let w = &d.workload;
    let device = &profiles.device;
    let mut problems = Vec::new();
    let whole_model = d.is_monolithic();
    let per_node = w.batch.div_ceil(d.attention.nodes);

    // The attention device.
    let weight_bytes = gpu::weight_bytes(config, whole_model, device);
    let per_seq = gpu::kv_bytes_per_sequence(config, d.attention.max_model_len, device);
    let kv_needed = per_seq * d.attention.max_num_seqs as f64;
    let kv_bytes = kv_needed.max(d.attention.kv_cache_memory.unwrap_or(0) as f64 * 1048576.0);
    let reserved = device.memory.reserved_bytes;
    let total = weight_bytes + kv_bytes + reserved;
    let room = (device.memory.hbm_bytes - weight_bytes - reserved).max(0.0);
    let attention = AttentionMemory {
        device: device.name.clone(),
        nodes: d.attention.nodes,
        weight_bytes: weight_bytes as u64,
        kv_bytes: kv_bytes as u64,
        reserved_bytes: reserved as u64,
        total_bytes: total as u64,
        available_bytes: device.memory.hbm_bytes as u64,
        max_sequences_that_fit: (room / per_seq.max(1.0)) as u64,
    };
    if total > device.memory.hbm_bytes {
        problems.push(format!(
            "the attention device ({}) does not fit: {:.1} GB of weights + {:.1} GB of KV cache \
             ({} sequences x {} tokens) + {:.1} GB reserved > {:.1} GB; lower \
             attention.max_num_seqs or attention.max_model_len (at most {} sequences of this \
             length fit), or add cards",
            device.name,
            weight_bytes / 1e9,
            kv_bytes / 1e9,
            d.attention.max_num_seqs,
            d.attention.max_model_len,
            reserved / 1e9,
            device.memory.hbm_bytes / 1e9,
            attention.max_sequences_that_fit
        ));
    }
    if per_node > d.attention.max_num_seqs {
        problems.push(format!(
            "workload.batch {} puts {per_node} sequences on a node but attention.max_num_seqs is {}",
            w.batch, d.attention.max_num_seqs
        ));
    }
    if w.input_len + w.output_len > d.attention.max_model_len {
        problems.push(format!(
            "workload.input_len + output_len = {} exceeds attention.max_model_len {}",
            w.input_len + w.output_len,
            d.attention.max_model_len
        ));
    }

    // The cards.
    let (per_card, card_set, losses, replicated) = if whole_model {
        (Vec::new(), None, Vec::new(), None)
    } else {
        let options = CompileOptions {
            format: d.model.format,
            max_tokens: d.attention.max_num_batched_tokens.max(per_node),
            allow_spill: d.cards.allow_spill,
            ..CompileOptions::default()
        };
        let listed = d.cards.listed_replicas();
        let choice = replication::choose(
            d.cards.replicate_experts,
            &CardsToFit {
                model: config,
                stored,
                options: &options,
                profile: &profiles.card,
                cards: d.cards.count,
                listed: &listed,
                host_available: None,
            },
        );
        let placement = PlacementOptions {
            cards: d.cards.count,
            replicas: ExpertReplica::placed(listed, choice.every_expert, config),
        };
        let compiled = compile_deployment(config, stored, &placement, &options, &profiles.card)
            .map_err(|source| Error::Cards {
                what: "placing the model on the cards".into(),
                source: Box::new(source),
            })?;
        let losses = card_losses(config, &placement)?;
        let mut per_card = Vec::new();
        let mut programs = Vec::new();
        for (i, c) in compiled.into_iter().enumerate() {
            match c {
                Ok(c) => {
                    per_card.extend(CardSet::memory(std::slice::from_ref(&c)));
                    programs.push(c.program);
                }
                Err(e) => {
                    problems.push(e.to_string());
                    per_card.push(CardMemory::failed(
                        i,
                        profiles.card.memory.sram_bytes,
                        e.to_string(),
                    ));
                }
            }
        }
        let set = (programs.len() == d.cards.count).then(|| CardSet::new(programs));
        (per_card, set, losses, Some(choice))
    };

    let predicted = (whole_model || card_set.is_some()).then(|| {
        let system = System {
            model: config,
            device,
            network: &profiles.network,
            cards: card_set.as_ref(),
            nodes: d.attention.nodes,
            micro_batches: d.overlap.micro_batches.0,
            wire_bytes: d.attention.wire_dtype.size(),
            chunk_tokens: d.attention.max_num_batched_tokens,
            lm_head_candidates: 64,
        };
        predict(&system, w.batch, w.input_len, w.output_len)
    });

    let listed = |name: &str, keys: &[String]| -> Vec<String> {
        keys.iter().map(|k| format!("{name}: {k}")).collect()
    };
    let mut calibrated = listed(&device.name, &device.calibrated);
    calibrated.extend(listed(&profiles.network.name, &profiles.network.calibrated));
    let mut assumed = listed(&device.name, &device.assumed);
    assumed.extend(listed(&profiles.network.name, &profiles.network.assumed));
    if !whole_model {
        assumed.extend(listed(&profiles.card.name, &profiles.card.assumed));
    }
    Ok(Plan {
        deployment: d.source.display().to_string(),
        model: describe(config, d),
        cards: d.cards.count,
        fits: problems.is_empty(),
        problems,
        workload: PlannedWorkload {
            batch: w.batch,
            input_len: w.input_len,
            output_len: w.output_len,
        },
        attention,
        per_card,
        card_losses: losses,
        experts_replicated: replicated.as_ref().is_some_and(|c| c.every_expert),
        replication: replicated.map(|c| c.reason),
        predicted,
        calibrated,
        assumed,
    })
}

/// Predictions for `batch` sequences of `input_len` prompt and `output_len` output tokens.
pub fn predict(
    system: &System<'_>,
    batch: usize,
    input_len: usize,
    output_len: usize,
) -> Predicted {
    let first = system.step(batch, 1, input_len.max(1) as f64);
    let ms = 1e3;
    if output_len == 0 {
        return Predicted {
            tpot_ms: first.seconds * ms,
            step_ms: first.seconds * ms,
            output_tokens_per_s: batch as f64 / first.seconds,
            per_user_tokens_per_s: 1.0 / first.seconds,
            prefill_ms: 0.0,
            ttft_ms: 0.0,
            breakdown: first,
        };
    }
    let samples = CONTEXT_SAMPLES.min(output_len);
    let tpot = (0..samples)
        .map(|i| {
            let ctx = input_len as f64 + (i as f64 + 0.5) * output_len as f64 / samples as f64;
            system.step(batch, 1, ctx).seconds
        })
        .sum::<f64>()
        / samples as f64;
    let prefill = system.prefill_seconds(batch, input_len);
    // The prefill gives the first token; each further token is one decode step.
    let total = prefill + (output_len - 1) as f64 * tpot;
    Predicted {
        tpot_ms: tpot * ms,
        step_ms: first.seconds * ms,
        output_tokens_per_s: (batch * output_len) as f64 / total,
        per_user_tokens_per_s: 1.0 / tpot,
        prefill_ms: prefill * ms,
        ttft_ms: prefill * ms,
        breakdown: first,
    }
}

fn describe(config: &ModelConfig, d: &Deployment) -> String {
    let what = match (&d.model.shape, &d.model.path) {
        (Some(s), _) => format!("shape {s}"),
        (None, Some(p)) => p.display().to_string(),
        (None, None) => crate::deployment::BUNDLED_MODEL.to_string(),
    };
    format!(
        "{what} ({}, {} layers, hidden {}{}, vocab {}, {} weights on the cards)",
        config.family,
        config.num_layers(),
        config.hidden_size,
        config.moe.map_or(String::new(), |m| format!(
            ", {} experts top-{}",
            m.num_experts, m.top_k
        )),
        config.vocab_size,
        d.model.format
    )
}

/// Reads a profile named in a deployment: a built-in name or a TOML file.
fn load_profile<T>(
    value: &str,
    key: &str,
    builtin: impl Fn(&str) -> Option<Result<T>>,
    parse: impl Fn(&str) -> Result<T>,
) -> Result<T> {
    if !is_path_like(value)
        && let Some(p) = builtin(value)
    {
        return p.map_err(|e| e.within(format!("built-in profile `{value}`")));
    }
    let text = std::fs::read_to_string(value).map_err(Error::system(format!(
        "`{key} = \"{value}\"` is neither a built-in profile nor a readable file"
    )))?;
    parse(&text).map_err(|e| e.within(format!("`{key}` {value}")))
}

/// Reads the profiles a deployment names.
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

/// The shell: reads the model's config and the profiles a deployment names, then plans it.
pub fn plan_deployment(d: &Deployment) -> Result<Plan> {
    let (text, path) = d.model_config_text()?;
    let config = ModelConfig::from_json(&text, &path)?;
    if let Some(family) = d.model.family
        && family != config.family
    {
        return Err(Error::Config(format!(
            "`model.family = \"{family}\"` but {} is a {} model",
            path.display(),
            config.family
        )));
    }
    let stored =
        StoredFormats::from_config_json(&text, &config).map_err(|source| Error::Cards {
            what: path.display().to_string(),
            source: Box::new(source),
        })?;
    let profiles = load_profiles(d)?;
    plan(d, &config, &stored, &profiles).map_err(|e| e.within(d.source.display().to_string()))
}

#[cfg(test)]
mod tests;
