//! `config.json` of the supported families, parsed into one family-neutral [`ModelConfig`].
//!
//! Each family has its own serde struct mirroring Hugging Face's config class (field names,
//! aliases and defaults of transformers 5), and a conversion into [`ModelConfig`], which is
//! all the rest of afd looks at.

mod gpt_oss;
mod mixtral;
mod qwen3_moe;
mod rope;

use std::path::Path;

use serde::Deserialize;

pub use rope::{RopeConfig, RopeScaling};

use crate::error::{Error, Result};

/// The model families afd can load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Family {
    /// OpenAI GPT-OSS (`model_type: "gpt_oss"`).
    GptOss,
    /// Mistral's Mixtral (`model_type: "mixtral"`).
    Mixtral,
    /// Qwen3-MoE (`model_type: "qwen3_moe"`).
    Qwen3Moe,
}

impl Family {
    /// The `model_type` string of config.json.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::GptOss => "gpt_oss",
            Family::Mixtral => "mixtral",
            Family::Qwen3Moe => "qwen3_moe",
        }
    }

    /// The name used on afd's command line (`--family`).
    pub fn cli_name(self) -> &'static str {
        match self {
            Family::GptOss => "gpt-oss",
            Family::Mixtral => "mixtral",
            Family::Qwen3Moe => "qwen3-moe",
        }
    }
}

impl std::fmt::Display for Family {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.cli_name())
    }
}

impl std::str::FromStr for Family {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "gpt-oss" | "gpt_oss" => Ok(Family::GptOss),
            "mixtral" => Ok(Family::Mixtral),
            "qwen3-moe" | "qwen3_moe" => Ok(Family::Qwen3Moe),
            other => Err(format!(
                "unknown model family `{other}`: expected gpt-oss, mixtral or qwen3-moe"
            )),
        }
    }
}

/// Which keys a layer's attention may see.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionKind {
    /// Causal over the whole past.
    Full,
    /// Causal over the last `window` keys, the current one included (Hugging Face semantics:
    /// key `j` is visible from query `i` when `i - window < j <= i`).
    Sliding {
        /// Number of keys visible, the current one included.
        window: usize,
    },
}

/// The feed-forward half of a layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FfnKind {
    /// A routed mixture of experts.
    Moe,
    /// A dense SwiGLU MLP (Qwen3-MoE `mlp_only_layers`, `decoder_sparse_step`).
    Dense,
}

/// One decoder layer's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerSpec {
    /// Attention span.
    pub attention: AttentionKind,
    /// Feed-forward kind.
    pub ffn: FfnKind,
}

/// How router logits become (expert, weight) pairs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouterKind {
    /// GPT-OSS: top-k of the logits, then a softmax over those k logits.
    TopKThenSoftmax,
    /// Mixtral, Qwen3-MoE: softmax over all experts, top-k of the probabilities, then
    /// (when `renormalize`) divide by their sum. Mixtral always renormalizes; Qwen3-MoE does
    /// when `norm_topk_prob`.
    SoftmaxThenTopK {
        /// Divide the k selected probabilities by their sum.
        renormalize: bool,
    },
}

/// The gated activation of an expert (and of dense FFN layers).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Activation {
    /// `silu(gate) * up` (Mixtral, Qwen3-MoE).
    SwiGlu,
    /// GPT-OSS: `gate = min(gate, limit)`, `up = clamp(up, -limit, limit)`,
    /// `(up + 1) * gate * sigmoid(alpha * gate)`.
    ClampedSwiGlu {
        /// `swiglu_alpha` (1.702).
        alpha: f32,
        /// `swiglu_limit` (7.0).
        limit: f32,
    },
}

/// The mixture-of-experts part of the config.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeSpec {
    /// Experts per MoE layer.
    pub num_experts: usize,
    /// Experts chosen per token.
    pub top_k: usize,
    /// Intermediate size of one expert.
    pub intermediate_size: usize,
    /// Routing rule.
    pub router: RouterKind,
    /// Whether the router gate has a bias (GPT-OSS).
    pub router_bias: bool,
    /// Whether the experts' projections have biases (GPT-OSS).
    pub expert_bias: bool,
    /// The experts' activation.
    pub activation: Activation,
}

/// How the expert weights are stored in the checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quantization {
    /// Plain floating-point tensors (f32, bf16, f16).
    None,
    /// MXFP4 `*_blocks` / `*_scales` for the experts (GPT-OSS hub checkpoints).
    Mxfp4,
}

/// Everything afd needs to know about a model's shape, whatever its family.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// The family it was read as.
    pub family: Family,
    /// Rows of the embedding and of the LM head.
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (grouped-query attention).
    pub num_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Epsilon of every RMSNorm.
    pub rms_norm_eps: f64,
    /// Rotary embedding.
    pub rope: RopeConfig,
    /// Longest position the model was configured for.
    pub max_position_embeddings: usize,
    /// Whether q/k/v/o projections carry biases.
    pub attention_bias: bool,
    /// Whether q and k get a per-head RMSNorm before RoPE (Qwen3).
    pub qk_norm: bool,
    /// Whether attention has learned sink logits per head (GPT-OSS).
    pub attention_sinks: bool,
    /// One entry per decoder layer.
    pub layers: Vec<LayerSpec>,
    /// The experts, when any layer is MoE.
    pub moe: Option<MoeSpec>,
    /// Intermediate size of dense FFN layers, when any.
    pub dense_intermediate_size: Option<usize>,
    /// Whether the LM head reuses the embedding matrix.
    pub tie_word_embeddings: bool,
    /// How the expert weights are stored.
    pub quantization: Quantization,
    /// End-of-sequence ids from config.json (generation_config.json may add more).
    pub eos_token_ids: Vec<u32>,
    /// Beginning-of-sequence id, if the config names one.
    pub bos_token_id: Option<u32>,
}

impl ModelConfig {
    /// Reads and interprets a `config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::from_json(&text, path)
    }

    /// Interprets the text of a `config.json`; `path` is only used in error messages.
    pub fn from_json(text: &str, path: &Path) -> Result<Self> {
        let value: serde_json::Value = serde_json::from_str(text).map_err(|e| Error::Json {
            path: path.to_path_buf(),
            what: "config.json",
            source: e,
        })?;
        let model_type = value
            .get("model_type")
            .and_then(|v| v.as_str())
            .ok_or_else(|| {
                Error::config(
                    path,
                    "config.json has no `model_type`; afd reads gpt_oss, mixtral and qwen3_moe",
                )
            })?;
        let config = match model_type {
            "gpt_oss" => {
                gpt_oss::GptOssConfig::parse(value.clone(), path)?.into_config(&value, path)?
            }
            "mixtral" => {
                mixtral::MixtralConfig::parse(value.clone(), path)?.into_config(&value, path)?
            }
            "qwen3_moe" => {
                qwen3_moe::Qwen3MoeConfig::parse(value.clone(), path)?.into_config(&value, path)?
            }
            other => {
                return Err(Error::config(
                    path,
                    format!(
                        "model_type `{other}` is not supported; afd reads gpt_oss, mixtral and qwen3_moe"
                    ),
                ));
            }
        };
        config.validate(path)?;
        Ok(config)
    }

    /// Number of decoder layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Per decoder layer, whether its feed-forward half is a mixture of experts.
    pub fn moe_layers(&self) -> Vec<bool> {
        self.layers.iter().map(|l| l.ffn == FfnKind::Moe).collect()
    }

    /// Query heads per key/value head.
    pub fn group_size(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }

    /// Width of all query heads together.
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    /// Width of all key (or value) heads together.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Checks the invariants the forward relies on.
    fn validate(&self, path: &Path) -> Result<()> {
        let fail = |m: String| Err(Error::config(path, m));
        if self.hidden_size == 0 || self.vocab_size == 0 || self.layers.is_empty() {
            return fail("hidden_size, vocab_size and num_hidden_layers must be positive".into());
        }
        if self.num_heads == 0
            || self.num_kv_heads == 0
            || !self.num_heads.is_multiple_of(self.num_kv_heads)
        {
            return fail(format!(
                "num_attention_heads ({}) must be a positive multiple of num_key_value_heads ({})",
                self.num_heads, self.num_kv_heads
            ));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return fail(format!(
                "head_dim ({}) must be even and positive",
                self.head_dim
            ));
        }
        for (i, layer) in self.layers.iter().enumerate() {
            if let AttentionKind::Sliding { window: 0 } = layer.attention {
                return fail(format!("layer {i} has a sliding window of 0"));
            }
            if layer.ffn == FfnKind::Moe && self.moe.is_none() {
                return fail(format!("layer {i} is MoE but the config has no experts"));
            }
            if layer.ffn == FfnKind::Dense && self.dense_intermediate_size.is_none() {
                return fail(format!(
                    "layer {i} is dense but the config has no intermediate_size"
                ));
            }
        }
        if let Some(moe) = &self.moe {
            if moe.num_experts == 0 || moe.top_k == 0 || moe.top_k > moe.num_experts {
                return fail(format!(
                    "num_experts_per_tok ({}) must be between 1 and the number of experts ({})",
                    moe.top_k, moe.num_experts
                ));
            }
            if self.quantization == Quantization::Mxfp4
                && (!self.hidden_size.is_multiple_of(32) || moe.intermediate_size % 32 != 0)
            {
                return fail(format!(
                    "MXFP4 needs hidden_size ({}) and intermediate_size ({}) to be multiples of 32",
                    self.hidden_size, moe.intermediate_size
                ));
            }
        }
        Ok(())
    }
}

/// Deserializes a family struct from the config value with a clear error.
pub(crate) fn parse_family<T: for<'de> Deserialize<'de>>(
    value: serde_json::Value,
    path: &Path,
) -> Result<T> {
    serde_json::from_value(value).map_err(|e| Error::Json {
        path: path.to_path_buf(),
        what: "config.json",
        source: e,
    })
}

/// `eos_token_id` may be a single id or a list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub(crate) enum OneOrMany {
    One(u32),
    Many(Vec<u32>),
}

impl OneOrMany {
    pub(crate) fn into_vec(self) -> Vec<u32> {
        match self {
            OneOrMany::One(id) => vec![id],
            OneOrMany::Many(ids) => ids,
        }
    }
}

/// Reads `layer_types` (transformers 5) into attention kinds, if present.
pub(crate) fn layer_types_to_attention(
    layer_types: &[String],
    num_layers: usize,
    sliding_window: Option<usize>,
    path: &Path,
) -> Result<Vec<AttentionKind>> {
    if layer_types.len() != num_layers {
        return Err(Error::config(
            path,
            format!(
                "layer_types has {} entries but num_hidden_layers is {num_layers}",
                layer_types.len()
            ),
        ));
    }
    layer_types
        .iter()
        .enumerate()
        .map(|(i, t)| match t.as_str() {
            "full_attention" => Ok(AttentionKind::Full),
            "sliding_attention" => match sliding_window {
                Some(window) => Ok(AttentionKind::Sliding { window }),
                None => Err(Error::config(
                    path,
                    format!("layer {i} is sliding_attention but sliding_window is null"),
                )),
            },
            other => Err(Error::config(
                path,
                format!("layer {i} has layer_type `{other}`; expected full_attention or sliding_attention"),
            )),
        })
        .collect()
}

#[cfg(test)]
mod tests;
