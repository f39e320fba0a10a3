//! `Qwen3MoeConfig` (transformers 5 defaults, which are those of Qwen3-30B-A3B's family).

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
pub(super) struct Qwen3MoeConfig {
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    moe_intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: usize,
    head_dim: Option<usize>,
    max_position_embeddings: usize,
    rms_norm_eps: f64,
    attention_bias: bool,
    use_sliding_window: bool,
    sliding_window: Option<usize>,
    max_window_layers: usize,
    layer_types: Option<Vec<String>>,
    decoder_sparse_step: usize,
    num_experts_per_tok: usize,
    num_experts: usize,
    /// What transformers 5 `save_pretrained` writes instead of `num_experts`.
    num_local_experts: Option<usize>,
    norm_topk_prob: bool,
    mlp_only_layers: Vec<usize>,
    tie_word_embeddings: bool,
    eos_token_id: Option<OneOrMany>,
    bos_token_id: Option<u32>,
}

impl Default for Qwen3MoeConfig {
    fn default() -> Self {
        Qwen3MoeConfig {
            vocab_size: 151936,
            hidden_size: 2048,
            intermediate_size: 6144,
            moe_intermediate_size: 768,
            num_hidden_layers: 24,
            num_attention_heads: 32,
            num_key_value_heads: 4,
            head_dim: None,
            max_position_embeddings: 32768,
            rms_norm_eps: 1e-6,
            attention_bias: false,
            use_sliding_window: false,
            sliding_window: Some(4096),
            max_window_layers: 28,
            layer_types: None,
            decoder_sparse_step: 1,
            num_experts_per_tok: 8,
            num_experts: 128,
            num_local_experts: None,
            norm_topk_prob: false,
            mlp_only_layers: Vec::new(),
            tie_word_embeddings: false,
            eos_token_id: None,
            bos_token_id: None,
        }
    }
}

impl Qwen3MoeConfig {
    pub(super) fn parse(value: Value, path: &Path) -> Result<Self> {
        let mut c: Self = parse_family(value.clone(), path)?;
        if value.get("num_experts").is_none() {
            c.num_experts = c.num_local_experts.unwrap_or(c.num_experts);
        }
        Ok(c)
    }

    pub(super) fn into_config(self, value: &Value, path: &Path) -> Result<ModelConfig> {
        let window = if self.use_sliding_window {
            self.sliding_window
        } else {
            None
        };
        let attention = match &self.layer_types {
            Some(types) if self.use_sliding_window => {
                layer_types_to_attention(types, self.num_hidden_layers, window, path)?
            }
            // Without use_sliding_window every layer is full, whatever layer_types says.
            _ => (0..self.num_hidden_layers)
                .map(|i| match window {
                    Some(window) if i >= self.max_window_layers => {
                        AttentionKind::Sliding { window }
                    }
                    _ => AttentionKind::Full,
                })
                .collect(),
        };
        let step = self.decoder_sparse_step.max(1);
        let ffn: Vec<FfnKind> = (0..self.num_hidden_layers)
            .map(|i| {
                let sparse = !self.mlp_only_layers.contains(&i)
                    && self.num_experts > 0
                    && (i + 1) % step == 0;
                if sparse { FfnKind::Moe } else { FfnKind::Dense }
            })
            .collect();
        let any_dense = ffn.contains(&FfnKind::Dense);
        let any_moe = ffn.contains(&FfnKind::Moe);
        let head_dim = self
            .head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1));
        Ok(ModelConfig {
            family: super::Family::Qwen3Moe,
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            num_heads: self.num_attention_heads,
            num_kv_heads: self.num_key_value_heads,
            head_dim,
            rms_norm_eps: self.rms_norm_eps,
            rope: RopeConfig::parse(value, 10000.0, self.max_position_embeddings, path)?,
            max_position_embeddings: self.max_position_embeddings,
            attention_bias: self.attention_bias,
            qk_norm: true,
            attention_sinks: false,
            layers: attention
                .into_iter()
                .zip(ffn)
                .map(|(attention, ffn)| LayerSpec { attention, ffn })
                .collect(),
            moe: any_moe.then_some(MoeSpec {
                num_experts: self.num_experts,
                top_k: self.num_experts_per_tok,
                intermediate_size: self.moe_intermediate_size,
                router: RouterKind::SoftmaxThenTopK {
                    renormalize: self.norm_topk_prob,
                },
                router_bias: false,
                expert_bias: false,
                activation: Activation::SwiGlu,
            }),
            dense_intermediate_size: any_dense.then_some(self.intermediate_size),
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
