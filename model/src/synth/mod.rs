//! Synthetic checkpoints in Hugging Face layout (`afd synth`): random weights of any preset
//! size, with config.json, generation_config.json, a byte-level tokenizer and a chat template.
//!
//! Weights are drawn per tensor from a generator seeded by (seed, tensor name), so a tensor's
//! values do not depend on which others are written. Scales keep activations O(1) and make the
//! LM head's logits peaked enough that greedy decoding has no near-ties.

mod presets;
mod writer;

use std::path::{Path, PathBuf};

pub use presets::{Dims, Preset, dims};
pub use writer::{TensorPlan, write_safetensors};

use crate::config::{Family, ModelConfig};
use crate::error::{Error, Result};
use crate::mxfp4;
use crate::tokenizer::byte_level_tokenizer_json;

/// Storage format of the synthetic weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SynthFormat {
    /// Everything in f32.
    F32,
    /// Everything in bf16 (what `save_pretrained` writes for a bf16 model).
    Bf16,
    /// GPT-OSS hub layout: experts as MXFP4 blocks and scales, the rest bf16.
    Mxfp4,
}

impl std::str::FromStr for SynthFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(SynthFormat::F32),
            "bf16" => Ok(SynthFormat::Bf16),
            "mxfp4" => Ok(SynthFormat::Mxfp4),
            other => Err(format!(
                "unknown format `{other}`: expected bf16, mxfp4 or f32"
            )),
        }
    }
}

/// What to synthesize.
#[derive(Debug, Clone)]
pub struct SynthOptions {
    /// Model family.
    pub family: Family,
    /// Size preset.
    pub preset: Preset,
    /// Weight format; `None` picks MXFP4 for gpt-oss-20b and bf16 otherwise.
    pub format: Option<SynthFormat>,
    /// Seed of every random draw.
    pub seed: u64,
    /// Write config.json (and the tokenizer files) only, no weights.
    pub config_only: bool,
}

/// What was written.
#[derive(Debug, Clone)]
pub struct SynthReport {
    /// The checkpoint folder.
    pub dir: PathBuf,
    /// The configuration as afd reads it back.
    pub config: ModelConfig,
    /// Parameters (MXFP4 values counted one each).
    pub parameters: u64,
    /// Bytes of weights written (0 with `config_only`).
    pub weight_bytes: u64,
}

/// The format actually used for `options`.
pub fn resolved_format(options: &SynthOptions) -> Result<SynthFormat> {
    let format = options.format.unwrap_or(match options.preset {
        Preset::GptOss20b => SynthFormat::Mxfp4,
        _ => SynthFormat::Bf16,
    });
    if format == SynthFormat::Mxfp4 && options.family != Family::GptOss {
        return Err(Error::InvalidInput(format!(
            "--format mxfp4 is the GPT-OSS hub layout; {} checkpoints are bf16 or f32",
            options.family
        )));
    }
    Ok(format)
}

/// The special tokens of a family's synthetic tokenizer and the ids they get.
struct Identity {
    specials: &'static [&'static str],
    stops: &'static [&'static str],
    eos: Vec<u32>,
    bos: Option<u32>,
}

fn identity(family: Family) -> Identity {
    let (specials, stops) = presets::specials(family);
    let id = |t: &str| {
        specials
            .iter()
            .position(|s| *s == t)
            .map(|i| 256 + i as u32)
    };
    let eos: Vec<u32> = stops.iter().filter_map(|t| id(t)).collect();
    let bos = match family {
        Family::GptOss => id("<|startoftext|>"),
        Family::Mixtral => id("<s>"),
        Family::Qwen3Moe => None,
    };
    Identity {
        specials,
        stops,
        eos,
        bos,
    }
}

fn config_value(
    options: &SynthOptions,
    format: SynthFormat,
    d: &Dims,
    eos: &[u32],
    bos: Option<u32>,
) -> serde_json::Value {
    let dtype = if format == SynthFormat::F32 {
        "float32"
    } else {
        "bfloat16"
    };
    presets::config_json(
        options.family,
        d,
        format == SynthFormat::Mxfp4,
        eos,
        bos,
        dtype,
    )
}

/// The config.json text `synthesize` writes for `options`, without writing anything: what a
/// named shape is to the planner.
pub fn config_json_text(options: &SynthOptions) -> Result<String> {
    let format = resolved_format(options)?;
    let d = dims(options.family, options.preset)?;
    let Identity { eos, bos, .. } = identity(options.family);
    let config = config_value(options, format, &d, &eos, bos);
    serde_json::to_string_pretty(&config).map_err(|source| Error::JsonWrite {
        path: PathBuf::from("config.json"),
        source,
    })
}

/// Writes a synthetic checkpoint into `out` (created if needed). `progress(done, total)` is
/// called in bytes as weights are written.
pub fn synthesize(
    out: &Path,
    options: &SynthOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<SynthReport> {
    let format = resolved_format(options)?;
    let d = dims(options.family, options.preset)?;
    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
    let Identity {
        specials,
        stops,
        eos,
        bos,
    } = identity(options.family);
    let config = config_value(options, format, &d, &eos, bos);
    let write_json = |name: &str, v: &serde_json::Value| -> Result<()> {
        let path = out.join(name);
        let text = serde_json::to_string_pretty(v).map_err(|source| Error::JsonWrite {
            path: path.clone(),
            source,
        })?;
        std::fs::write(&path, text).map_err(|e| Error::io(&path, e))
    };
    write_json("config.json", &config)?;
    write_json(
        "generation_config.json",
        &serde_json::json!({"eos_token_id": eos, "bos_token_id": bos, "do_sample": false}),
    )?;
    write_json("tokenizer.json", &byte_level_tokenizer_json(specials))?;
    let bos_token = bos.and_then(|b| specials.get(b as usize - 256)).copied();
    write_json(
        "tokenizer_config.json",
        &serde_json::json!({
            "bos_token": bos_token, "eos_token": stops[0],
            "chat_template": presets::chat_template(options.family),
            "model_max_length": 131072,
        }),
    )?;
    let model_config = ModelConfig::from_file(&out.join("config.json"))?;
    let plan = tensor_plan(options.family, &d, format);
    let parameters: u64 = plan
        .iter()
        .map(|t| match t.dtype {
            // Blocks hold two values per byte; scales are metadata.
            "U8" if t.name.ends_with("_blocks") => t.byte_len() as u64 * 2,
            "U8" => 0,
            _ => t.shape.iter().product::<usize>() as u64,
        })
        .sum();
    if options.config_only {
        return Ok(SynthReport {
            dir: out.to_path_buf(),
            config: model_config,
            parameters,
            weight_bytes: 0,
        });
    }
    let total: u64 = plan.iter().map(|t| t.byte_len() as u64).sum();
    let mut done = 0u64;
    progress(0, total);
    write_safetensors(
        &out.join("model.safetensors"),
        &plan,
        |i, buf| {
            fill(&plan[i], options.seed, &d, buf);
            Ok(())
        },
        &mut |bytes| {
            done += bytes;
            progress(done, total);
        },
    )?;
    Ok(SynthReport {
        dir: out.to_path_buf(),
        config: model_config,
        parameters,
        weight_bytes: total,
    })
}

/// Every tensor of the checkpoint, in the family's Hugging Face naming.
pub fn tensor_plan(family: Family, d: &Dims, format: SynthFormat) -> Vec<TensorPlan> {
    let float = if format == SynthFormat::F32 {
        "F32"
    } else {
        "BF16"
    };
    let mut plan = Vec::new();
    let mut add = |name: String, dtype: &'static str, shape: Vec<usize>| {
        plan.push(TensorPlan { name, dtype, shape })
    };
    let (h, q, kv) = (d.hidden, d.heads * d.head_dim, d.kv_heads * d.head_dim);
    let (e, i) = (d.experts, d.expert_intermediate);
    add("model.embed_tokens.weight".into(), float, vec![d.vocab, h]);
    for l in 0..d.layers {
        let p = format!("model.layers.{l}");
        add(format!("{p}.input_layernorm.weight"), float, vec![h]);
        add(
            format!("{p}.post_attention_layernorm.weight"),
            float,
            vec![h],
        );
        for (name, rows, cols) in [
            ("q_proj", q, h),
            ("k_proj", kv, h),
            ("v_proj", kv, h),
            ("o_proj", h, q),
        ] {
            add(
                format!("{p}.self_attn.{name}.weight"),
                float,
                vec![rows, cols],
            );
            if family == Family::GptOss {
                add(format!("{p}.self_attn.{name}.bias"), float, vec![rows]);
            }
        }
        match family {
            Family::GptOss => {
                add(format!("{p}.self_attn.sinks"), float, vec![d.heads]);
                add(format!("{p}.mlp.router.weight"), float, vec![e, h]);
                add(format!("{p}.mlp.router.bias"), float, vec![e]);
                let x = format!("{p}.mlp.experts");
                if format == SynthFormat::Mxfp4 {
                    add(
                        format!("{x}.gate_up_proj_blocks"),
                        "U8",
                        vec![e, 2 * i, h / 32, 16],
                    );
                    add(
                        format!("{x}.gate_up_proj_scales"),
                        "U8",
                        vec![e, 2 * i, h / 32],
                    );
                    add(
                        format!("{x}.down_proj_blocks"),
                        "U8",
                        vec![e, h, i / 32, 16],
                    );
                    add(format!("{x}.down_proj_scales"), "U8", vec![e, h, i / 32]);
                } else {
                    add(format!("{x}.gate_up_proj"), float, vec![e, h, 2 * i]);
                    add(format!("{x}.down_proj"), float, vec![e, i, h]);
                }
                add(format!("{x}.gate_up_proj_bias"), float, vec![e, 2 * i]);
                add(format!("{x}.down_proj_bias"), float, vec![e, h]);
            }
            Family::Mixtral => {
                let x = format!("{p}.block_sparse_moe");
                add(format!("{x}.gate.weight"), float, vec![e, h]);
                for ex in 0..e {
                    add(format!("{x}.experts.{ex}.w1.weight"), float, vec![i, h]);
                    add(format!("{x}.experts.{ex}.w2.weight"), float, vec![h, i]);
                    add(format!("{x}.experts.{ex}.w3.weight"), float, vec![i, h]);
                }
            }
            Family::Qwen3Moe => {
                add(
                    format!("{p}.self_attn.q_norm.weight"),
                    float,
                    vec![d.head_dim],
                );
                add(
                    format!("{p}.self_attn.k_norm.weight"),
                    float,
                    vec![d.head_dim],
                );
                if l == 0 {
                    let di = d.dense_intermediate;
                    add(format!("{p}.mlp.gate_proj.weight"), float, vec![di, h]);
                    add(format!("{p}.mlp.up_proj.weight"), float, vec![di, h]);
                    add(format!("{p}.mlp.down_proj.weight"), float, vec![h, di]);
                } else {
                    add(format!("{p}.mlp.gate.weight"), float, vec![e, h]);
                    for ex in 0..e {
                        let x = format!("{p}.mlp.experts.{ex}");
                        add(format!("{x}.gate_proj.weight"), float, vec![i, h]);
                        add(format!("{x}.up_proj.weight"), float, vec![i, h]);
                        add(format!("{x}.down_proj.weight"), float, vec![h, i]);
                    }
                }
            }
        }
    }
    add("model.norm.weight".into(), float, vec![h]);
    if family != Family::Qwen3Moe {
        add("lm_head.weight".into(), float, vec![d.vocab, h]);
    }
    plan
}

/// A small, fast, deterministic generator (xorshift64*), seeded per tensor.
struct Rng(u64);

impl Rng {
    fn new(seed: u64, name: &str) -> Self {
        // FNV-1a of the name mixed with the seed; never zero.
        let mut h = 0xcbf29ce484222325u64 ^ seed.wrapping_mul(0x9E3779B97F4A7C15);
        for b in name.bytes() {
            h = (h ^ b as u64).wrapping_mul(0x100000001b3);
        }
        Rng(h | 1)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545F4914F6CDD1D)
    }

    /// Uniform in [-1, 1).
    fn symmetric(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// How a tensor's values are drawn: `center + spread * U(-1, 1)`.
fn distribution(t: &TensorPlan, d: &Dims) -> (f32, f32) {
    let n = &t.name;
    let uniform_std = |std: f32| std * 3f32.sqrt();
    if n.ends_with("norm.weight") || n.ends_with("layernorm.weight") {
        (1.0, 0.2)
    } else if n.ends_with("sinks") {
        (0.0, 1.0)
    } else if n.ends_with("bias") {
        (0.0, 0.1)
    } else if n.contains("embed_tokens") {
        (0.0, uniform_std(1.0))
    } else if n.starts_with("lm_head") {
        (0.0, uniform_std(4.0 / (d.hidden as f32).sqrt()))
    } else if n.ends_with("router.weight") || n.ends_with("gate.weight") {
        (0.0, uniform_std(2.0 / (d.hidden as f32).sqrt()))
    } else {
        // Fan-in scaling. GPT-OSS fused experts are stored [E, in, out]; the rest [.., out, in].
        let fan_in = if n.ends_with("experts.gate_up_proj") || n.ends_with("experts.down_proj") {
            t.shape[1]
        } else {
            t.shape[t.shape.len() - 1]
        };
        (0.0, uniform_std(1.0 / (fan_in as f32).sqrt()))
    }
}

/// Produces the bytes of one tensor.
fn fill(t: &TensorPlan, seed: u64, d: &Dims, buf: &mut Vec<u8>) {
    let mut rng = Rng::new(seed, &t.name);
    let count: usize = t.shape.iter().product();
    match t.dtype {
        "U8" if t.name.ends_with("_blocks") => {
            buf.extend((0..count).map(|_| (rng.next_u64() >> 56) as u8));
        }
        "U8" => {
            // E8M0 scales: FP4 values have an RMS of about 2.9, so 2^e with
            // e = log2(std / 2.9) gives weights of the fan-in-scaled size.
            let fan_in = t.shape[2] * mxfp4::BLOCK;
            let e = ((1.0 / (fan_in as f32).sqrt()) / 2.9).log2().round() as i32;
            buf.extend((0..count).map(|_| {
                let jitter = (rng.next_u64() >> 62) as i32 - 1; // -1, 0, 1, 2
                (127 + e + jitter.min(1)).clamp(1, 254) as u8
            }));
        }
        dtype => {
            let (center, spread) = distribution(t, d);
            buf.reserve(count * 4);
            for _ in 0..count {
                let v = center + spread * rng.symmetric();
                if dtype == "F32" {
                    buf.extend_from_slice(&v.to_le_bytes());
                } else {
                    buf.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes());
                }
            }
        }
    }
}

impl SynthFormat {
    /// The name used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            SynthFormat::F32 => "f32",
            SynthFormat::Bf16 => "bf16",
            SynthFormat::Mxfp4 => "mxfp4",
        }
    }
}
