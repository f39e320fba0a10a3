//! `GptOssConfig` (transformers 5 defaults, which are those of gpt-oss-120b).

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use super::{
    Activation, AttentionKind, FfnKind, LayerSpec, ModelConfig, MoeSpec, OneOrMany, Quantization,
    RopeConfig, RouterKind, layer_types_to_attention, parse_family,
};
use crate::error::{Error, Result};

#[derive(Debug, Deserialize)]
#[serde(default)]
pub(super) struct GptOssConfig {
    num_hidden_layers: usize,
    num_local_experts: usize,
    /// OpenAI's original name of `num_local_experts` (hub configs may carry both).
    num_experts: Option<usize>,
    num_experts_per_tok: usize,
    /// OpenAI's original name of `num_experts_per_tok`.
    experts_per_token: Option<usize>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    head_dim: usize,
    num_attention_heads: usize,
    num_key_value_heads: usize,
    sliding_window: Option<usize>,
    layer_types: Option<Vec<String>>,
    max_position_embeddings: usize,
    rms_norm_eps: f64,
    swiglu_alpha: f32,
    swiglu_limit: f32,
    attention_bias: bool,
    tie_word_embeddings: bool,
    eos_token_id: Option<OneOrMany>,
    bos_token_id: Option<u32>,
    quantization_config: Option<Value>,
}

impl Default for GptOssConfig {
    fn default() -> Self {
        GptOssConfig {
            num_hidden_layers: 36,
            num_local_experts: 128,
            num_experts: None,
            num_experts_per_tok: 4,
            experts_per_token: None,
            vocab_size: 201088,
            hidden_size: 2880,
            intermediate_size: 2880,
            head_dim: 64,
            num_attention_heads: 64,
            num_key_value_heads: 8,
            sliding_window: Some(128),
            layer_types: None,
            max_position_embeddings: 131072,
            rms_norm_eps: 1e-5,
            swiglu_alpha: 1.702,
            swiglu_limit: 7.0,
            attention_bias: true,
            tie_word_embeddings: false,
            eos_token_id: None,
            bos_token_id: None,
            quantization_config: None,
        }
    }
}

impl GptOssConfig {
    pub(super) fn parse(value: Value, path: &Path) -> Result<Self> {
        let mut c: Self = parse_family(value.clone(), path)?;
        // The transformers name wins when both spellings are present.
        if value.get("num_local_experts").is_none() {
            c.num_local_experts = c.num_experts.unwrap_or(c.num_local_experts);
        }
        if value.get("num_experts_per_tok").is_none() {
            c.num_experts_per_tok = c.experts_per_token.unwrap_or(c.num_experts_per_tok);
        }
        Ok(c)
    }

    pub(super) fn into_config(self, value: &Value, path: &Path) -> Result<ModelConfig> {
        let attention = match &self.layer_types {
            Some(types) => {
                layer_types_to_attention(types, self.num_hidden_layers, self.sliding_window, path)?
            }
            // Even layers slide, odd layers see everything (transformers' default).
            None => (0..self.num_hidden_layers)
                .map(|i| match (i % 2, self.sliding_window) {
                    (0, Some(window)) => AttentionKind::Sliding { window },
                    _ => AttentionKind::Full,
                })
                .collect(),
        };
        let quantization = match &self.quantization_config {
            None | Some(Value::Null) => Quantization::None,
            Some(q) => match q.get("quant_method").and_then(Value::as_str) {
                Some("mxfp4") => Quantization::Mxfp4,
                other => {
                    return Err(Error::config(
                        path,
                        format!(
                            "quantization_config.quant_method {other:?} is not supported for gpt_oss \
                             (mxfp4 and unquantized checkpoints are)"
                        ),
                    ));
                }
            },
        };
        Ok(ModelConfig {
            family: super::Family::GptOss,
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            num_heads: self.num_attention_heads,
            num_kv_heads: self.num_key_value_heads,
            head_dim: self.head_dim,
            rms_norm_eps: self.rms_norm_eps,
            rope: RopeConfig::parse(value, 150000.0, self.max_position_embeddings, path)?,
            max_position_embeddings: self.max_position_embeddings,
            attention_bias: self.attention_bias,
            qk_norm: false,
            attention_sinks: true,
            layers: attention
                .into_iter()
                .map(|attention| LayerSpec {
                    attention,
                    ffn: FfnKind::Moe,
                })
                .collect(),
            moe: Some(MoeSpec {
                num_experts: self.num_local_experts,
                top_k: self.num_experts_per_tok,
                intermediate_size: self.intermediate_size,
                router: RouterKind::TopKThenSoftmax,
                router_bias: true,
                expert_bias: true,
                activation: Activation::ClampedSwiGlu {
                    alpha: self.swiglu_alpha,
                    limit: self.swiglu_limit,
                },
            }),
            dense_intermediate_size: None,
            tie_word_embeddings: self.tie_word_embeddings,
            quantization,
            eos_token_ids: self
                .eos_token_id
                .map(OneOrMany::into_vec)
                .unwrap_or_default(),
            bos_token_id: self.bos_token_id,
        })
    }
}
