//! Per-family tensor names -> [`ModelWeights`].
//!
//! Names and layouts handled:
//! - common (all three families): `model.embed_tokens.weight`, `model.layers.L.{input,post_attention}_layernorm.weight`,
//!   `model.layers.L.self_attn.{q,k,v,o}_proj.{weight,bias}`, `model.norm.weight`, `lm_head.weight`
//!   (absent when tied);
//! - GPT-OSS: `self_attn.sinks`, `mlp.router.{weight,bias}`, fused experts
//!   `mlp.experts.gate_up_proj` `[E, H, 2I]` (in x out, gate/up interleaved: even columns gate)
//!   with `_bias` `[E, 2I]`, `mlp.experts.down_proj` `[E, I, H]` with `_bias` `[E, H]`; or the
//!   hub's MXFP4 `*_blocks` `[E, out, in/32, 16]` and `*_scales` `[E, out, in/32]`, kept packed;
//! - Mixtral: `block_sparse_moe.gate.weight`, per-expert `block_sparse_moe.experts.N.w1/w3/w2.weight`
//!   (gate, up, down);
//! - Qwen3-MoE: `self_attn.{q,k}_norm.weight`, `mlp.gate.weight`, per-expert
//!   `mlp.experts.N.{gate,up,down}_proj.weight`, dense layers `mlp.{gate,up,down}_proj.weight`;
//! - Mixtral and Qwen3-MoE as transformers 5 saves them: fused `mlp.experts.gate_up_proj`
//!   `[E, 2I, H]` (gate rows first, then up) and `mlp.experts.down_proj` `[E, H, I]`, router
//!   `mlp.gate.weight`.

use std::path::Path;

use super::{
    AttentionWeights, FfnWeights, GatedMlp, LayerWeights, Linear, ModelWeights, MoeWeights,
    WeightMatrix,
};
use crate::checkpoint::{Checkpoint, SharedBytes, StoredDtype, StoredTensor};
use crate::config::{Family, FfnKind, ModelConfig, Quantization};
use crate::error::Result;

/// Which experts a process loads (a card needs only its own, the attention node none).
#[derive(Clone, Default)]
pub enum ExpertFilter {
    /// Every expert of every layer.
    #[default]
    All,
    /// No experts (the attention node).
    None,
    /// Only `(layer, expert)` pairs for which the predicate holds.
    Only(std::sync::Arc<dyn Fn(usize, usize) -> bool + Send + Sync>),
}

impl std::fmt::Debug for ExpertFilter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ExpertFilter::All => f.write_str("All"),
            ExpertFilter::None => f.write_str("None"),
            ExpertFilter::Only(_) => f.write_str("Only(<predicate>)"),
        }
    }
}

impl ExpertFilter {
    fn wants(&self, layer: usize, expert: usize) -> bool {
        match self {
            ExpertFilter::All => true,
            ExpertFilter::None => false,
            ExpertFilter::Only(p) => p(layer, expert),
        }
    }
}

/// Which loaded matrices are copied into huge pages ([`crate::checkpoint::move_to_huge_pages`])
/// instead of being used where they lie in the memory-mapped checkpoint.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum HugePages {
    /// None: every matrix is read from the mapped file (for processes that copy the weights
    /// elsewhere anyway, such as a card binding its shard, or a GPU uploading them).
    #[default]
    Off,
    /// The layers' matrices (attention projections, routers, the experts loaded, dense FFNs):
    /// for the attention node, which holds the LM head only to cover a card that is down.
    Layers,
    /// The layers' matrices and the LM head: for the monolithic reference, which computes
    /// with all of them every step. The embedding, read one row per token, stays mapped.
    LayersAndLmHead,
}

/// What to load.
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    /// Which experts to load.
    pub experts: ExpertFilter,
    /// What the loaded matrices' products round their inputs to (default f32: exact).
    pub activations: crate::kernels::ActivationDtype,
    /// Which matrices move into huge pages (default none).
    pub huge_pages: HugePages,
}

impl ModelWeights {
    /// Reads `dir/config.json` and every weight of the checkpoint in `dir`.
    pub fn load(dir: &Path) -> Result<Self> {
        Self::load_with(dir, &LoadOptions::default())
    }

    /// Like [`Self::load`], loading only what `options` asks for.
    pub fn load_with(dir: &Path, options: &LoadOptions) -> Result<Self> {
        let config = ModelConfig::from_file(&dir.join("config.json"))?;
        let checkpoint = Checkpoint::open(dir)?;
        Loader {
            ck: &checkpoint,
            cfg: &config,
            options,
        }
        .load()
        .map(|(embed, layers, final_norm, lm_head)| {
            let mut weights = ModelWeights {
                config,
                embed,
                layers,
                final_norm,
                lm_head,
            };
            weights.set_activations(options.activations);
            weights
        })
        .and_then(|mut weights| {
            weights.move_to_huge_pages(options.huge_pages)?;
            Ok(weights)
        })
    }
}

struct Loader<'a> {
    ck: &'a Checkpoint,
    cfg: &'a ModelConfig,
    options: &'a LoadOptions,
}

type Parts = (WeightMatrix, Vec<LayerWeights>, Vec<f32>, WeightMatrix);

impl Loader<'_> {
    fn load(&self) -> Result<Parts> {
        let c = self.cfg;
        let embed = self.matrix("model.embed_tokens.weight", c.vocab_size, c.hidden_size)?;
        let lm_head = if c.tie_word_embeddings && !self.ck.contains("lm_head.weight") {
            embed.clone()
        } else {
            self.matrix("lm_head.weight", c.vocab_size, c.hidden_size)?
        };
        let layers = (0..c.num_layers())
            .map(|l| self.layer(l))
            .collect::<Result<Vec<_>>>()?;
        let final_norm = self.vector("model.norm.weight", c.hidden_size)?;
        Ok((embed, layers, final_norm, lm_head))
    }

    fn tensor(&self, name: &str) -> Result<StoredTensor> {
        self.ck.get(name)
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        self.tensor(name)?.expect_shape(&[len])?.to_f32_vec()
    }

    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<WeightMatrix> {
        let t = self.tensor(name)?;
        t.expect_shape(&[rows, cols])?;
        WeightMatrix::dense(&t, rows, cols)
    }

    fn linear(&self, prefix: &str, rows: usize, cols: usize, bias: bool) -> Result<Linear> {
        Ok(Linear {
            weight: self.matrix(&format!("{prefix}.weight"), rows, cols)?,
            bias: if bias {
                Some(self.vector(&format!("{prefix}.bias"), rows)?)
            } else {
                None
            },
        })
    }

    fn layer(&self, l: usize) -> Result<LayerWeights> {
        let c = self.cfg;
        let p = format!("model.layers.{l}");
        let (h, q, kv) = (c.hidden_size, c.q_dim(), c.kv_dim());
        let b = c.attention_bias;
        let attention = AttentionWeights {
            q: self.linear(&format!("{p}.self_attn.q_proj"), q, h, b)?,
            k: self.linear(&format!("{p}.self_attn.k_proj"), kv, h, b)?,
            v: self.linear(&format!("{p}.self_attn.v_proj"), kv, h, b)?,
            o: self.linear(&format!("{p}.self_attn.o_proj"), h, q, b)?,
            q_norm: c
                .qk_norm
                .then(|| self.vector(&format!("{p}.self_attn.q_norm.weight"), c.head_dim))
                .transpose()?,
            k_norm: c
                .qk_norm
                .then(|| self.vector(&format!("{p}.self_attn.k_norm.weight"), c.head_dim))
                .transpose()?,
            sinks: c
                .attention_sinks
                .then(|| self.vector(&format!("{p}.self_attn.sinks"), c.num_heads))
                .transpose()?,
        };
        let ffn = match c.layers[l].ffn {
            FfnKind::Dense => {
                let i = c.dense_intermediate_size.unwrap_or_default();
                FfnWeights::Dense(Box::new(GatedMlp {
                    gate: self.linear(&format!("{p}.mlp.gate_proj"), i, h, false)?,
                    up: self.linear(&format!("{p}.mlp.up_proj"), i, h, false)?,
                    down: self.linear(&format!("{p}.mlp.down_proj"), h, i, false)?,
                }))
            }
            FfnKind::Moe => FfnWeights::Moe(match c.family {
                Family::GptOss => self.gpt_oss_moe(l)?,
                Family::Mixtral | Family::Qwen3Moe => self.mixtral_qwen_moe(l)?,
            }),
        };
        Ok(LayerWeights {
            input_norm: self.vector(&format!("{p}.input_layernorm.weight"), h)?,
            attention,
            post_attention_norm: self.vector(&format!("{p}.post_attention_layernorm.weight"), h)?,
            ffn,
        })
    }

    fn moe_spec(&self) -> crate::config::MoeSpec {
        // validate() guarantees a MoE layer implies a MoE spec.
        self.cfg.moe.unwrap_or(crate::config::MoeSpec {
            num_experts: 0,
            top_k: 0,
            intermediate_size: 0,
            router: crate::config::RouterKind::TopKThenSoftmax,
            router_bias: false,
            expert_bias: false,
            activation: crate::config::Activation::SwiGlu,
        })
    }

    fn gpt_oss_moe(&self, l: usize) -> Result<MoeWeights> {
        let moe = self.moe_spec();
        let (e_count, h, i) = (moe.num_experts, self.cfg.hidden_size, moe.intermediate_size);
        let p = format!("model.layers.{l}.mlp");
        let router = self.linear(&format!("{p}.router"), e_count, h, true)?;
        let gate_up_bias = self.tensor(&format!("{p}.experts.gate_up_proj_bias"))?;
        gate_up_bias.expect_shape(&[e_count, 2 * i])?;
        let gate_up_bias = gate_up_bias.to_f32_vec()?;
        let down_bias = self.tensor(&format!("{p}.experts.down_proj_bias"))?;
        down_bias.expect_shape(&[e_count, h])?;
        let down_bias = down_bias.to_f32_vec()?;

        let any_wanted = (0..e_count).any(|e| self.options.experts.wants(l, e));
        let (gate_up, down) = if !any_wanted {
            (None, None)
        } else if self.cfg.quantization == Quantization::Mxfp4 {
            (
                Some(self.mxfp4_experts(
                    &format!("{p}.experts.gate_up_proj"),
                    e_count,
                    2 * i,
                    h,
                )?),
                Some(self.mxfp4_experts(&format!("{p}.experts.down_proj"), e_count, h, i)?),
            )
        } else {
            // transformers saves unquantized GPT-OSS experts as `x @ W` ([in, out]); turn each
            // expert into `[out, in]` once, keeping the stored dtype.
            (
                Some(self.transposed_experts(
                    &format!("{p}.experts.gate_up_proj"),
                    e_count,
                    h,
                    2 * i,
                )?),
                Some(self.transposed_experts(&format!("{p}.experts.down_proj"), e_count, i, h)?),
            )
        };
        let experts = (0..e_count)
            .map(|e| {
                let (Some(gate_up), Some(down)) = (&gate_up, &down) else {
                    return None;
                };
                if !self.options.experts.wants(l, e) {
                    return None;
                }
                let gu = gate_up.select_rows(e * 2 * i, 1, 2 * i);
                let bias = &gate_up_bias[e * 2 * i..(e + 1) * 2 * i];
                let even = bias.iter().step_by(2).copied().collect();
                let odd = bias.iter().skip(1).step_by(2).copied().collect();
                Some(GatedMlp {
                    gate: Linear {
                        weight: gu.select_rows(0, 2, i),
                        bias: Some(even),
                    },
                    up: Linear {
                        weight: gu.select_rows(1, 2, i),
                        bias: Some(odd),
                    },
                    down: Linear {
                        weight: down.select_rows(e * h, 1, h),
                        bias: Some(down_bias[e * h..(e + 1) * h].to_vec()),
                    },
                })
            })
            .collect();
        Ok(MoeWeights { router, experts })
    }

    /// `{name}_blocks` `[E, out, in/32, 16]` and `{name}_scales` `[E, out, in/32]` as one packed
    /// `[E * out, in]` matrix.
    fn mxfp4_experts(&self, name: &str, e: usize, out: usize, inp: usize) -> Result<WeightMatrix> {
        let blocks = self.tensor(&format!("{name}_blocks"))?;
        let scales = self.tensor(&format!("{name}_scales"))?;
        blocks.expect_shape(&[e, out, inp / 32, 16])?;
        scales.expect_shape(&[e, out, inp / 32])?;
        for t in [&blocks, &scales] {
            if t.dtype != StoredDtype::U8 {
                return Err(t.unsupported("U8 (MXFP4 blocks and E8M0 scales)"));
            }
        }
        Ok(WeightMatrix::mxfp4(
            e * out,
            inp,
            blocks.bytes.clone(),
            scales.bytes.clone(),
        ))
    }

    /// A stored `[E, in, out]` tensor as an `[E * out, in]` matrix (copied once, same dtype).
    fn transposed_experts(
        &self,
        name: &str,
        e: usize,
        inp: usize,
        out: usize,
    ) -> Result<WeightMatrix> {
        let t = self.tensor(name)?;
        t.expect_shape(&[e, inp, out])?;
        let size = t.dtype.size();
        let format = match t.dtype {
            StoredDtype::F32 => super::WeightFormat::F32,
            StoredDtype::Bf16 => super::WeightFormat::Bf16,
            StoredDtype::F16 => super::WeightFormat::F16,
            _ => return Err(t.unsupported("F32, BF16 or F16")),
        };
        let src = t.bytes.as_bytes();
        let mut dst = vec![0u8; src.len()];
        for x in 0..e {
            let base = x * inp * out * size;
            for r in 0..inp {
                for c in 0..out {
                    let s = base + (r * out + c) * size;
                    let d = base + (c * inp + r) * size;
                    dst[d..d + size].copy_from_slice(&src[s..s + size]);
                }
            }
        }
        Ok(WeightMatrix::from_bytes(
            format,
            e * out,
            inp,
            SharedBytes::from_vec(dst),
        ))
    }

    fn mixtral_qwen_moe(&self, l: usize) -> Result<MoeWeights> {
        let moe = self.moe_spec();
        let (e_count, h, i) = (moe.num_experts, self.cfg.hidden_size, moe.intermediate_size);
        let layer = format!("model.layers.{l}");
        // Hub Mixtral nests the MoE under `block_sparse_moe`; transformers 5 and Qwen3 use `mlp`.
        let moe_prefix = if self
            .ck
            .contains(&format!("{layer}.block_sparse_moe.gate.weight"))
        {
            format!("{layer}.block_sparse_moe")
        } else {
            format!("{layer}.mlp")
        };
        let router = self.linear(&format!("{moe_prefix}.gate"), e_count, h, false)?;
        let fused = format!("{moe_prefix}.experts.gate_up_proj");
        let experts = if self.ck.contains(&fused) {
            let gate_up = self.tensor(&fused)?;
            gate_up.expect_shape(&[e_count, 2 * i, h])?;
            let gate_up = WeightMatrix::dense(&gate_up, e_count * 2 * i, h)?;
            let down = self.matrix3(&format!("{moe_prefix}.experts.down_proj"), e_count, h, i)?;
            (0..e_count)
                .map(|e| {
                    self.options.experts.wants(l, e).then(|| {
                        let no_bias = |weight| Linear { weight, bias: None };
                        GatedMlp {
                            gate: no_bias(gate_up.select_rows(e * 2 * i, 1, i)),
                            up: no_bias(gate_up.select_rows(e * 2 * i + i, 1, i)),
                            down: no_bias(down.select_rows(e * h, 1, h)),
                        }
                    })
                })
                .collect()
        } else {
            let names: [&str; 3] = match self.cfg.family {
                Family::Mixtral => ["w1", "w3", "w2"],
                _ => ["gate_proj", "up_proj", "down_proj"],
            };
            (0..e_count)
                .map(|e| {
                    if !self.options.experts.wants(l, e) {
                        return Ok(None);
                    }
                    let ep = format!("{moe_prefix}.experts.{e}");
                    Ok(Some(GatedMlp {
                        gate: self.linear(&format!("{ep}.{}", names[0]), i, h, false)?,
                        up: self.linear(&format!("{ep}.{}", names[1]), i, h, false)?,
                        down: self.linear(&format!("{ep}.{}", names[2]), h, i, false)?,
                    }))
                })
                .collect::<Result<Vec<_>>>()?
        };
        Ok(MoeWeights { router, experts })
    }

    /// A stored `[a, b, c]` tensor as an `[a * b, c]` matrix.
    fn matrix3(&self, name: &str, a: usize, b: usize, c: usize) -> Result<WeightMatrix> {
        let t = self.tensor(name)?;
        t.expect_shape(&[a, b, c])?;
        WeightMatrix::dense(&t, a * b, c)
    }
}
