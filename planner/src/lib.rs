//! The planner: what a deployment fits and how fast it runs on real hardware.
//!
//! Owns the hardware profiles of the attention device and the network (`planner/profiles/`; the
//! card's is corsair-ffn's), the system performance model ([`system`]: one step of a
//! deployment from the device's kernels ([`gpu`]), the JetStream transfers and the cards'
//! compiled programs ([`cards`])), the choice of replicating experts ([`replication`]), the
//! seed's figures and the fit of the two calibrated constants ([`seed`]), and [`plan`]: from a
//! model's shape, a [`Target`] (what a deployment file says, as the planner sees it) and the
//! profiles, every card's share compiled with corsair-ffn's compiler (SRAM by region kind,
//! spills), the attention device's memory (weights plus the KV cache of `max_num_seqs` x
//! `max_model_len`), and predicted decode steps, TPOT and throughput.
//!
//! Must not: read deployment files, start anything, touch the network or use corsair-ffn's card
//! service (it uses corsair-ffn without its `service` feature): `deploy` reads the
//! files and hands over a [`Target`]; the emulation applies the same step model to the steps
//! its scheduler makes. Everything here is deterministic and free of I/O except reading a
//! profile file named by path ([`load_profile`]).

pub mod balance;
pub mod cards;
pub mod eplb;
pub mod error;
pub mod expected;
pub mod gpu;
pub mod load_plan;
pub mod profiles;
pub mod replication;
mod report;
pub mod seed;
pub mod system;

use corsair_ffn::assignment::{ExpertReplica, PlacementOptions};
use corsair_ffn::compiler::{CompileOptions, StoredFormats, compile_deployment};
use corsair_ffn::{FormatChoice, HardwareProfile};
use model::ModelConfig;
use serde::{Deserialize, Serialize};
use step::MicroBatches;

pub use cards::{CardMemory, CardSet};
pub use error::{Error, Result};
pub use gpu::{Attending, Span, TokenGroup};
pub use load_plan::{LoadPlan, plan_by_load};
pub use profiles::{DeviceProfile, NetworkProfile};
pub use replication::{CardsToFit, ReplicateExperts, ReplicationChoice};
pub use system::{
    CardRows, LayerDetail, MicroBatchLayer, MicroBatchShape, Routing, StepDetail, StepShape,
    StepTime, System,
};

/// Decode steps sampled over the output to average TPOT (the step time is piecewise linear
/// in the context).
const CONTEXT_SAMPLES: usize = 32;

/// A deployment as the planner sees it (deploy maps its files onto this).
#[derive(Debug, Clone, PartialEq)]
pub struct Target {
    /// Where it came from, for messages (a deployment file's path).
    pub source: String,
    /// The model in words: a named shape or a checkpoint folder.
    pub model_name: String,
    /// The attention nodes.
    pub attention: AttentionTarget,
    /// The cards (`count = 0`: the attention device runs the whole model).
    pub cards: CardsTarget,
    /// Micro-batches per step.
    pub micro_batches: MicroBatches,
    /// The operating point to predict.
    pub workload: PlannedWorkload,
}

/// The attention nodes of a [`Target`] (vLLM's names where they exist).
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionTarget {
    /// Attention nodes sharing the cards.
    pub nodes: usize,
    /// Most sequences one node runs in a step.
    pub max_num_seqs: usize,
    /// Longest sequence, prompt plus output.
    pub max_model_len: usize,
    /// KV cache memory of each node in MiB, when set explicitly.
    pub kv_cache_memory_mib: Option<usize>,
    /// Most tokens in one step (prefill chunks; the cards' activation buffers).
    pub max_num_batched_tokens: usize,
    /// Bytes per hidden element on the wire.
    pub wire_bytes: usize,
}

/// The cards of a [`Target`].
#[derive(Debug, Clone, PartialEq)]
pub struct CardsTarget {
    /// How many (0: none).
    pub count: usize,
    /// The weight format on the cards.
    pub format: FormatChoice,
    /// Whether weights that do not fit in SRAM may stream from LPDDR.
    pub allow_spill: bool,
    /// Replicas listed by hand.
    pub replicas: Vec<ExpertReplica>,
    /// Whether every expert gets a second copy.
    pub replicate_experts: ReplicateExperts,
    /// Equal groups of cards behind their own network boundary; a placement by load keeps each
    /// expert's copies inside one (0 or 1: one group).
    pub groups: usize,
}

impl Target {
    /// Whether the attention device runs the whole model (no cards).
    pub fn is_monolithic(&self) -> bool {
        self.cards.count == 0
    }

    /// How the cards compile their shares for this target.
    pub fn compile_options(&self) -> CompileOptions {
        let per_node = self.workload.batch.div_ceil(self.attention.nodes.max(1));
        CompileOptions {
            format: self.cards.format,
            max_tokens: self.attention.max_num_batched_tokens.max(per_node),
            allow_spill: self.cards.allow_spill,
            ..CompileOptions::default()
        }
    }
}

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

/// Every card's share of a [`Target`], compiled.
#[derive(Debug, Clone)]
pub struct CompiledCards {
    /// Every card's memory (a card whose share did not compile says why).
    pub per_card: Vec<CardMemory>,
    /// Every card's program, when every share compiled.
    pub set: Option<CardSet>,
    /// Where the experts went (replicas included).
    pub placement: PlacementOptions,
    /// Whether every expert got a second copy, and why.
    pub replication: ReplicationChoice,
    /// Why a share did not compile, one line each.
    pub problems: Vec<String>,
}

/// Compiles every card's share of `target` (which must have cards) with corsair-ffn's compiler.
pub fn compile_cards(
    target: &Target,
    config: &ModelConfig,
    stored: &StoredFormats,
    card: &HardwareProfile,
) -> Result<CompiledCards> {
    let options = target.compile_options();
    let listed = target.cards.replicas.clone();
    let replication = replication::choose(
        target.cards.replicate_experts,
        &CardsToFit {
            model: config,
            stored,
            options: &options,
            profile: card,
            cards: target.cards.count,
            listed: &listed,
            host_available: None,
        },
    );
    let placement = PlacementOptions {
        cards: target.cards.count,
        replicas: ExpertReplica::placed(listed, replication.every_expert, config),
    };
    let compiled =
        compile_deployment(config, stored, &placement, &options, card).map_err(|source| {
            Error::Cards {
                what: "placing the model on the cards".into(),
                source: Box::new(source),
            }
        })?;
    let mut per_card = Vec::new();
    let mut programs = Vec::new();
    let mut problems = Vec::new();
    for (i, c) in compiled.into_iter().enumerate() {
        match c {
            Ok(c) => {
                per_card.extend(CardSet::memory(std::slice::from_ref(&c)));
                programs.push(c.program);
            }
            Err(e) => {
                problems.push(e.to_string());
                per_card.push(CardMemory::failed(i, card.memory.sram_bytes, e.to_string()));
            }
        }
    }
    let set = (programs.len() == target.cards.count).then(|| CardSet::new(programs));
    Ok(CompiledCards {
        per_card,
        set,
        placement,
        replication,
        problems,
    })
}

/// The system model of `target` with `cards` (`None`: the attention device alone).
pub fn system<'a>(
    target: &Target,
    config: &'a ModelConfig,
    profiles: &'a Profiles,
    cards: Option<&'a CardSet>,
) -> System<'a> {
    System {
        model: config,
        device: &profiles.device,
        network: &profiles.network,
        cards,
        nodes: target.attention.nodes,
        micro_batches: target.micro_batches,
        wire_bytes: target.attention.wire_bytes,
        chunk_tokens: target.attention.max_num_batched_tokens,
        lm_head_candidates: LM_HEAD_CANDIDATES,
    }
}

/// LM-head candidates each card returns per row (the attention node's default).
pub const LM_HEAD_CANDIDATES: usize = 64;

/// Plans `target` for the model `config` (stored formats `stored`) with `profiles`. The plan's
/// `card_losses` are left empty: whether a node survives a card's loss is the attention node's
/// rule, which the caller applies.
pub fn plan(
    target: &Target,
    config: &ModelConfig,
    stored: &StoredFormats,
    profiles: &Profiles,
) -> Result<Plan> {
    let t = target;
    let w = &t.workload;
    let a = &t.attention;
    let device = &profiles.device;
    let mut problems = Vec::new();
    let whole_model = t.is_monolithic();
    let per_node = w.batch.div_ceil(a.nodes.max(1));

    // The attention device.
    let weight_bytes = gpu::weight_bytes(config, whole_model, device);
    let per_seq = gpu::kv_bytes_per_sequence(config, a.max_model_len, device);
    let kv_needed = per_seq * a.max_num_seqs as f64;
    let kv_bytes = kv_needed.max(a.kv_cache_memory_mib.unwrap_or(0) as f64 * 1048576.0);
    let reserved = device.memory.reserved_bytes;
    let total = weight_bytes + kv_bytes + reserved;
    let room = (device.memory.hbm_bytes - weight_bytes - reserved).max(0.0);
    let attention = AttentionMemory {
        device: device.name.clone(),
        nodes: a.nodes,
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
            a.max_num_seqs,
            a.max_model_len,
            reserved / 1e9,
            device.memory.hbm_bytes / 1e9,
            attention.max_sequences_that_fit
        ));
    }
    if per_node > a.max_num_seqs {
        problems.push(format!(
            "workload.batch {} puts {per_node} sequences on a node but attention.max_num_seqs is {}",
            w.batch, a.max_num_seqs
        ));
    }
    if w.input_len + w.output_len > a.max_model_len {
        problems.push(format!(
            "workload.input_len + output_len = {} exceeds attention.max_model_len {}",
            w.input_len + w.output_len,
            a.max_model_len
        ));
    }

    // The cards.
    let cards = if whole_model {
        None
    } else {
        let c = compile_cards(t, config, stored, &profiles.card)?;
        problems.extend(c.problems.iter().cloned());
        Some(c)
    };
    let card_set = cards.as_ref().and_then(|c| c.set.as_ref());
    let predicted = (whole_model || card_set.is_some()).then(|| {
        predict(
            &system(t, config, profiles, card_set),
            w.batch,
            w.input_len,
            w.output_len,
        )
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
    let (per_card, replication) = match cards {
        Some(c) => (c.per_card, Some(c.replication)),
        None => (Vec::new(), None),
    };
    Ok(Plan {
        deployment: t.source.clone(),
        model: describe(config, t),
        cards: t.cards.count,
        fits: problems.is_empty(),
        problems,
        workload: *w,
        attention,
        per_card,
        card_losses: Vec::new(),
        experts_replicated: replication.as_ref().is_some_and(|c| c.every_expert),
        replication: replication.map(|c| c.reason),
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

fn describe(config: &ModelConfig, t: &Target) -> String {
    format!(
        "{} ({}, {} layers, hidden {}{}, vocab {}, {} weights on the cards)",
        t.model_name,
        config.family,
        config.num_layers(),
        config.hidden_size,
        config.moe.map_or(String::new(), |m| format!(
            ", {} experts top-{}",
            m.num_experts, m.top_k
        )),
        config.vocab_size,
        t.cards.format
    )
}

/// Reads a profile: a built-in name (`builtin`) or the path of a TOML file (`parse`); `key`
/// names the setting for messages. A value that looks like a path is never taken as a name.
pub fn load_profile<T>(
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
    let text = std::fs::read_to_string(value).map_err(|e| {
        Error::Config(format!(
            "`{key} = \"{value}\"` is neither a built-in profile nor a readable file: {e}"
        ))
    })?;
    parse(&text).map_err(|e| e.within(format!("`{key}` {value}")))
}

/// A named shape of `family` (an `afd synth` preset: `tiny`, `small`, `medium`,
/// `gpt-oss-20b`), as the planner reads it: its configuration and stored weight formats, from
/// the config.json `afd synth --config-only` would write (nothing is written).
pub fn named_shape(family: model::Family, name: &str) -> Result<(ModelConfig, StoredFormats)> {
    let preset = name
        .parse::<model::synth::Preset>()
        .map_err(|e| Error::Config(format!("`{name}` is not a shape: {e}")))?;
    let options = model::synth::SynthOptions {
        family,
        preset,
        format: None,
        seed: 0,
        config_only: true,
    };
    let text = model::synth::config_json_text(&options)?;
    let config = ModelConfig::from_json(&text, std::path::Path::new("config.json"))?;
    let stored =
        StoredFormats::from_config_json(&text, &config).map_err(|source| Error::Cards {
            what: format!("the shape {family} {name}"),
            source: Box::new(source),
        })?;
    Ok((config, stored))
}

/// Whether a profile setting names a file rather than a built-in profile.
pub fn is_path_like(s: &str) -> bool {
    s.contains('/') || s.contains('\\') || s.ends_with(".toml")
}

#[cfg(test)]
mod tests;
