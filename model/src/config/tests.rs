use std::path::Path;

use super::*;

fn parse(json: &str) -> Result<ModelConfig> {
    ModelConfig::from_json(json, Path::new("config.json"))
}

const GPT_OSS_20B_HUB: &str = r#"{
  "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
  "num_hidden_layers": 24, "num_local_experts": 32, "experts_per_token": 4,
  "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880, "head_dim": 64,
  "num_attention_heads": 64, "num_key_value_heads": 8, "sliding_window": 128,
  "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 150000,
  "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                   "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": false},
  "swiglu_limit": 7.0, "tie_word_embeddings": false, "eos_token_id": 200002,
  "quantization_config": {"quant_method": "mxfp4",
     "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
}"#;

#[test]
fn gpt_oss_hub_style_rope_and_defaults() {
    let c = parse(GPT_OSS_20B_HUB).unwrap();
    assert_eq!(c.family, Family::GptOss);
    assert_eq!(c.num_layers(), 24);
    assert_eq!(c.quantization, Quantization::Mxfp4);
    assert_eq!(c.rope.theta, 150000.0);
    // Even layers slide, odd layers are full.
    assert_eq!(
        c.layers[0].attention,
        AttentionKind::Sliding { window: 128 }
    );
    assert_eq!(c.layers[1].attention, AttentionKind::Full);
    let moe = c.moe.unwrap();
    assert_eq!((moe.num_experts, moe.top_k), (32, 4));
    assert_eq!(
        moe.activation,
        Activation::ClampedSwiGlu {
            alpha: 1.702,
            limit: 7.0
        }
    );
    assert_eq!(c.eos_token_ids, vec![200002]);
    assert!((c.rope.attention_factor() as f64 - 1.3465735902799727).abs() < 1e-6);
}

#[test]
fn yarn_inv_freq_matches_transformers() {
    let c = parse(GPT_OSS_20B_HUB).unwrap();
    let f = c.rope.inv_freq(64);
    // Values printed by transformers 5.24 for the real config (docs/reference/gpt-oss.md §3.3).
    let expect = [
        (0, 1.0),
        (1, 0.689_044_3),
        (2, 0.47478205),
        (3, 0.32714587),
        (8, 0.050813273),
        (9, 0.031705696),
        (10, 0.019_335),
        (11, 0.011592049),
        (28, 9.2420896e-07),
        (29, 6.368_209e-7),
        (30, 4.3879785e-07),
        (31, 3.0235114e-07),
    ];
    for (i, v) in expect {
        assert!(
            ((f[i] - v) / v).abs() < 2e-6,
            "inv_freq[{i}] = {} expected {v}",
            f[i]
        );
    }
}

#[test]
fn gpt_oss_v5_rope_parameters_and_layer_types() {
    let json = r#"{"model_type": "gpt_oss", "num_hidden_layers": 3, "num_local_experts": 4,
      "num_experts_per_tok": 2, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 64,
      "head_dim": 16, "num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": 4,
      "layer_types": ["full_attention", "sliding_attention", "full_attention"],
      "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
         "truncate": false, "original_max_position_embeddings": 4096, "rope_theta": 150000.0},
      "swiglu_alpha": 1.5, "swiglu_limit": 5.0}"#;
    let c = parse(json).unwrap();
    assert_eq!(c.layers[0].attention, AttentionKind::Full);
    assert_eq!(c.layers[1].attention, AttentionKind::Sliding { window: 4 });
    assert_eq!(c.rope.theta, 150000.0);
    assert!(matches!(
        c.rope.scaling,
        RopeScaling::Yarn {
            truncate: false,
            ..
        }
    ));
    assert_eq!(
        c.moe.unwrap().activation,
        Activation::ClampedSwiGlu {
            alpha: 1.5,
            limit: 5.0
        }
    );
    assert_eq!(c.quantization, Quantization::None);
}

#[test]
fn mixtral_sliding_window_null_or_set() {
    let base = r#""model_type": "mixtral", "num_hidden_layers": 2, "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100"#;
    let full = parse(&format!("{{{base}, \"sliding_window\": null}}")).unwrap();
    assert!(
        full.layers
            .iter()
            .all(|l| l.attention == AttentionKind::Full)
    );
    assert_eq!(full.head_dim, 16);
    assert_eq!(
        full.moe.unwrap().router,
        RouterKind::SoftmaxThenTopK { renormalize: true }
    );
    let sliding = parse(&format!("{{{base}, \"sliding_window\": 6}}")).unwrap();
    assert!(
        sliding
            .layers
            .iter()
            .all(|l| l.attention == AttentionKind::Sliding { window: 6 })
    );
    assert_eq!(sliding.rope.theta, 1e6);
}

#[test]
fn qwen3_moe_dense_layers_and_norm_topk() {
    let json = r#"{"model_type": "qwen3_moe", "num_hidden_layers": 4, "hidden_size": 64,
      "intermediate_size": 96, "moe_intermediate_size": 32, "num_attention_heads": 4,
      "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 100, "num_experts": 8,
      "num_experts_per_tok": 2, "norm_topk_prob": true, "mlp_only_layers": [0],
      "decoder_sparse_step": 2, "tie_word_embeddings": true}"#;
    let c = parse(json).unwrap();
    let kinds: Vec<FfnKind> = c.layers.iter().map(|l| l.ffn).collect();
    // Layer 0 is in mlp_only_layers; with decoder_sparse_step 2 only layers 1 and 3 are sparse.
    assert_eq!(
        kinds,
        vec![FfnKind::Dense, FfnKind::Moe, FfnKind::Dense, FfnKind::Moe]
    );
    assert_eq!(c.dense_intermediate_size, Some(96));
    assert_eq!(c.moe.unwrap().intermediate_size, 32);
    assert_eq!(
        c.moe.unwrap().router,
        RouterKind::SoftmaxThenTopK { renormalize: true }
    );
    assert!(c.qk_norm && c.tie_word_embeddings);
    assert_eq!(c.head_dim, 32);
}

#[test]
fn clear_errors() {
    let err = parse(r#"{"model_type": "llama4"}"#)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("llama4") && err.contains("not supported"),
        "{err}"
    );
    let err = parse("{").unwrap_err().to_string();
    assert!(err.contains("config.json"), "{err}");
    let err =
        parse(r#"{"model_type": "mixtral", "num_attention_heads": 6, "num_key_value_heads": 4}"#)
            .unwrap_err()
            .to_string();
    assert!(err.contains("num_key_value_heads"), "{err}");
    let err =
        parse(r#"{"model_type": "gpt_oss", "quantization_config": {"quant_method": "gptq"}}"#)
            .unwrap_err()
            .to_string();
    assert!(err.contains("gptq"), "{err}");
    let err = parse(
        r#"{"model_type": "mixtral", "rope_scaling": {"rope_type": "longrope", "factor": 2.0}}"#,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("longrope"), "{err}");
}
