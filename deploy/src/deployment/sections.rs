//! The sections of a deployment file. Every key has a default, so a file names only what it
//! changes; unknown keys are refused (a typo must not silently fall back to a default).

use std::path::PathBuf;

use corsair_ffn::FormatChoice;
use gpu_attention::{AttentionDevice, MicroBatches};
use model::Family;
use model::kernels::ActivationDtype;
use proto::data::WireDtype;
use serde::{Deserialize, Serialize};

use crate::cluster::TransportKind;

/// `[model]`: which model, and in which weight format the cards hold it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelSection {
    /// Checkpoint folder (Hugging Face layout), relative to the deployment file's folder.
    /// Default: none; with neither `path` nor `shape`, the model bundled in the repository
    /// (`models/afd-tiny-gpt-oss`).
    pub path: Option<PathBuf>,
    /// A named shape instead of a checkpoint, for planning models that are not on this machine:
    /// an `afd synth` preset (`tiny`, `small`, `medium`, `gpt-oss-20b`) of `family`. Only
    /// `afd plan` accepts it (there are no weights to run). Default: none.
    pub shape: Option<String>,
    /// Model family: `gpt-oss`, `mixtral` or `qwen3-moe`. With `path` it is read from
    /// config.json (and, when given here, must agree); with `shape` it picks the preset's family.
    /// Default: `gpt-oss`.
    pub family: Option<Family>,
    /// Format of expert and dense FFN weights on the cards: `as-stored`, `bf16`, `mxfp4` or
    /// `mxint8`. Default: `as-stored` (GPT-OSS experts stay MXFP4).
    pub format: FormatChoice,
    /// What matrix products round their inputs to: `f32` (exact), `bf16` (bf16 and MXFP4
    /// weights take bf16 dot products, as a bf16 model computes) or `mxint8` (MXFP4 and MXINT8
    /// weights take MXINT8 inputs and integer block sums, bf16 weights bf16 ones). Default:
    /// `f32`.
    pub activation_dtype: ActivationDtype,
    /// Whether attention nodes on the CPU copy the matrices they compute with out of the
    /// memory-mapped checkpoint into transparent huge pages at load (their kernels stream
    /// them faster). Default: `true`.
    pub huge_pages: bool,
    /// The model's id in `/v1/models` and in responses. Default: the checkpoint folder's name.
    pub served_name: Option<String>,
}

impl Default for ModelSection {
    fn default() -> Self {
        ModelSection {
            path: None,
            shape: None,
            family: None,
            format: FormatChoice::AsStored,
            activation_dtype: ActivationDtype::F32,
            huge_pages: true,
            served_name: None,
        }
    }
}

/// `[attention]`: the attention nodes (a GPU in production, the CPU here).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AttentionSection {
    /// Attention nodes sharing the cards; the router spreads requests over them. Default 1.
    pub nodes: usize,
    /// Where each node computes: `cpu` (afd's CPU kernels), `cuda` or `cuda:N` (an NVIDIA GPU;
    /// needs a build with `--features cuda`), or `candle-cpu` (the GPU's code path on the CPU,
    /// for checking). Default `cpu`.
    #[serde(deserialize_with = "device_setting")]
    pub device: AttentionDevice,
    /// Hardware profile each node is modeled with in `afd plan`: a name (`h100`, `h200`; files
    /// in `planner/profiles/`) or the path of a profile TOML relative to this file. Default `h100`.
    pub profile: String,
    /// On a GPU: the fraction of its memory the node may use, weights and KV cache together
    /// (vLLM's `gpu_memory_utilization`); the KV cache gets what the weights leave. Replaces
    /// `kv_cache_memory`. Default: none.
    pub gpu_memory_utilization: Option<f64>,
    /// Most sequences one node runs in a step (vLLM's `max_num_seqs`). Default 64.
    pub max_num_seqs: usize,
    /// Longest sequence, prompt plus output (vLLM's `max_model_len`). Default 4096.
    pub max_model_len: usize,
    /// KV cache memory of each node in MiB. Default: none, sized for `max_num_seqs` sequences of
    /// `max_model_len` tokens.
    pub kv_cache_memory: Option<usize>,
    /// Tokens per KV block (vLLM's `block_size`). Default 16.
    pub block_size: usize,
    /// Most tokens in one step (vLLM's `max_num_batched_tokens`); also sizes the cards'
    /// activation buffers. Default 512.
    pub max_num_batched_tokens: usize,
    /// Reuse the KV blocks of prompt prefixes computed before (vLLM's automatic prefix
    /// caching; `afd serve --no-enable-prefix-caching` turns it off). Default true.
    pub enable_prefix_caching: bool,
    /// Dtype of hidden states on the wire: `f32` (exact) or `bf16` (half the bytes). Default `f32`.
    pub wire_dtype: WireDtype,
    /// Seconds to wait for a card's reply before failing the step. Default 30.
    pub reply_timeout_s: f64,
    /// Address the nodes' gRPC step services listen on (multi-process deployments).
    /// Default `127.0.0.1`.
    pub host: String,
    /// Port of node 0's step service; node j listens on `base_port + j`. Default 7200.
    pub base_port: u16,
    /// Explicit `host:port` of each node's step service, in node order; replaces `host` and
    /// `base_port` when given (nodes on other machines). Default: empty.
    pub addresses: Vec<String>,
}

impl Default for AttentionSection {
    fn default() -> Self {
        AttentionSection {
            nodes: 1,
            device: AttentionDevice::Cpu,
            profile: "h100".into(),
            gpu_memory_utilization: None,
            max_num_seqs: 64,
            max_model_len: 4096,
            kv_cache_memory: None,
            block_size: 16,
            max_num_batched_tokens: 512,
            enable_prefix_caching: true,
            wire_dtype: WireDtype::F32,
            reply_timeout_s: 30.0,
            host: "127.0.0.1".into(),
            base_port: 7200,
            addresses: Vec::new(),
        }
    }
}

/// How experts are spread over the cards.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PlacementPolicy {
    /// Contiguous blocks of experts per card, uneven counts allowed (8 experts on 3 cards:
    /// 3, 3, 2); the LM head split by vocabulary rows.
    #[default]
    Contiguous,
    /// By measured load (`expert_load`, a routing record), with `num_redundant_experts`
    /// extra copies of the hottest experts, packed so the cards' loads are even (DeepSeek's
    /// EPLB; docs/PLANNING.md). Replaces `replicas` and `replicate_experts`.
    Load,
}

/// A replica of a hot expert on the card after its primary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicaSpec {
    /// The layer; absent: every MoE layer.
    #[serde(default)]
    pub layer: Option<usize>,
    /// The expert id.
    pub expert: u32,
}

/// `[cards]`: the simulated Corsair cards.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CardsSection {
    /// Number of cards. Default 2. With 0 the attention device runs the whole model (the
    /// monolithic baseline `afd plan` compares with; served by the reference forward).
    pub count: usize,
    /// Hardware profile: `corsair` (built in, `corsair-ffn/profiles/corsair.toml`) or the path
    /// of a profile TOML relative to this file. Default `corsair`.
    pub profile: String,
    /// How experts are spread over the cards: `contiguous` or `load`. Default `contiguous`.
    pub placement: PlacementPolicy,
    /// The routing record `placement = "load"` places by (`afd serve --record-routing`),
    /// relative to this file. Default: none.
    pub expert_load: Option<PathBuf>,
    /// Extra expert copies per MoE layer with `placement = "load"` or `eplb` (vLLM's name).
    /// Default 0: one copy of each expert, packed by load.
    pub num_redundant_experts: usize,
    /// Equal groups of consecutive cards, each behind its own network boundary (a host, a
    /// switch, its own link from the attention nodes): placement by load (`placement = "load"`,
    /// `eplb`) first evens the groups' loads and keeps every copy of an expert inside one group
    /// (DeepSeek's hierarchical EPLB). Must divide `count`. Default 1: one group.
    pub groups: usize,
    /// Move the experts while serving, by the load of the last `eplb_window` steps, every
    /// `eplb_step_interval` steps (vLLM's `enable_eplb`). Default false.
    pub eplb: bool,
    /// Steps of routing each `eplb` placement is computed from. Default 1000 (vLLM's).
    pub eplb_window: usize,
    /// Steps between two `eplb` looks at the load. Default 3000 (vLLM's).
    pub eplb_step_interval: u64,
    /// How much more even (mean balancedness) an `eplb` placement must be than the one serving
    /// to be worth a move. Default 0.1.
    pub eplb_min_gain: f64,
    /// Extra copies of hot experts, e.g. `[{ expert = 3 }, { layer = 0, expert = 7 }]`.
    /// Default: none.
    pub replicas: Vec<ReplicaSpec>,
    /// One extra copy of every expert, on the card after its primary (with two cards, both
    /// hold every expert), so each step spreads its experts evenly over the cards; the
    /// experts then take twice their memory. `auto` (default): where the copies fit in every
    /// card's SRAM without spilling (and, for cards simulated on the host, in half of its
    /// available memory); `true` or `false` to decide.
    pub replicate_experts: planner::ReplicateExperts,
    /// Let weights that do not fit in SRAM stream from LPDDR every step (slower) instead of
    /// refusing the deployment. Default false.
    pub allow_spill: bool,
    /// Executor threads per card process or card worker (0: every core). Default 1.
    pub card_threads: usize,
    /// CPUs the card threads are pinned to, as a bit mask (0: no pinning). Default 0.
    pub cpu_mask: u64,
    /// Address the cards' gRPC control planes listen on (multi-process deployments).
    /// Default `127.0.0.1`.
    pub host: String,
    /// Port of card 0's control plane; card i listens on `base_port + i`. Default 7100.
    pub base_port: u16,
    /// Explicit `host:port` of each card's control plane, in card order; replaces `host` and
    /// `base_port` when given. Default: empty.
    pub addresses: Vec<String>,
}

impl CardsSection {
    /// The `replicas` listed, as placements take them (without `replicate_experts`' copies).
    pub fn listed_replicas(&self) -> Vec<corsair_ffn::assignment::ExpertReplica> {
        self.replicas
            .iter()
            .map(|r| corsair_ffn::assignment::ExpertReplica {
                layer: r.layer,
                expert: r.expert,
            })
            .collect()
    }
}

impl Default for CardsSection {
    fn default() -> Self {
        CardsSection {
            count: 2,
            profile: "corsair".into(),
            placement: PlacementPolicy::Contiguous,
            expert_load: None,
            num_redundant_experts: 0,
            groups: 1,
            eplb: false,
            eplb_window: planner::eplb::EplbSettings::default().window,
            eplb_step_interval: planner::eplb::EplbSettings::default().step_interval,
            eplb_min_gain: planner::eplb::EplbSettings::default().min_gain,
            replicas: Vec::new(),
            replicate_experts: planner::ReplicateExperts::Auto,
            allow_spill: false,
            card_threads: 1,
            cpu_mask: 0,
            host: "127.0.0.1".into(),
            base_port: 7100,
            addresses: Vec::new(),
        }
    }
}

/// `[transport]`: the data plane between attention nodes and cards.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TransportSection {
    /// `quic` (JetStream over QUIC with mutual TLS) or `inproc` (one process only).
    /// Default `quic`.
    pub kind: TransportKind,
    /// Folder made by `afd certs` (ca.pem and NODE.pem / NODE.key.pem per node), relative to
    /// this file. Default: none; launchers make a fresh cluster CA at start-up.
    pub tls_dir: Option<PathBuf>,
    /// Network profile `afd plan` models the transfers with: a name (`jetstream`, in
    /// `planner/profiles/`) or a TOML path relative to this file. Default `jetstream`.
    pub profile: String,
}

impl Default for TransportSection {
    fn default() -> Self {
        TransportSection {
            kind: TransportKind::Quic,
            tls_dir: None,
            profile: "jetstream".into(),
        }
    }
}

/// Micro-batches per step: `"auto"`, `1` or `2` (TOML integer or string).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MicroBatchSetting(pub MicroBatches);

impl Serialize for MicroBatchSetting {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.0 {
            MicroBatches::Auto => s.serialize_str("auto"),
            MicroBatches::One => s.serialize_u8(1),
            MicroBatches::Two => s.serialize_u8(2),
        }
    }
}

impl<'de> Deserialize<'de> for MicroBatchSetting {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(i64),
            Text(String),
        }
        let text = match Raw::deserialize(d)? {
            Raw::Number(n) => n.to_string(),
            Raw::Text(t) => t,
        };
        text.parse::<MicroBatches>()
            .map(MicroBatchSetting)
            .map_err(|_| {
                serde::de::Error::custom(format!(
                    "micro_batches takes 1, 2 or \"auto\", not `{text}`"
                ))
            })
    }
}

/// `[overlap]`: splitting a step so card work overlaps attention work.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OverlapSection {
    /// Micro-batches per step: `1` (no overlap), `2` (while the cards compute layer l for one
    /// half of the batch, the attention node computes the other half), or `"auto"` (for steps
    /// of 2 or more sequences, whichever of the two the node measures to be faster for steps
    /// of that size). Default `"auto"`.
    pub micro_batches: MicroBatchSetting,
}

/// `[server]`: the OpenAI-compatible HTTP frontend.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerSection {
    /// Address to listen on. Default `127.0.0.1`.
    pub host: String,
    /// Port to listen on (0: any free port). Default 8000.
    pub port: u16,
    /// Bearer token clients must send on `/v1/*` (`Authorization: Bearer ...`), as vLLM's
    /// `--api-key`; `afd up` hands it to the frontend in `VLLM_API_KEY` and `afd k8s` from a
    /// Secret, never on a command line. Default: none (no authentication).
    pub api_key: Option<String>,
    /// Requests allowed to wait for a slot; beyond it the server answers 429. Default 1024.
    pub max_waiting: usize,
    /// Seconds requests in flight may take to finish after SIGTERM or SIGINT (the frontend
    /// answers new ones 503 meanwhile, and attention nodes keep serving the sequences they
    /// hold); what still runs then ends with an error. Default 30.
    pub shutdown_timeout: f64,
}

impl Default for ServerSection {
    fn default() -> Self {
        ServerSection {
            host: "127.0.0.1".into(),
            port: 8000,
            api_key: None,
            max_waiting: 1024,
            shutdown_timeout: 30.0,
        }
    }
}

/// `[workload]`: the operating point `afd plan` predicts (it does not limit the server).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WorkloadSection {
    /// Concurrent sequences decoding together, over all attention nodes. Default 1.
    pub batch: usize,
    /// Prompt tokens per sequence. Default 1024.
    pub input_len: usize,
    /// Generated tokens per sequence. Default 1024. With 0, `afd plan` predicts one decode step
    /// at a context of `input_len` tokens instead of averaging over the whole output.
    pub output_len: usize,
}

impl Default for WorkloadSection {
    fn default() -> Self {
        WorkloadSection {
            batch: 1,
            input_len: 1024,
            output_len: 1024,
        }
    }
}

/// `attention.device`, with a hint for files that still name the planner's profile there.
fn device_setting<'de, D: serde::Deserializer<'de>>(d: D) -> Result<AttentionDevice, D::Error> {
    let text = String::deserialize(d)?;
    text.parse().map_err(|e| {
        let hint = if crate::deployment::is_path_like(&text) || text.starts_with('h') {
            " (the planner's hardware profile, such as h100, is `attention.profile`)"
        } else {
            ""
        };
        serde::de::Error::custom(format!("{e}{hint}"))
    })
}
