//! Command-line settings of a disaggregated deployment, shared by `generate`, `verify` and
//! `serve` (the same keys as deployment files).

use std::path::PathBuf;

use corsair_ffn::FormatChoice;
use deploy::cluster::{ClusterConfig, TransportKind};
use gpu_attention::kv_cache::KvCacheConfig;
use gpu_attention::{AttentionDevice, MicroBatches};
use model::kernels::ActivationDtype;
use planner::ReplicateExperts;
use proto::data::WireDtype;

/// How the cards and attention nodes are set up (embedded deployments).
#[derive(Debug, Clone, clap::Args)]
pub struct ClusterArgs {
    /// Number of simulated Corsair cards.
    #[arg(long, default_value_t = 2)]
    pub cards: usize,
    /// Data plane between attention node and cards: quic (loopback, mutual TLS) or inproc.
    #[arg(long, default_value = "quic")]
    pub transport: TransportKind,
    /// Executor threads per card (0: every core).
    #[arg(long, default_value_t = 1)]
    pub card_threads: usize,
    /// Compute threads of the attention nodes (0: the cores the cards leave free, at least 1;
    /// in steps of one micro-batch, while the cards wait, every core when the step's attention
    /// is enough work: weights times tokens at least 1 M a layer).
    #[arg(long, default_value_t = 0)]
    pub attention_threads: usize,
    #[command(flatten)]
    pub node: NodeArgs,
}

/// Attention-node and shard settings, for embedded and multi-process deployments alike.
#[derive(Debug, Clone, clap::Args)]
#[command(group(clap::ArgGroup::new("by_load").args(["expert_load", "eplb"]).multiple(true)))]
pub struct NodeArgs {
    /// Where the attention node computes: cpu (afd's CPU kernels), cuda or cuda:N (an NVIDIA
    /// GPU; needs a build with --features cuda), or candle-cpu (the GPU's code path on the CPU,
    /// for checking it without a GPU).
    #[arg(long, default_value = "cpu")]
    pub device: AttentionDevice,
    /// On a GPU: the fraction of its memory the node may use, weights and KV cache together
    /// (vLLM's --gpu-memory-utilization); the KV cache gets what the weights leave, instead of
    /// --kv-cache-memory.
    #[arg(long)]
    pub gpu_memory_utilization: Option<f64>,
    /// Weight format on the cards: as-stored, bf16, mxfp4 or mxint8.
    #[arg(long, default_value = "as-stored")]
    pub format: FormatChoice,
    /// What matrix products round their inputs to: f32 (exact, the fixtures' numerics), bf16
    /// (as a bf16 model computes in PyTorch or llama.cpp: bf16 and MXFP4 weights take AVX-512
    /// BF16 dot products, or AVX2 multiply-adds with the same bits, sums stay f32) or mxint8
    /// (MXFP4 and MXINT8 weights take inputs quantized to MXINT8 and integer block sums, as a
    /// Corsair card and llama.cpp's MXFP4 path compute; bf16 weights as with bf16).
    #[arg(long, default_value = "f32")]
    pub activation_dtype: ActivationDtype,
    /// Let expert weights that do not fit in SRAM stream from LPDDR (modeled cost).
    #[arg(long)]
    pub allow_spill: bool,
    /// One extra copy of every expert, on the card after its primary (with 2 cards, both hold
    /// every expert): each step spreads its experts evenly over the cards, so one token's
    /// experts are computed side by side; the experts take twice their memory. auto: where
    /// the copies fit in every card's SRAM without spilling and in half of this host's
    /// available memory; true (also the bare flag) or false to decide.
    /// Deployment-file key: `cards.replicate_experts`.
    #[arg(long, default_value = "auto", num_args = 0..=1, default_missing_value = "true")]
    pub replicate_experts: ReplicateExperts,
    /// Place the experts by the load this routing record measured (`--record-routing` of an
    /// earlier run), as DeepSeek's EPLB does; replaces --replicate-experts. Deployment-file
    /// keys: `cards.placement = "load"`, `cards.expert_load`.
    #[arg(long, value_name = "FILE")]
    pub expert_load: Option<PathBuf>,
    /// With --expert-load or --eplb: extra expert copies per MoE layer, each to the expert
    /// with the most load per copy (vLLM's name). Deployment-file key:
    /// `cards.num_redundant_experts`.
    #[arg(long, default_value_t = 0, requires = "by_load")]
    pub num_redundant_experts: usize,
    /// With --expert-load or --eplb: the cards form this many equal groups, each behind its own
    /// network boundary; placement by load evens the groups first and keeps every copy of an
    /// expert inside one (DeepSeek's hierarchical EPLB). Must divide --cards. Deployment-file
    /// key: `cards.groups`.
    #[arg(long, default_value_t = 1, requires = "by_load")]
    pub card_groups: usize,
    /// Move the experts while serving: every --eplb-step-interval steps, place them by the
    /// load of the last --eplb-window steps, and when that is more even, build the new shares
    /// on the cards in the background and switch every node between two steps (vLLM's
    /// --enable-eplb). Deployment-file key: `cards.eplb`.
    #[arg(long)]
    pub eplb: bool,
    /// Steps of routing each --eplb placement is computed from. Deployment-file key:
    /// `cards.eplb_window`.
    #[arg(long, default_value_t = planner::eplb::EplbSettings::default().window, requires = "eplb")]
    pub eplb_window: usize,
    /// Steps between two --eplb looks at the load. Deployment-file key:
    /// `cards.eplb_step_interval`.
    #[arg(long, default_value_t = planner::eplb::EplbSettings::default().step_interval, requires = "eplb")]
    pub eplb_step_interval: u64,
    /// How much more even (mean balancedness over the MoE layers, 0 to 1) an --eplb placement
    /// must be than the one serving to be worth a move. Deployment-file key:
    /// `cards.eplb_min_gain`.
    #[arg(long, default_value_t = planner::eplb::EplbSettings::default().min_gain, requires = "eplb", value_parser = parse_gain)]
    pub eplb_min_gain: f64,
    /// Keep the attention node's weights in the memory-mapped checkpoint (4 KB page-cache
    /// pages) instead of copying them into transparent huge pages at load, which its CPU
    /// kernels stream faster. Deployment-file key: `model.huge_pages = false`.
    #[arg(long)]
    pub no_huge_pages: bool,
    /// Micro-batches per step: 1, 2, or auto (for steps of 2+ sequences, whichever of 1 and 2
    /// the node measures to be faster for steps of that size; it tries both).
    #[arg(long, default_value = "auto")]
    pub micro_batches: MicroBatches,
    /// Dtype of hidden states on the wire: f32 (exact) or bf16.
    #[arg(long, default_value = "f32")]
    pub wire_dtype: WireDtype,
    /// Most tokens in one step (vLLM's max_num_batched_tokens).
    #[arg(long, default_value_t = 512)]
    pub max_num_batched_tokens: usize,
    /// KV cache memory of each attention node, in MiB.
    #[arg(long, default_value_t = 512)]
    pub kv_cache_memory: usize,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Seconds to wait for a card's reply before failing the step.
    #[arg(long, default_value_t = 30.0)]
    pub reply_timeout: f64,
}

impl ClusterArgs {
    /// The deployment for `model`.
    pub fn config(&self, model: PathBuf) -> ClusterConfig {
        let mut c = self.node.config(model, self.cards);
        c.transport = self.transport;
        c.card_threads = self.card_threads;
        // A width the user fixed holds in every step.
        if self.attention_threads > 0 {
            c.node.solo_threads = self.attention_threads;
        }
        c
    }

    /// The attention side's compute threads for this process (see
    /// [`deploy::process::attention_threads`]).
    pub fn compute_threads(&self) -> usize {
        let per_card = if self.card_threads == 0 {
            deploy::process::cores()
        } else {
            self.card_threads
        };
        deploy::process::attention_threads(
            self.attention_threads,
            self.cards.saturating_mul(per_card),
        )
    }
}

impl NodeArgs {
    /// The deployment for `model` on `cards` cards.
    pub fn config(&self, model: PathBuf, cards: usize) -> ClusterConfig {
        let mut c = ClusterConfig::new(model, cards);
        c.weight_format = self.format;
        c.activation_dtype = self.activation_dtype;
        c.allow_spill = self.allow_spill;
        c.replicate_experts = self.replicate_experts;
        c.expert_load =
            self.expert_load
                .as_ref()
                .map(|record| deploy::load_placement::LoadPlacement {
                    record: record.clone(),
                    num_redundant_experts: self.num_redundant_experts,
                    card_groups: self.card_groups,
                });
        c.eplb = self.eplb.then_some(planner::eplb::EplbSettings {
            window: self.eplb_window,
            step_interval: self.eplb_step_interval,
            num_redundant_experts: self.num_redundant_experts,
            card_groups: self.card_groups,
            min_gain: self.eplb_min_gain,
        });
        c.huge_pages = !self.no_huge_pages;
        c.node.reply_timeout = std::time::Duration::from_secs_f64(self.reply_timeout.max(0.001));
        c.node.micro_batches = self.micro_batches;
        c.node.wire_dtype = self.wire_dtype;
        c.node.max_tokens = self.max_num_batched_tokens;
        c.node.device = self.device;
        c.node.kv = KvCacheConfig {
            block_size: self.block_size,
            memory_bytes: self.kv_cache_memory << 20,
            gpu_memory_utilization: self.gpu_memory_utilization,
        };
        c
    }
}

/// A balancedness gain in [0, 1].
fn parse_gain(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(g) if g.is_finite() && (0.0..=1.0).contains(&g) => Ok(g),
        _ => Err(format!("`{s}` is not a balancedness gain between 0 and 1")),
    }
}

/// Refuses bf16 or MXINT8 activations for a model run on a GPU: the option is a setting of
/// afd's CPU kernels, and the device path computes in f32.
pub fn check_device_numerics(
    device: AttentionDevice,
    activations: ActivationDtype,
) -> anyhow::Result<()> {
    if !device.is_host() && activations != ActivationDtype::F32 {
        anyhow::bail!(
            "--activation-dtype {activations} applies to afd's CPU kernels, but the whole model \
             runs on {device}, which computes in f32; drop --activation-dtype or use --device cpu"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_activations_are_refused_for_a_model_on_a_device_only() {
        let gpu: AttentionDevice = "candle-cpu".parse().unwrap();
        let cpu: AttentionDevice = "cpu".parse().unwrap();
        let e = check_device_numerics(gpu, ActivationDtype::Bf16).unwrap_err();
        assert!(e.to_string().contains("--activation-dtype"), "{e}");
        assert!(check_device_numerics(gpu, ActivationDtype::F32).is_ok());
        let e = check_device_numerics(gpu, ActivationDtype::Mxint8).unwrap_err();
        assert!(e.to_string().contains("mxint8"), "{e}");
        assert!(check_device_numerics(cpu, ActivationDtype::Bf16).is_ok());
    }
}
