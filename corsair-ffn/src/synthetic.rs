//! Random shapes and weights made in memory, for tests and benchmarks (no files).

use model::checkpoint::SharedBytes;
use model::config::{
    Activation, AttentionKind, FfnKind, LayerSpec, MoeSpec, Quantization, RopeConfig, RopeScaling,
    RouterKind,
};
use model::weights::{GatedMlp, Linear, WeightFormat};
use model::{Family, ModelConfig, WeightMatrix};

use crate::weights::WeightSource;

/// A MoE config with `layers` FFN kinds (Mixtral-like SwiGLU, no biases). Dense layers get
/// an intermediate size of `2 * intermediate`.
pub fn tiny_config(
    experts: usize,
    top_k: usize,
    hidden: usize,
    intermediate: usize,
    layers: &[FfnKind],
) -> ModelConfig {
    ModelConfig {
        family: Family::Qwen3Moe,
        vocab_size: 96,
        hidden_size: hidden,
        num_heads: 2,
        num_kv_heads: 1,
        head_dim: 16,
        rms_norm_eps: 1e-6,
        rope: RopeConfig {
            theta: 1e4,
            scaling: RopeScaling::None,
        },
        max_position_embeddings: 4096,
        attention_bias: false,
        qk_norm: false,
        attention_sinks: false,
        layers: layers
            .iter()
            .map(|&ffn| LayerSpec {
                attention: AttentionKind::Full,
                ffn,
            })
            .collect(),
        moe: Some(MoeSpec {
            num_experts: experts,
            top_k,
            intermediate_size: intermediate,
            router: RouterKind::SoftmaxThenTopK { renormalize: true },
            router_bias: false,
            expert_bias: false,
            activation: Activation::SwiGlu,
        }),
        dense_intermediate_size: Some(2 * intermediate),
        tie_word_embeddings: false,
        quantization: Quantization::None,
        eos_token_ids: vec![0],
        bos_token_id: None,
    }
}

/// A GPT-OSS-like config: clamped SwiGLU with biases, `layers` MoE layers.
pub fn gpt_oss_config(
    layers: usize,
    experts: usize,
    top_k: usize,
    hidden: usize,
    intermediate: usize,
    vocab: usize,
) -> ModelConfig {
    let mut c = tiny_config(
        experts,
        top_k,
        hidden,
        intermediate,
        &vec![FfnKind::Moe; layers],
    );
    c.family = Family::GptOss;
    c.vocab_size = vocab;
    c.dense_intermediate_size = None;
    if let Some(m) = &mut c.moe {
        m.router = RouterKind::TopKThenSoftmax;
        m.router_bias = true;
        m.expert_bias = true;
        m.activation = Activation::ClampedSwiGlu {
            alpha: 1.702,
            limit: 7.0,
        };
    }
    c
}

/// A counter-based generator (splitmix64) so that weights depend only on (seed, tensor).
#[derive(Debug, Clone)]
pub struct SplitMix(u64);

impl SplitMix {
    /// Seeded by `seed` and a stream id.
    pub fn new(seed: u64, stream: u64) -> Self {
        let mut s = SplitMix(seed ^ stream.wrapping_mul(0xA24B_AED4_963E_E407));
        s.next_u64();
        s
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[-1, 1)`.
    pub fn symmetric(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 23) as f32) - 1.0
    }
}

/// A random `[rows, cols]` matrix in `format` with values about `scale` in size.
pub fn random_matrix(
    rows: usize,
    cols: usize,
    format: WeightFormat,
    scale: f32,
    rng: &mut SplitMix,
) -> WeightMatrix {
    match format {
        WeightFormat::Mxfp4 => {
            assert!(cols.is_multiple_of(32), "MXFP4 needs whole blocks");
            let mut blocks = vec![0u8; rows * cols / 2];
            for chunk in blocks.chunks_mut(8) {
                let bits = rng.next_u64().to_le_bytes();
                chunk.copy_from_slice(&bits[..chunk.len()]);
            }
            // Scales around `scale` / 4 (FP4 magnitudes reach 6).
            let center = 127 + (scale / 4.0).log2().round() as i32;
            let scales = (0..rows * cols / 32)
                .map(|_| (center + (rng.next_u64() % 3) as i32 - 1).clamp(1, 254) as u8)
                .collect();
            WeightMatrix::mxfp4(
                rows,
                cols,
                SharedBytes::from_vec(blocks),
                SharedBytes::from_vec(scales),
            )
        }
        _ => {
            let values: Vec<f32> = (0..rows * cols).map(|_| rng.symmetric() * scale).collect();
            let bytes: Vec<u8> = match format {
                WeightFormat::F32 => bytemuck::cast_slice(&values).to_vec(),
                WeightFormat::Bf16 => values
                    .iter()
                    .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                    .collect(),
                _ => values
                    .iter()
                    .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
                    .collect(),
            };
            WeightMatrix::from_bytes(format, rows, cols, SharedBytes::from_vec(bytes))
        }
    }
}

/// A random gated MLP `[inter, hidden]` / `[hidden, inter]`, with biases when `bias`.
pub fn random_mlp(
    hidden: usize,
    inter: usize,
    format: WeightFormat,
    bias: bool,
    rng: &mut SplitMix,
) -> GatedMlp {
    let linear = |rows, cols, rng: &mut SplitMix| Linear {
        weight: random_matrix(rows, cols, format, 1.0 / (cols as f32).sqrt(), rng),
        bias: bias.then(|| (0..rows).map(|_| rng.symmetric() * 0.1).collect()),
    };
    GatedMlp {
        gate: linear(inter, hidden, rng),
        up: linear(inter, hidden, rng),
        down: linear(hidden, inter, rng),
    }
}

/// One layer of synthetic weights.
#[derive(Debug, Clone)]
pub enum SyntheticLayer {
    /// Experts (`None`: not made).
    Moe(Vec<Option<GatedMlp>>),
    /// A dense FFN.
    Dense(Box<GatedMlp>),
}

/// Random FFN and LM-head weights for a config, made in memory.
#[derive(Debug, Clone)]
pub struct SyntheticWeights {
    /// Per layer.
    pub layers: Vec<SyntheticLayer>,
    /// `[vocab, hidden]`.
    pub lm_head: WeightMatrix,
}

impl SyntheticWeights {
    /// Experts for which `wants(layer, expert)` holds (all dense layers), in `format` (dense
    /// layers and the LM head use bf16 when `format` is MXFP4).
    pub fn random(
        config: &ModelConfig,
        format: WeightFormat,
        seed: u64,
        wants: &dyn Fn(usize, usize) -> bool,
    ) -> Self {
        let h = config.hidden_size;
        let plain = if format == WeightFormat::Mxfp4 {
            WeightFormat::Bf16
        } else {
            format
        };
        let layers = config
            .layers
            .iter()
            .enumerate()
            .map(|(l, spec)| match (spec.ffn, config.moe) {
                (FfnKind::Moe, Some(moe)) => SyntheticLayer::Moe(
                    (0..moe.num_experts)
                        .map(|e| {
                            wants(l, e).then(|| {
                                let mut rng = SplitMix::new(seed, (l * 100_003 + e) as u64);
                                random_mlp(
                                    h,
                                    moe.intermediate_size,
                                    format,
                                    moe.expert_bias,
                                    &mut rng,
                                )
                            })
                        })
                        .collect(),
                ),
                _ => {
                    let mut rng = SplitMix::new(seed, (l * 100_003 + 99_999) as u64);
                    SyntheticLayer::Dense(Box::new(random_mlp(
                        h,
                        config.dense_intermediate_size.unwrap_or(h),
                        plain,
                        false,
                        &mut rng,
                    )))
                }
            })
            .collect();
        let mut rng = SplitMix::new(seed, u64::MAX);
        let lm_head = random_matrix(
            config.vocab_size,
            h,
            plain,
            2.0 / (h as f32).sqrt(),
            &mut rng,
        );
        SyntheticWeights { layers, lm_head }
    }
}

impl WeightSource for SyntheticWeights {
    fn expert(&self, layer: usize, expert: usize) -> Option<&GatedMlp> {
        match self.layers.get(layer)? {
            SyntheticLayer::Moe(e) => e.get(expert)?.as_ref(),
            SyntheticLayer::Dense(_) => None,
        }
    }

    fn dense(&self, layer: usize) -> Option<&GatedMlp> {
        match self.layers.get(layer)? {
            SyntheticLayer::Dense(m) => Some(m),
            SyntheticLayer::Moe(_) => None,
        }
    }

    fn lm_head(&self) -> Option<&WeightMatrix> {
        Some(&self.lm_head)
    }
}
