//! The family-neutral description of a model's weights.
//!
//! Whatever the family and the tensor naming, a checkpoint becomes a [`ModelWeights`]:
//! embeddings, per layer the attention projections, norms, and either a router with experts
//! or a dense FFN, then the final norm and the LM head. Large matrices stay in their stored
//! format ([`WeightMatrix`]); small vectors (norms, biases, sinks) are converted to f32.

mod load;
mod matrix;

pub use load::{ExpertFilter, HugePages, LoadOptions};
pub use matrix::{WeightFormat, WeightMatrix};

use crate::checkpoint::SharedBytes;
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::kernels::ActivationDtype;

/// A linear layer `y = x W^T + b`.
#[derive(Debug, Clone)]
pub struct Linear {
    /// `[out, in]`.
    pub weight: WeightMatrix,
    /// `[out]`, when the layer has a bias.
    pub bias: Option<Vec<f32>>,
}

/// A gated MLP: one expert, or a dense FFN layer. `y = down(act(gate(x), up(x)))`.
#[derive(Debug, Clone)]
pub struct GatedMlp {
    /// `[intermediate, hidden]`.
    pub gate: Linear,
    /// `[intermediate, hidden]`.
    pub up: Linear,
    /// `[hidden, intermediate]`.
    pub down: Linear,
}

impl GatedMlp {
    /// Intermediate width.
    pub fn intermediate_size(&self) -> usize {
        self.gate.weight.rows()
    }

    /// Bytes of the three matrices in their stored format.
    pub fn stored_bytes(&self) -> usize {
        self.gate.weight.stored_bytes()
            + self.up.weight.stored_bytes()
            + self.down.weight.stored_bytes()
    }
}

/// A mixture-of-experts layer's weights.
#[derive(Debug, Clone)]
pub struct MoeWeights {
    /// Router gate `[num_experts, hidden]`.
    pub router: Linear,
    /// One entry per expert id; `None` where [`LoadOptions`] left the expert out.
    pub experts: Vec<Option<GatedMlp>>,
}

impl MoeWeights {
    /// Expert `e`, or an error if it was not loaded.
    pub fn expert(&self, e: usize) -> Result<&GatedMlp> {
        self.experts
            .get(e)
            .and_then(Option::as_ref)
            .ok_or_else(|| Error::InvalidInput(format!("expert {e} is not loaded in this process")))
    }
}

/// The feed-forward half of a layer.
#[derive(Debug, Clone)]
pub enum FfnWeights {
    /// Routed experts.
    Moe(MoeWeights),
    /// A dense gated MLP (boxed: three matrices against the routed experts' handle).
    Dense(Box<GatedMlp>),
}

/// Attention projections of one layer.
#[derive(Debug, Clone)]
pub struct AttentionWeights {
    /// `[heads * head_dim, hidden]`.
    pub q: Linear,
    /// `[kv_heads * head_dim, hidden]`.
    pub k: Linear,
    /// `[kv_heads * head_dim, hidden]`.
    pub v: Linear,
    /// `[hidden, heads * head_dim]`.
    pub o: Linear,
    /// Per-head RMSNorm of q (`[head_dim]`, Qwen3).
    pub q_norm: Option<Vec<f32>>,
    /// Per-head RMSNorm of k (`[head_dim]`, Qwen3).
    pub k_norm: Option<Vec<f32>>,
    /// Sink logit per query head (`[heads]`, GPT-OSS).
    pub sinks: Option<Vec<f32>>,
}

/// One decoder layer.
#[derive(Debug, Clone)]
pub struct LayerWeights {
    /// RMSNorm before attention.
    pub input_norm: Vec<f32>,
    /// Attention projections.
    pub attention: AttentionWeights,
    /// RMSNorm before the FFN.
    pub post_attention_norm: Vec<f32>,
    /// The FFN.
    pub ffn: FfnWeights,
}

/// A whole model, family-neutral.
#[derive(Debug, Clone)]
pub struct ModelWeights {
    /// The configuration the weights were checked against.
    pub config: ModelConfig,
    /// `[vocab, hidden]`.
    pub embed: WeightMatrix,
    /// Decoder layers.
    pub layers: Vec<LayerWeights>,
    /// Final RMSNorm.
    pub final_norm: Vec<f32>,
    /// `[vocab, hidden]` (the embedding matrix when tied).
    pub lm_head: WeightMatrix,
}

impl Linear {
    fn set_activations(&mut self, dtype: ActivationDtype) {
        self.weight.set_activations(dtype);
    }
}

impl GatedMlp {
    fn set_activations(&mut self, dtype: ActivationDtype) {
        for l in [&mut self.gate, &mut self.up, &mut self.down] {
            l.set_activations(dtype);
        }
    }
}

impl ModelWeights {
    /// Every matrix product of the model (attention, router, experts, dense FFNs, LM head)
    /// rounds its inputs as `dtype` says, where the weights' format allows
    /// ([`ActivationDtype::rounds`]); the embedding is a lookup and keeps its values.
    pub fn set_activations(&mut self, dtype: ActivationDtype) {
        for layer in &mut self.layers {
            let a = &mut layer.attention;
            for l in [&mut a.q, &mut a.k, &mut a.v, &mut a.o] {
                l.set_activations(dtype);
            }
            match &mut layer.ffn {
                FfnWeights::Moe(moe) => {
                    moe.router.set_activations(dtype);
                    for e in moe.experts.iter_mut().flatten() {
                        e.set_activations(dtype);
                    }
                }
                FfnWeights::Dense(mlp) => mlp.set_activations(dtype),
            }
        }
        self.lm_head.set_activations(dtype);
    }

    /// Moves the matrices `which` names into huge pages (see [`HugePages`]); returns the
    /// bytes copied. The numbers are unchanged: the same bytes, elsewhere.
    pub fn move_to_huge_pages(&mut self, which: HugePages) -> Result<usize> {
        if which == HugePages::Off {
            return Ok(0);
        }
        let mut ranges: Vec<&mut SharedBytes> = Vec::new();
        for layer in &mut self.layers {
            let a = &mut layer.attention;
            for l in [&mut a.q, &mut a.k, &mut a.v, &mut a.o] {
                ranges.extend(l.weight.byte_ranges_mut());
            }
            let mlps: Vec<&mut GatedMlp> = match &mut layer.ffn {
                FfnWeights::Moe(moe) => {
                    ranges.extend(moe.router.weight.byte_ranges_mut());
                    moe.experts.iter_mut().flatten().collect()
                }
                FfnWeights::Dense(mlp) => vec![&mut **mlp],
            };
            for mlp in mlps {
                for l in [&mut mlp.gate, &mut mlp.up, &mut mlp.down] {
                    ranges.extend(l.weight.byte_ranges_mut());
                }
            }
        }
        if which == HugePages::LayersAndLmHead {
            ranges.extend(self.lm_head.byte_ranges_mut());
        }
        crate::checkpoint::move_to_huge_pages(&mut ranges)
    }
}
