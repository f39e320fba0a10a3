//! Shapes of the synthetic presets, and the config.json / tokenizer files they come with.

use serde_json::{Value, json};

use crate::config::Family;
use crate::error::{Error, Result};

/// Named model sizes for `afd synth`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Preset {
    /// A few hundred KB: unit and integration tests.
    Tiny,
    /// Tens of MB: quick end-to-end runs.
    Small,
    /// A few hundred MB: big enough that decode speed is bound by weights, not overheads.
    Medium,
    /// GPT-OSS-20B's exact shape (use `--config-only` unless you want 13 GB of random weights).
    GptOss20b,
}

impl std::str::FromStr for Preset {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "tiny" => Ok(Preset::Tiny),
            "small" => Ok(Preset::Small),
            "medium" => Ok(Preset::Medium),
            "gpt-oss-20b" => Ok(Preset::GptOss20b),
            other => Err(format!(
                "unknown preset `{other}`: expected tiny, small, medium or gpt-oss-20b"
            )),
        }
    }
}

/// The dimensions a preset fixes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    /// Vocabulary rows.
    pub vocab: usize,
    /// Residual width.
    pub hidden: usize,
    /// Expert intermediate width.
    pub expert_intermediate: usize,
    /// Dense FFN intermediate width (Qwen3-MoE dense layers).
    pub dense_intermediate: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Head width.
    pub head_dim: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Experts per MoE layer.
    pub experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Sliding window (GPT-OSS even layers).
    pub window: usize,
}

/// The dimensions of `preset` for `family`.
pub fn dims(family: Family, preset: Preset) -> Result<Dims> {
    let d = |vocab, hidden, ei, di, heads, kv, hd, layers, experts, top_k, window| Dims {
        vocab,
        hidden,
        expert_intermediate: ei,
        dense_intermediate: di,
        heads,
        kv_heads: kv,
        head_dim: hd,
        layers,
        experts,
        top_k,
        window,
    };
    Ok(match (family, preset) {
        (Family::GptOss, Preset::Tiny) => d(320, 64, 64, 0, 4, 2, 16, 2, 4, 2, 4),
        (Family::GptOss, Preset::Small) => d(2048, 256, 256, 0, 8, 2, 32, 4, 8, 2, 16),
        (Family::GptOss, Preset::Medium) => d(32000, 1024, 1024, 0, 16, 4, 64, 8, 16, 4, 128),
        (Family::GptOss, Preset::GptOss20b) => d(201088, 2880, 2880, 0, 64, 8, 64, 24, 32, 4, 128),
        (Family::Mixtral, Preset::Tiny) => d(320, 64, 128, 0, 4, 2, 16, 2, 4, 2, 0),
        (Family::Mixtral, Preset::Small) => d(2048, 256, 512, 0, 8, 4, 32, 4, 8, 2, 0),
        // 364M parameters: the shape of the transformers comparison in DESIGN.md.
        (Family::Mixtral, Preset::Medium) => d(32000, 768, 2048, 0, 12, 4, 64, 8, 8, 2, 0),
        (Family::Qwen3Moe, Preset::Tiny) => d(320, 64, 32, 128, 4, 2, 16, 3, 8, 2, 0),
        (Family::Qwen3Moe, Preset::Small) => d(2048, 256, 128, 512, 8, 4, 32, 4, 16, 4, 0),
        (Family::Qwen3Moe, Preset::Medium) => d(32000, 768, 512, 2048, 12, 4, 64, 8, 32, 4, 0),
        (f, Preset::GptOss20b) => {
            return Err(Error::InvalidInput(format!(
                "preset gpt-oss-20b is GPT-OSS's shape; it cannot be used with --family {f}"
            )));
        }
    })
}

/// Special tokens of the synthetic tokenizer (ids 256, 257, ...), and which of them end
/// generation.
pub fn specials(family: Family) -> (&'static [&'static str], &'static [&'static str]) {
    match family {
        Family::GptOss => (
            &[
                "<|startoftext|>",
                "<|endoftext|>",
                "<|return|>",
                "<|start|>",
                "<|end|>",
                "<|message|>",
                "<|channel|>",
                "<|constrain|>",
                "<|call|>",
            ],
            &["<|return|>", "<|call|>"],
        ),
        Family::Mixtral => (&["<unk>", "<s>", "</s>"], &["</s>"]),
        Family::Qwen3Moe => (
            &["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            &["<|im_end|>", "<|endoftext|>"],
        ),
    }
}

/// The chat template shipped with synthetic checkpoints of `family`.
pub fn chat_template(family: Family) -> &'static str {
    match family {
        Family::GptOss => {
            "{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}\
             {% if add_generation_prompt %}<|start|>assistant{% endif %}"
        }
        Family::Mixtral => {
            "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]\
             {% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
        }
        Family::Qwen3Moe => {
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}\
             {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
        }
    }
}

/// config.json for `family` with dimensions `d`; `mxfp4` adds the hub quantization block.
pub fn config_json(
    family: Family,
    d: &Dims,
    mxfp4: bool,
    eos: &[u32],
    bos: Option<u32>,
    dtype: &str,
) -> Value {
    match family {
        Family::GptOss => {
            let layer_types: Vec<&str> = (0..d.layers)
                .map(|i| {
                    if i % 2 == 0 {
                        "sliding_attention"
                    } else {
                        "full_attention"
                    }
                })
                .collect();
            let mut c = json!({
                "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
                "num_hidden_layers": d.layers, "num_local_experts": d.experts,
                "num_experts_per_tok": d.top_k, "vocab_size": d.vocab, "hidden_size": d.hidden,
                "intermediate_size": d.expert_intermediate, "head_dim": d.head_dim,
                "num_attention_heads": d.heads, "num_key_value_heads": d.kv_heads,
                "sliding_window": d.window, "layer_types": layer_types,
                "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                "rope_theta": 150000.0,
                "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "truncate": false, "original_max_position_embeddings": 4096},
                "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "attention_bias": true,
                "tie_word_embeddings": false, "eos_token_id": eos, "bos_token_id": bos,
                "torch_dtype": dtype,
            });
            if mxfp4 {
                c["quantization_config"] = json!({"quant_method": "mxfp4",
                    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                               "model.embed_tokens", "lm_head"]});
            }
            c
        }
        Family::Mixtral => json!({
            "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "vocab_size": d.vocab, "hidden_size": d.hidden, "intermediate_size": d.expert_intermediate,
            "num_hidden_layers": d.layers, "num_attention_heads": d.heads,
            "num_key_value_heads": d.kv_heads, "head_dim": d.head_dim,
            "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
            "sliding_window": null, "num_experts_per_tok": d.top_k, "num_local_experts": d.experts,
            "tie_word_embeddings": false, "eos_token_id": eos, "bos_token_id": bos,
            "torch_dtype": dtype,
        }),
        Family::Qwen3Moe => json!({
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "vocab_size": d.vocab, "hidden_size": d.hidden, "intermediate_size": d.dense_intermediate,
            "moe_intermediate_size": d.expert_intermediate, "num_hidden_layers": d.layers,
            "num_attention_heads": d.heads, "num_key_value_heads": d.kv_heads, "head_dim": d.head_dim,
            "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
            "use_sliding_window": false, "max_window_layers": d.layers, "decoder_sparse_step": 1,
            "mlp_only_layers": [0], "num_experts": d.experts, "num_experts_per_tok": d.top_k,
            "norm_topk_prob": true, "tie_word_embeddings": true, "eos_token_id": eos,
            "bos_token_id": bos, "attention_bias": false, "torch_dtype": dtype,
        }),
    }
}
