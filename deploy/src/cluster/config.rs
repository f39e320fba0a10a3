//! [`ClusterConfig`]: everything a disaggregated deployment is made of, with its defaults, and
//! the shares it gives the cards.

use std::path::PathBuf;

use corsair_ffn::assignment::ExpertReplica;
use corsair_ffn::compiler::{CompileOptions, StoredFormats};
use corsair_ffn::{
    CardAssignment, FormatChoice, HardwareProfile, PlacementOptions, plan_placement,
};
use gpu_attention::NodeConfig;
use model::kernels::ActivationDtype;
use model::weights::{ExpertFilter, HugePages, LoadOptions};
use model::{ModelConfig, ModelWeights};

use crate::error::{Error, Result};
use crate::watch::WatchConfig;
use planner::replication::{self, CardsToFit, ReplicateExperts, ReplicationChoice};

/// How the attention nodes and the cards talk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TransportKind {
    /// JetStream over QUIC with mutual TLS (loopback when embedded).
    #[default]
    Quic,
    /// JetStream's in-process twin (embedded only).
    Inproc,
}

impl std::str::FromStr for TransportKind {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "quic" => Ok(TransportKind::Quic),
            "inproc" => Ok(TransportKind::Inproc),
            other => Err(format!(
                "unknown transport `{other}`: expected quic or inproc"
            )),
        }
    }
}

/// Everything a disaggregated deployment is made of.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// Checkpoint folder.
    pub model: PathBuf,
    /// Number of cards.
    pub cards: usize,
    /// Number of attention nodes sharing the cards.
    pub attention_nodes: usize,
    /// Data-plane transport.
    pub transport: TransportKind,
    /// Format of expert and dense weights on the cards.
    pub weight_format: FormatChoice,
    /// What matrix products round their inputs to, on the cards and the attention nodes
    /// (bf16: bf16 and MXFP4 weights take bf16 dot products, AVX-512 BF16 where the CPU has
    /// it). Default f32 (exact).
    pub activation_dtype: ActivationDtype,
    /// Let weights that do not fit in SRAM stream from LPDDR.
    pub allow_spill: bool,
    /// Whether an attention node on the CPU (and the monolithic reference) copies the
    /// matrices it computes with out of the memory-mapped checkpoint into transparent huge
    /// pages at load, which its kernels stream faster (see [`model::checkpoint::move_to_huge_pages`]).
    /// Default true; false keeps them in the page cache (less load time, memory shared with
    /// other processes mapping the same file).
    pub huge_pages: bool,
    /// Replicas of hot experts.
    pub replicas: Vec<ExpertReplica>,
    /// One extra copy of every expert, on the card after its primary (with two cards, both
    /// hold every expert): each step then spreads its experts evenly over the cards, so a
    /// token's experts are computed side by side, at the cost of the experts' memory twice.
    /// Default auto: where the copies fit (see [`crate::replication`]).
    pub replicate_experts: ReplicateExperts,
    /// Place the experts by measured load instead (`[cards] placement = "load"`): then
    /// [`Self::replicas`] and [`Self::replicate_experts`] are not used. Default: none.
    pub expert_load: Option<crate::load_placement::LoadPlacement>,
    /// Move the experts while serving by the load of recent steps (`--eplb`); `None`: never.
    pub eplb: Option<planner::eplb::EplbSettings>,
    /// Attention-node settings (KV cache, micro-batches, wire dtype, max tokens, ...).
    pub node: NodeConfig,
    /// Executor threads per card (0: every core).
    pub card_threads: usize,
    /// CPUs the cards' threads are pinned to (bit mask; 0: no pinning). With the attention
    /// node pinned elsewhere, cards and node behave like separate devices on a small host.
    pub card_cpu_mask: u64,
    /// The cards' hardware profile.
    pub profile: HardwareProfile,
    /// How each attention node watches its cards (heartbeats).
    pub watch: WatchConfig,
}

impl ClusterConfig {
    /// The replicas to place for `model`: [`Self::replicas`], plus every expert where
    /// [`Self::replicate_experts`] decides so (`host_available`: this host's free memory,
    /// where the cards keep their weights in it), with the reason.
    pub fn replicas_for(
        &self,
        model: &ModelConfig,
        host_available: Option<u64>,
    ) -> Result<(Vec<ExpertReplica>, ReplicationChoice)> {
        let path = self.model.join("config.json");
        let text = std::fs::read_to_string(&path)
            .map_err(Error::system(format!("cannot read {}", path.display())))?;
        let stored =
            StoredFormats::from_config_json(&text, model).map_err(|source| Error::Cards {
                what: path.display().to_string(),
                source: Box::new(source),
            })?;
        let options = CompileOptions {
            format: self.weight_format,
            max_tokens: self.node.max_tokens,
            candidates: self.node.lm_head_candidates,
            activations: self.activation_dtype,
            ..CompileOptions::default()
        };
        let choice = replication::choose(
            self.replicate_experts,
            &CardsToFit {
                model,
                stored: &stored,
                options: &options,
                profile: &self.profile,
                cards: self.cards,
                listed: &self.replicas,
                host_available,
            },
        );
        let replicas = ExpertReplica::placed(self.replicas.clone(), choice.every_expert, model);
        Ok((replicas, choice))
    }

    /// Every card's share for `model` on `cards` cards: by measured load where
    /// [`Self::expert_load`] says so, else contiguous blocks with [`Self::replicas_for`]'s
    /// copies (`host_available` as there).
    pub fn assignments(
        &self,
        model: &ModelConfig,
        cards: usize,
        host_available: Option<u64>,
    ) -> Result<Vec<CardAssignment>> {
        if let Some(load) = &self.expert_load {
            let (assignments, placed) =
                crate::load_placement::assignments_by_load(model, cards, load)?;
            tracing::info!(
                record = %load.record.display(),
                num_redundant_experts = placed.redundant_experts,
                "experts placed by measured load: balancedness {:.3} -> {:.3} (mean over MoE layers)",
                placed.mean_before(),
                placed.mean_after()
            );
            return Ok(assignments);
        }
        let (replicas, choice) = self.replicas_for(model, host_available)?;
        tracing::info!(replicate_experts = choice.every_expert, "{}", choice.reason);
        Ok(plan_placement(
            model,
            &PlacementOptions { cards, replicas },
        )?)
    }

    /// The checkpoint's weights as this deployment computes with them: the experts `experts`
    /// names, every product rounding its inputs as `activation_dtype` says. On the CPU, with
    /// [`Self::huge_pages`], the layers' matrices move into huge pages, and the LM head too
    /// where every expert is loaded (the monolithic reference computes it; an attention node
    /// only holds it to cover a card that is down).
    pub fn load_weights(&self, experts: ExpertFilter) -> Result<ModelWeights> {
        let huge_pages = if !self.huge_pages || !self.node.device.is_host() {
            HugePages::Off
        } else if matches!(experts, ExpertFilter::All) {
            HugePages::LayersAndLmHead
        } else {
            HugePages::Layers
        };
        Ok(ModelWeights::load_with(
            &self.model,
            &LoadOptions {
                experts,
                activations: self.activation_dtype,
                huge_pages,
            },
        )?)
    }

    /// Defaults for `model` on `cards` cards.
    pub fn new(model: impl Into<PathBuf>, cards: usize) -> Self {
        ClusterConfig {
            model: model.into(),
            cards,
            attention_nodes: 1,
            transport: TransportKind::Quic,
            weight_format: FormatChoice::AsStored,
            activation_dtype: ActivationDtype::F32,
            allow_spill: false,
            huge_pages: true,
            replicas: Vec::new(),
            replicate_experts: ReplicateExperts::Auto,
            expert_load: None,
            eplb: None,
            // The cards share this host: while they wait for the node in a step of one
            // micro-batch, its attention may use every core.
            node: NodeConfig {
                solo_threads: crate::process::cores(),
                ..NodeConfig::default()
            },
            card_threads: 1,
            card_cpu_mask: 0,
            profile: HardwareProfile::default(),
            watch: WatchConfig::default(),
        }
    }
}
