//! The attention device's side of the system model: the decode (and prefill) kernels of one
//! layer as bytes, flops and a fixed cost each, from the model's shape alone.
//!
//! A kernel takes `fixed + max(bytes / bandwidth, flops / rate)`: small-batch decode kernels are
//! bound by the weights and KV they read, large prefill chunks by arithmetic, and every kernel
//! on the critical path pays a fixed launch/ramp/tail cost. The kernel list is the usual fused
//! decode path (vLLM-style): norm, QKV, RoPE + KV write, attention, O projection, residual norm,
//! router, top-k; then either the MoE kernels (the GPU alone) or dispatch and combine (AFD).

use model::ModelConfig;
use model::config::{AttentionKind, FfnKind, Quantization};
use serde::{Deserialize, Serialize};

use super::profiles::DeviceProfile;

/// Bytes per activation element on the device (bf16).
const ACT: f64 = 2.0;

/// One kernel's work.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Kernel {
    /// What it does.
    pub name: &'static str,
    /// Bytes read and written in HBM.
    pub bytes: f64,
    /// Arithmetic.
    pub flops: f64,
    /// Fraction of the HBM bandwidth it reaches (1 for all but MXFP4 expert kernels).
    pub bandwidth_efficiency: f64,
}

impl Kernel {
    fn new(name: &'static str, bytes: f64, flops: f64) -> Self {
        Kernel {
            name,
            bytes,
            flops,
            bandwidth_efficiency: 1.0,
        }
    }

    /// Modeled seconds on `device`.
    pub fn seconds(&self, device: &DeviceProfile) -> f64 {
        let memory = self.bytes / (device.memory.hbm_bandwidth * self.bandwidth_efficiency);
        let compute = self.flops / device.compute.bf16_flops;
        device.kernels.fixed_ns * 1e-9 + memory.max(compute)
    }
}

/// The sum of `kernels` on `device`.
pub fn seconds(kernels: &[Kernel], device: &DeviceProfile) -> f64 {
    kernels.iter().map(|k| k.seconds(device)).sum()
}

/// One sequence's part of a step: its new tokens and the tokens before them in its cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Span {
    /// New tokens (a prompt chunk, or the one token of a decode).
    pub new: usize,
    /// Tokens already in the cache.
    pub past: usize,
}

/// How the tokens of a group attend.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Attending<'a> {
    /// The planner's uniform batch: each sequence reads `context` keys of its cache and each
    /// token attends to `context` keys (both capped by a sliding window).
    Uniform {
        /// Keys per token, on average.
        context: f64,
    },
    /// Each sequence as it is: a token at position `p` attends to `p + 1` keys (at most the
    /// window), and each sequence reads its whole cache (at most the window) once.
    Spans(&'a [Span]),
}

/// A group of tokens going through one layer together.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenGroup<'a> {
    /// Tokens (rows).
    pub tokens: usize,
    /// Distinct sequences they belong to (each reads its own KV cache).
    pub sequences: usize,
    /// How they attend.
    pub attending: Attending<'a>,
}

/// `sum_{i = a}^{b} min(i, w)` for `a <= b`.
fn capped_sum(a: usize, b: usize, w: usize) -> f64 {
    let plain = |lo: usize, hi: usize| (lo + hi) as f64 * (hi - lo + 1) as f64 / 2.0;
    if b <= w {
        plain(a, b)
    } else if a >= w {
        w as f64 * (b - a + 1) as f64
    } else {
        plain(a, w) + w as f64 * (b - w) as f64
    }
}

impl TokenGroup<'_> {
    /// Keys read from the cache (summed over sequences) and keys attended (summed over tokens)
    /// on a layer whose window is `window` (`None`: full attention).
    pub fn keys(&self, window: Option<usize>) -> (f64, f64) {
        match self.attending {
            Attending::Uniform { context } => {
                let keys = window.map_or(context, |w| context.min(w as f64));
                (self.sequences as f64 * keys, self.tokens as f64 * keys)
            }
            Attending::Spans(spans) => {
                let w = window.unwrap_or(usize::MAX);
                spans
                    .iter()
                    .filter(|s| s.new > 0)
                    .fold((0.0, 0.0), |(read, attended), s| {
                        let last = s.past + s.new;
                        (
                            read + last.min(w) as f64,
                            attended + capped_sum(s.past + 1, last, w),
                        )
                    })
            }
        }
    }
}

/// Where the feed-forward half runs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum FfnPlace {
    /// On the device (the GPU alone).
    Device,
    /// On the cards: the device dispatches rows and combines partial sums.
    Cards {
        /// Rows sent per token: the cards one token's row goes to (expected, or as dispatched).
        rows_per_token: f64,
        /// Bytes per wire element.
        wire_bytes: u64,
    },
}

/// Distinct experts a group of `tokens` tokens touches in one MoE layer, on average, with
/// uniform routing of `k` of `e` experts per token.
pub fn distinct_experts(e: usize, k: usize, tokens: usize) -> f64 {
    if e == 0 {
        return 0.0;
    }
    let miss = 1.0 - k.min(e) as f64 / e as f64;
    e as f64 * (1.0 - miss.powi(tokens.min(i32::MAX as usize) as i32))
}

/// Bytes per parameter of the experts as stored (for the GPU holding them).
fn expert_bytes_per_param(config: &ModelConfig, device: &DeviceProfile) -> f64 {
    match config.quantization {
        Quantization::Mxfp4 => 4.25 / 8.0,
        Quantization::None => device.kernels.weight_bytes_per_param,
    }
}

/// The kernels of decoder layer `layer` for `group`.
pub fn layer_kernels(
    config: &ModelConfig,
    layer: usize,
    group: TokenGroup<'_>,
    ffn: FfnPlace,
    device: &DeviceProfile,
) -> Vec<Kernel> {
    let wb = device.kernels.weight_bytes_per_param;
    let kvb = device.kernels.kv_bytes_per_element;
    let h = config.hidden_size as f64;
    let q = config.q_dim() as f64;
    let kv = config.kv_dim() as f64;
    let n = group.tokens as f64;
    let window = match config.layers.get(layer).map(|l| l.attention) {
        Some(AttentionKind::Sliding { window }) => Some(window),
        _ => None,
    };
    let (keys_read, keys_attended) = group.keys(window);
    let mut out = vec![
        Kernel::new("input_norm", 3.0 * n * h * ACT + h * wb, 4.0 * n * h),
        Kernel::new(
            "qkv_proj",
            h * (q + 2.0 * kv) * wb + n * (h + q + 2.0 * kv) * ACT,
            2.0 * n * h * (q + 2.0 * kv),
        ),
        Kernel::new("rope_kv_write", 2.0 * n * (q + 2.0 * kv) * ACT, 8.0 * n * q),
        Kernel::new(
            "attention",
            keys_read * 2.0 * kv * kvb + 2.0 * n * q * ACT,
            4.0 * keys_attended * q,
        ),
        Kernel::new("o_proj", q * h * wb + n * (q + h) * ACT, 2.0 * n * q * h),
        Kernel::new("residual_norm", 4.0 * n * h * ACT + h * wb, 5.0 * n * h),
    ];
    let is_moe = config
        .layers
        .get(layer)
        .is_some_and(|l| l.ffn == FfnKind::Moe);
    let moe = config.moe.filter(|_| is_moe);
    if let Some(m) = moe {
        let e = m.num_experts as f64;
        out.push(Kernel::new(
            "router",
            e * h * wb + n * h * ACT,
            2.0 * n * e * h,
        ));
        out.push(Kernel::new("topk_softmax", 2.0 * n * e * ACT, 4.0 * n * e));
    }
    match ffn {
        FfnPlace::Device => {
            if let Some(m) = moe {
                let i = m.intermediate_size as f64;
                let k = m.top_k as f64;
                let active = distinct_experts(m.num_experts, m.top_k, group.tokens);
                let eb = expert_bytes_per_param(config, device);
                let eff = match config.quantization {
                    Quantization::Mxfp4 => device.kernels.mxfp4_moe_bandwidth_efficiency,
                    Quantization::None => 1.0,
                };
                let mut up = Kernel::new(
                    "moe_gate_up",
                    active * 2.0 * i * h * eb + n * h * ACT + n * k * 2.0 * i * ACT,
                    2.0 * n * k * 2.0 * i * h,
                );
                up.bandwidth_efficiency = eff;
                let mut down = Kernel::new(
                    "moe_down",
                    active * i * h * eb + n * k * (i + h) * ACT,
                    2.0 * n * k * i * h,
                );
                down.bandwidth_efficiency = eff;
                out.push(up);
                out.push(Kernel::new(
                    "moe_activation",
                    3.0 * n * k * i * ACT,
                    6.0 * n * k * i,
                ));
                out.push(down);
                out.push(Kernel::new(
                    "moe_combine",
                    n * (k + 2.0) * h * ACT,
                    2.0 * n * k * h,
                ));
            } else if let Some(di) = config.dense_intermediate_size {
                let di = di as f64;
                out.push(Kernel::new(
                    "mlp_gate_up",
                    2.0 * di * h * wb + n * (h + 2.0 * di) * ACT,
                    4.0 * n * di * h,
                ));
                out.push(Kernel::new(
                    "mlp_activation",
                    3.0 * n * di * ACT,
                    4.0 * n * di,
                ));
                out.push(Kernel::new(
                    "mlp_down",
                    di * h * wb + n * (di + h) * ACT,
                    2.0 * n * di * h,
                ));
            }
        }
        FfnPlace::Cards {
            rows_per_token: d,
            wire_bytes,
        } => {
            let w = wire_bytes as f64;
            let k = moe.map_or(0.0, |m| m.top_k as f64);
            // Pack each token's row once per card it goes to, with its expert ids and weights;
            // the NIC then writes them straight into the cards' inboxes.
            out.push(Kernel::new(
                "dispatch",
                n * h * ACT + n * d * (h * w + k * 8.0),
                n * d * h,
            ));
            // Sum the cards' partial sums in a fixed order and add the residual.
            out.push(Kernel::new(
                "combine",
                n * d * h * w + 2.0 * n * h * ACT,
                n * (d + 1.0) * h,
            ));
        }
    }
    out
}

/// Kernels before the first layer: the embedding lookup.
pub fn embedding_kernels(
    config: &ModelConfig,
    tokens: usize,
    device: &DeviceProfile,
) -> Vec<Kernel> {
    let h = config.hidden_size as f64;
    vec![Kernel::new(
        "embedding",
        tokens as f64 * h * (device.kernels.weight_bytes_per_param + ACT),
        0.0,
    )]
}

/// Kernels after the last layer, for `tokens` rows that need a next token.
pub fn head_kernels(
    config: &ModelConfig,
    tokens: usize,
    on_cards: bool,
    device: &DeviceProfile,
) -> Vec<Kernel> {
    let h = config.hidden_size as f64;
    let v = config.vocab_size as f64;
    let n = tokens as f64;
    let wb = device.kernels.weight_bytes_per_param;
    if on_cards {
        vec![
            Kernel::new("final_norm_send", 3.0 * n * h * ACT + h * wb, 4.0 * n * h),
            Kernel::new("merge_proposals", n * 64.0 * 8.0, n * 64.0),
        ]
    } else {
        vec![
            Kernel::new("final_norm", 3.0 * n * h * ACT + h * wb, 4.0 * n * h),
            Kernel::new("lm_head", v * h * wb + n * (h + v) * ACT, 2.0 * n * v * h),
            Kernel::new("sample", n * v * ACT, 4.0 * n * v),
        ]
    }
}

/// Weight bytes the device holds: attention, norms, router, embedding; plus experts, dense
/// FFNs and the LM head when it runs the whole model.
pub fn weight_bytes(config: &ModelConfig, whole_model: bool, device: &DeviceProfile) -> f64 {
    let wb = device.kernels.weight_bytes_per_param;
    let h = config.hidden_size as f64;
    let q = config.q_dim() as f64;
    let kv = config.kv_dim() as f64;
    let v = config.vocab_size as f64;
    let layers = config.num_layers() as f64;
    let bias = if config.attention_bias {
        q + 2.0 * kv + h
    } else {
        0.0
    };
    let attention = h * (q + 2.0 * kv) + q * h + bias + 2.0 * h;
    let router = config
        .moe
        .map_or(0.0, |m| (m.num_experts as f64) * (h + 1.0));
    // Every layer's attention and router, the embedding and the final norm.
    let mut bytes = (layers * (attention + router) + v * h + h) * wb;
    if whole_model {
        if !config.tie_word_embeddings {
            bytes += v * h * wb;
        }
        let eb = expert_bytes_per_param(config, device);
        for l in &config.layers {
            match (l.ffn, config.moe, config.dense_intermediate_size) {
                (FfnKind::Moe, Some(m), _) => {
                    let i = m.intermediate_size as f64;
                    let e = m.num_experts as f64;
                    // gate_up and down weights, and their biases (in bf16) when the model has them.
                    let biases = if m.expert_bias { 2.0 * i + h } else { 0.0 };
                    bytes += e * 3.0 * i * h * eb + e * biases * wb;
                }
                (FfnKind::Dense, _, Some(di)) => bytes += 3.0 * di as f64 * h * wb,
                _ => {}
            }
        }
    }
    bytes
}

/// KV-cache bytes of one sequence of `len` tokens (sliding layers keep only their window).
pub fn kv_bytes_per_sequence(config: &ModelConfig, len: usize, device: &DeviceProfile) -> f64 {
    let per_token_layer = 2.0 * config.kv_dim() as f64 * device.kernels.kv_bytes_per_element;
    config
        .layers
        .iter()
        .map(|l| match l.attention {
            AttentionKind::Sliding { window } => len.min(window) as f64,
            AttentionKind::Full => len as f64,
        })
        .sum::<f64>()
        * per_token_layer
}
