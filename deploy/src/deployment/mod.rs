//! Deployment files: one TOML file says what a deployment is made of (model, attention nodes,
//! cards, transport, overlap, frontend) and, for `afd plan`, the workload to predict.
//!
//! Every key has a default and unknown keys are refused. Relative paths are resolved against
//! the file's folder when it is loaded, so a deployment means the same thing from any working
//! directory. `afd serve`, `afd plan`, `afd up` and `afd k8s` read the same file; command-line
//! flags override single keys.
//!
//! ```toml
//! [model]
//! shape = "gpt-oss-20b"        # or: path = "../../models/afd-tiny-gpt-oss"
//! [attention]
//! profile = "h100"
//! max_num_seqs = 1
//! [cards]
//! count = 8
//! ```

mod sections;

use std::path::{Path, PathBuf};

use gpu_attention::kv_cache::KvCacheConfig;
use model::synth::{Preset, SynthOptions, config_json_text};
use model::{Family, ModelConfig};
use serde::{Deserialize, Serialize};

pub use sections::{
    AttentionSection, CardsSection, MicroBatchSetting, ModelSection, OverlapSection,
    PlacementPolicy, ReplicaSpec, ServerSection, TransportSection, WorkloadSection,
};

use crate::cluster::{ClusterConfig, TransportKind};
use crate::error::{Error, Result};

/// The model bundled in the repository, relative to its root.
pub const BUNDLED_MODEL: &str = "models/afd-tiny-gpt-oss";

/// A whole deployment file.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Deployment {
    /// `[model]`: which model, in which weight format.
    pub model: ModelSection,
    /// `[attention]`: attention nodes, their device and limits.
    pub attention: AttentionSection,
    /// `[cards]`: how many Corsair cards, their profile and placement.
    pub cards: CardsSection,
    /// `[transport]`: the data plane and its TLS material.
    pub transport: TransportSection,
    /// `[overlap]`: micro-batches per step.
    pub overlap: OverlapSection,
    /// `[server]`: the HTTP frontend.
    pub server: ServerSection,
    /// `[workload]`: the operating point `afd plan` predicts.
    pub workload: WorkloadSection,
    /// The folder relative paths were resolved against (the file's folder); not a key.
    #[serde(skip)]
    pub base_dir: PathBuf,
    /// The file this deployment was read from, for messages; not a key.
    #[serde(skip)]
    pub source: PathBuf,
}

/// Where the model's shape (and, for a checkpoint, its weights) comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    /// A checkpoint folder with config.json (and weights).
    Checkpoint(PathBuf),
    /// A named shape of a family, without weights (planning only).
    Shape {
        /// The family.
        family: Family,
        /// The `afd synth` preset.
        preset: Preset,
        /// The preset's name as written.
        name: String,
    },
}

impl Deployment {
    /// Reads and validates a deployment file; relative paths are resolved against its folder.
    pub fn load(path: &Path) -> Result<Deployment> {
        let text = std::fs::read_to_string(path).map_err(Error::system(format!(
            "cannot read the deployment file {}",
            path.display()
        )))?;
        let base = path
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("."));
        let mut d = Self::from_toml(&text, &base)
            .map_err(|e| e.within(format!("deployment file {}", path.display())))?;
        d.source = path.to_path_buf();
        Ok(d)
    }

    /// Parses and validates deployment text; relative paths are resolved against `base_dir`.
    pub fn from_toml(text: &str, base_dir: &Path) -> Result<Deployment> {
        let mut d: Deployment = toml::from_str(text).map_err(|source| Error::Toml {
            what: "not a valid deployment",
            source,
        })?;
        d.base_dir = base_dir.to_path_buf();
        d.source = base_dir.join("<text>");
        d.resolve_paths();
        d.validate()?;
        Ok(d)
    }

    /// This deployment as TOML text (resolved paths included).
    pub fn to_toml(&self) -> Result<String> {
        toml::to_string_pretty(self).map_err(Error::TomlWrite)
    }

    fn resolve_paths(&mut self) {
        let base = self.base_dir.clone();
        let join = |p: &mut PathBuf| {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        };
        if let Some(p) = self.model.path.as_mut() {
            join(p);
        }
        if let Some(p) = self.transport.tls_dir.as_mut() {
            join(p);
        }
        if let Some(p) = self.cards.expert_load.as_mut() {
            join(p);
        }
        for profile in [
            &mut self.attention.profile,
            &mut self.cards.profile,
            &mut self.transport.profile,
        ] {
            if is_path_like(profile) && Path::new(profile.as_str()).is_relative() {
                *profile = base.join(profile.as_str()).display().to_string();
            }
        }
    }

    /// Checks what the types cannot: counts, exclusive keys, address lists.
    pub fn validate(&self) -> Result<()> {
        let bad = |key: &str, why: String| Err(Error::Config(format!("`{key}` {why}")));
        if self.model.path.is_some() && self.model.shape.is_some() {
            return bad(
                "model.shape",
                "and `model.path` are both set: give a checkpoint folder or a named shape, not both"
                    .into(),
            );
        }
        if let Some(shape) = &self.model.shape
            && let Err(e) = shape.parse::<Preset>()
        {
            return bad("model.shape", format!("is not a known shape: {e}"));
        }
        let a = &self.attention;
        let c = &self.cards;
        for (key, value) in [
            ("attention.nodes", a.nodes),
            ("attention.max_num_seqs", a.max_num_seqs),
            ("attention.max_model_len", a.max_model_len),
            ("attention.block_size", a.block_size),
            ("attention.max_num_batched_tokens", a.max_num_batched_tokens),
            ("workload.batch", self.workload.batch),
        ] {
            if value == 0 {
                return bad(key, "must be at least 1".into());
            }
        }
        if a.kv_cache_memory == Some(0) {
            return bad(
                "attention.kv_cache_memory",
                "must be at least 1 (MiB), or left out to size it for max_num_seqs x max_model_len"
                    .into(),
            );
        }
        if let Some(u) = a.gpu_memory_utilization {
            if !(u > 0.0 && u <= 1.0) {
                return bad(
                    "attention.gpu_memory_utilization",
                    format!("must be in (0, 1], not {u}"),
                );
            }
            if !a.device.is_cuda() {
                return bad(
                    "attention.gpu_memory_utilization",
                    format!(
                        "sizes a GPU's KV cache but `attention.device` is {}: set device = \"cuda\" \
                         or give kv_cache_memory instead",
                        a.device
                    ),
                );
            }
            if a.kv_cache_memory.is_some() {
                return bad(
                    "attention.gpu_memory_utilization",
                    "and `attention.kv_cache_memory` are both set: give one".into(),
                );
            }
        }
        if !(a.reply_timeout_s.is_finite() && a.reply_timeout_s > 0.0) {
            return bad(
                "attention.reply_timeout_s",
                "must be a positive number of seconds".into(),
            );
        }
        match (c.placement, &c.expert_load) {
            (PlacementPolicy::Load, None) => {
                return bad(
                    "cards.placement",
                    "= \"load\" needs `cards.expert_load`: a routing record (`afd serve \
                     --record-routing FILE` writes one)"
                        .into(),
                );
            }
            (PlacementPolicy::Contiguous, Some(_)) => {
                return bad(
                    "cards.expert_load",
                    "is only read with `cards.placement = \"load\"`: set that, or remove it".into(),
                );
            }
            (PlacementPolicy::Load, Some(_))
                if !c.replicas.is_empty()
                    || c.replicate_experts != planner::ReplicateExperts::Auto =>
            {
                return bad(
                    "cards.replicas",
                    "and `cards.replicate_experts` do not apply with `cards.placement = \"load\"`, \
                     which places its own copies: use `cards.num_redundant_experts`"
                        .into(),
                );
            }
            _ => {}
        }
        if c.placement == PlacementPolicy::Contiguous && c.num_redundant_experts > 0 && !c.eplb {
            return bad(
                "cards.num_redundant_experts",
                "is only used with `cards.placement = \"load\"` or `cards.eplb = true`: set \
                 one, or use `cards.replicate_experts` for copies of every expert"
                    .into(),
            );
        }
        if c.groups == 0 || (c.count > 0 && !c.count.is_multiple_of(c.groups)) {
            return bad(
                "cards.groups",
                format!(
                    "= {} must be at least 1 and divide `cards.count` ({}): the groups are equal",
                    c.groups, c.count
                ),
            );
        }
        if c.eplb && (c.eplb_window == 0 || c.eplb_step_interval == 0) {
            return bad(
                "cards.eplb_window",
                "and `cards.eplb_step_interval` must be at least 1 step".into(),
            );
        }
        if !(c.eplb_min_gain.is_finite() && (0.0..=1.0).contains(&c.eplb_min_gain)) {
            return bad(
                "cards.eplb_min_gain",
                "must be a balancedness gain between 0 and 1".into(),
            );
        }
        let drain = self.server.shutdown_timeout;
        if !(drain.is_finite() && drain >= 0.0) {
            return bad(
                "server.shutdown_timeout",
                "must be a number of seconds, 0 or more".into(),
            );
        }
        if !a.addresses.is_empty() && a.addresses.len() != a.nodes {
            return bad(
                "attention.addresses",
                format!(
                    "lists {} addresses for {} nodes: give one per node or none",
                    a.addresses.len(),
                    a.nodes
                ),
            );
        }
        if !c.addresses.is_empty() && c.addresses.len() != c.count {
            return bad(
                "cards.addresses",
                format!(
                    "lists {} addresses for {} cards: give one per card or none",
                    c.addresses.len(),
                    c.count
                ),
            );
        }
        if self.transport.kind == TransportKind::Inproc && self.transport.tls_dir.is_some() {
            return bad(
                "transport.tls_dir",
                "is set but `transport.kind` is inproc, which uses no TLS".into(),
            );
        }
        Ok(())
    }

    /// Where the model comes from: the checkpoint folder, the named shape, or the bundled model.
    pub fn model_source(&self) -> Result<ModelSource> {
        if let Some(shape) = &self.model.shape {
            let preset = shape
                .parse::<Preset>()
                .map_err(|e| Error::Config(format!("`model.shape`: {e}")))?;
            return Ok(ModelSource::Shape {
                family: self.model.family.unwrap_or(Family::GptOss),
                preset,
                name: shape.clone(),
            });
        }
        Ok(ModelSource::Checkpoint(
            self.model.path.clone().unwrap_or_else(bundled_model_dir),
        ))
    }

    /// The checkpoint folder, for roles that need weights (a named shape has none).
    pub fn checkpoint(&self) -> Result<PathBuf> {
        match self.model_source()? {
            ModelSource::Checkpoint(p) => Ok(p),
            ModelSource::Shape { name, .. } => Err(Error::Config(format!(
                "{}: `model.shape = \"{name}\"` names a shape without weights, which only \
                 `afd plan` can use; set `model.path` to a checkpoint folder to run it",
                self.source.display()
            ))),
        }
    }

    /// The model's config.json text and where it came from. For a named shape it is made by
    /// `afd synth --config-only` in a scratch folder that is removed afterwards.
    pub fn model_config_text(&self) -> Result<(String, PathBuf)> {
        match self.model_source()? {
            ModelSource::Checkpoint(dir) => {
                let path = dir.join("config.json");
                let text = std::fs::read_to_string(&path).map_err(Error::system(format!(
                    "{}: cannot read {} (is `model.path` a checkpoint folder?)",
                    self.source.display(),
                    path.display()
                )))?;
                Ok((text, path))
            }
            ModelSource::Shape {
                family,
                preset,
                name,
            } => {
                let text = shape_config_json(family, preset)?;
                Ok((text, PathBuf::from(format!("<shape {family} {name}>"))))
            }
        }
    }

    /// The model's configuration (family checked against `model.family` when given).
    pub fn model_config(&self) -> Result<ModelConfig> {
        let (text, path) = self.model_config_text()?;
        let config = ModelConfig::from_json(&text, &path)?;
        if let Some(family) = self.model.family
            && family != config.family
        {
            return Err(Error::Config(format!(
                "{}: `model.family = \"{family}\"` but {} is a {} model",
                self.source.display(),
                path.display(),
                config.family
            )));
        }
        Ok(config)
    }

    /// KV cache bytes of one attention node as the running node allocates it (f32): the
    /// explicit `kv_cache_memory`, else `max_num_seqs x max_model_len` tokens.
    pub fn kv_cache_bytes(&self, model: &ModelConfig) -> usize {
        match self.attention.kv_cache_memory {
            Some(mib) => mib << 20,
            None => {
                let tokens = self.attention.max_num_seqs
                    * self
                        .attention
                        .max_model_len
                        .next_multiple_of(self.attention.block_size);
                tokens * KvCacheConfig::bytes_per_token(model)
            }
        }
    }

    /// Whether the attention device runs the whole model (`cards.count = 0`): the baseline the
    /// planner compares with, served by the monolithic reference forward.
    pub fn is_monolithic(&self) -> bool {
        self.cards.count == 0
    }

    /// The embedded-cluster settings of this deployment (what `afd serve` and `afd up` start).
    /// Needs a checkpoint and at least one card; reads config.json to size the KV cache.
    pub fn cluster_config(&self) -> Result<ClusterConfig> {
        let dir = self.checkpoint()?;
        if self.is_monolithic() {
            return Err(Error::Config(format!(
                "{}: `cards.count = 0` runs the whole model on the attention device; serve it with \
                 the reference forward (`afd serve --reference`) or set `cards.count` to 1 or more",
                self.source.display()
            )));
        }
        let model = self.model_config()?;
        let a = &self.attention;
        let c = &self.cards;
        let mut config = ClusterConfig::new(dir, c.count);
        config.attention_nodes = a.nodes;
        config.transport = self.transport.kind;
        config.weight_format = self.model.format;
        config.activation_dtype = self.model.activation_dtype;
        config.huge_pages = self.model.huge_pages;
        config.allow_spill = c.allow_spill;
        config.replicas = c.listed_replicas();
        config.replicate_experts = c.replicate_experts;
        config.expert_load = match (c.placement, &c.expert_load) {
            (PlacementPolicy::Load, Some(record)) => Some(crate::load_placement::LoadPlacement {
                record: record.clone(),
                num_redundant_experts: c.num_redundant_experts,
                card_groups: c.groups,
            }),
            _ => None,
        };
        config.eplb = c.eplb.then_some(planner::eplb::EplbSettings {
            window: c.eplb_window,
            step_interval: c.eplb_step_interval,
            num_redundant_experts: c.num_redundant_experts,
            card_groups: c.groups,
            min_gain: c.eplb_min_gain,
        });
        config.card_threads = c.card_threads;
        config.card_cpu_mask = c.cpu_mask;
        config.profile = self.card_profile()?;
        config.node.micro_batches = self.overlap.micro_batches.0;
        config.node.wire_dtype = a.wire_dtype;
        config.node.max_tokens = a.max_num_batched_tokens;
        config.node.reply_timeout = std::time::Duration::from_secs_f64(a.reply_timeout_s);
        config.node.device = a.device;
        config.node.kv = KvCacheConfig {
            block_size: a.block_size,
            memory_bytes: self.kv_cache_bytes(&model),
            gpu_memory_utilization: a.gpu_memory_utilization,
        };
        Ok(config)
    }

    /// The cards' hardware profile: the built-in Corsair profile or a TOML file.
    pub fn card_profile(&self) -> Result<corsair_ffn::HardwareProfile> {
        let name = &self.cards.profile;
        if name == "corsair" {
            return Ok(corsair_ffn::HardwareProfile::default());
        }
        let text = std::fs::read_to_string(name).map_err(Error::system(format!(
            "{}: `cards.profile = \"{name}\"`: not `corsair` and not a readable profile file",
            self.source.display()
        )))?;
        corsair_ffn::HardwareProfile::from_toml(&text).map_err(|source| Error::Cards {
            what: format!("{}: `cards.profile` {name}", self.source.display()),
            source: Box::new(source),
        })
    }

    /// Control-plane address of each card (`host:port`), in card order.
    pub fn card_addresses(&self) -> Vec<String> {
        let c = &self.cards;
        addresses(&c.addresses, &c.host, c.base_port, c.count)
    }

    /// Step-service address of each attention node (`host:port`), in node order.
    pub fn attention_addresses(&self) -> Vec<String> {
        let a = &self.attention;
        addresses(&a.addresses, &a.host, a.base_port, a.nodes)
    }
}

fn addresses(explicit: &[String], host: &str, base_port: u16, n: usize) -> Vec<String> {
    if !explicit.is_empty() {
        return explicit.to_vec();
    }
    (0..n)
        .map(|i| format!("{host}:{}", base_port as usize + i))
        .collect()
}

pub use planner::is_path_like;

/// The bundled model: `models/afd-tiny-gpt-oss` under the current directory, else under the
/// repository this crate was built from.
pub fn bundled_model_dir() -> PathBuf {
    let here = PathBuf::from(BUNDLED_MODEL);
    if here.join("config.json").exists() {
        return here;
    }
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(BUNDLED_MODEL);
    repo.canonicalize().unwrap_or(here)
}

/// config.json of a named shape, as `afd synth --config-only` writes it.
pub fn shape_config_json(family: Family, preset: Preset) -> Result<String> {
    let options = SynthOptions {
        family,
        preset,
        format: None,
        seed: 0,
        config_only: true,
    };
    Ok(config_json_text(&options)?)
}

#[cfg(test)]
mod tests;
