//! `MixtralConfig` (transformers 5 defaults, which are those of Mixtral-8x7B).

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use super::{
    Activation, AttentionKind, FfnKind, LayerSpec, ModelConfig, MoeSpec, OneOrMany, Quantization,
    RopeConfig, RouterKind, layer_types_to_attention, parse_family,
};
use crate::error::Result;

#[derive(Debug, Deserialize)]
#[serde(default)]
pub(super) struct MixtralConfig {
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: usize,
    head_dim: Option<usize>,
    max_position_embeddings: usize,
    rms_norm_eps: f64,
    sliding_window: Option<usize>,
    layer_types: Option<Vec<String>>,
    num_experts_per_tok: usize,
    num_local_experts: usize,
    tie_word_embeddings: bool,
    eos_token_id: Option<OneOrMany>,
    bos_token_id: Option<u32>,
}

impl Default for MixtralConfig {
    fn default() -> Self {
        MixtralConfig {
            vocab_size: 32000,
            hidden_size: 4096,
            intermediate_size: 14336,
            num_hidden_layers: 32,
            num_attention_heads: 32,
            num_key_value_heads: 8,
            head_dim: None,
            max_position_embeddings: 4096 * 32,
            rms_norm_eps: 1e-5,
            sliding_window: None,
            layer_types: None,
            num_experts_per_tok: 2,
            num_local_experts: 8,
            tie_word_embeddings: false,
            eos_token_id: Some(OneOrMany::One(2)),
            bos_token_id: Some(1),
        }
    }
}

impl MixtralConfig {
    pub(super) fn parse(value: Value, path: &Path) -> Result<Self> {
        parse_family(value, path)
    }

    pub(super) fn into_config(self, value: &Value, path: &Path) -> Result<ModelConfig> {
        let attention = match &self.layer_types {
            Some(types) => {
                layer_types_to_attention(types, self.num_hidden_layers, self.sliding_window, path)?
            }
            None => vec![
                match self.sliding_window {
                    Some(window) => AttentionKind::Sliding { window },
                    None => AttentionKind::Full,
                };
                self.num_hidden_layers
            ],
        };
        let head_dim = self
            .head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1));
        Ok(ModelConfig {
            family: super::Family::Mixtral,
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            num_heads: self.num_attention_heads,
            num_kv_heads: self.num_key_value_heads,
            head_dim,
            rms_norm_eps: self.rms_norm_eps,
            rope: RopeConfig::parse(value, 1e6, self.max_position_embeddings, path)?,
            max_position_embeddings: self.max_position_embeddings,
            attention_bias: false,
            qk_norm: false,
            attention_sinks: false,
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
                router: RouterKind::SoftmaxThenTopK { renormalize: true },
                router_bias: false,
                expert_bias: false,
                activation: Activation::SwiGlu,
            }),
            dense_intermediate_size: None,
            tie_word_embeddings: self.tie_word_embeddings,
            quantization: Quantization::None,
            eos_token_ids: self
                .eos_token_id
                .map(OneOrMany::into_vec)
                .unwrap_or_default(),
            bos_token_id: self.bos_token_id,
        })
    }
}
