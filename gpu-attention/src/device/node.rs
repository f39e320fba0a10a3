//! [`DeviceCompute`]: the disaggregated node's numerics on a candle device. Everything the node
//! owns runs there (embedding, norms, attention over the paged cache, the router gate and its
//! top-k, the final norm); per layer and micro-batch one copy brings back what crosses to the
//! cards (the normed rows, the experts and their weights), and one copy takes the cards' partial
//! sums to the device, where they are added in the fixed card order.
//!
//! Built for the whole model ([`DeviceCompute::whole_model`]) it also holds the experts, the
//! dense MLPs and the LM head: the GPU-only baseline ([`super::monolithic`]).

use candle_core::{DType, Device, Result, Tensor};
use model::ModelWeights;
use model::config::{FfnKind, MoeSpec, RouterKind};
use model::forward::moe::Routing;
use model::forward::ops::rms_norm;
use model::forward::rope::RopeTables;
use model::weights::FfnWeights;
use step::KvCapacity;

use super::attention::{DeviceAttention, model_error};
use super::experts::{DeviceExperts, DeviceMlp};
use super::inputs::{MbInputs, SpanInput};
use super::kv::{DeviceKvCache, budget};
use super::linear::{DeviceLinear, DeviceWeight};
use crate::kv_cache::KvCacheConfig;

/// What the attention half of a layer hands the dispatch: the normed rows (host,
/// `[rows, hidden]`) and, for an MoE layer, each row's experts and weights.
#[derive(Debug, Clone, PartialEq)]
pub struct FfnInput {
    /// Normed hidden states, row-major.
    pub rows: Vec<f32>,
    /// The routing of an MoE layer.
    pub routing: Option<Routing>,
}

#[derive(Debug)]
struct DeviceLayer {
    input_norm: Tensor,
    attention: DeviceAttention,
    post_attention_norm: Tensor,
    router: Option<DeviceLinear>,
    ffn: FfnKind,
    /// The feed-forward half (whole-model builds only).
    local_ffn: Option<LocalFfn>,
}

/// A layer's feed-forward half on the device.
#[derive(Debug)]
enum LocalFfn {
    Moe(DeviceExperts),
    Dense(DeviceMlp),
}

/// The node's weights and KV cache on a device.
#[derive(Debug)]
pub struct DeviceCompute {
    device: Device,
    hidden: usize,
    eps: f64,
    kv_width: usize,
    moe: Option<MoeSpec>,
    embed: DeviceWeight,
    layers: Vec<DeviceLayer>,
    final_norm: Tensor,
    cache: DeviceKvCache,
    /// The LM head (whole-model builds only).
    lm_head: Option<DeviceLinear>,
    weight_bytes: usize,
}

/// A 1-D f32 tensor on `device`.
fn vector(values: &[f32], device: &Device) -> Result<Tensor> {
    Tensor::from_slice(values, values.len(), device)
}

impl DeviceCompute {
    /// Copies the attention-side weights (load them without experts) to `device`, then
    /// allocates the KV cache from `kv`'s budget there.
    pub fn new(weights: &ModelWeights, kv: &KvCacheConfig, device: &Device) -> Result<Self> {
        Self::build(weights, kv, device, false)
    }

    /// The whole model on `device` (every expert loaded): experts, dense MLPs and the LM head
    /// too.
    pub fn whole_model(
        weights: &ModelWeights,
        kv: &KvCacheConfig,
        device: &Device,
    ) -> Result<Self> {
        Self::build(weights, kv, device, true)
    }

    fn build(
        weights: &ModelWeights,
        kv: &KvCacheConfig,
        device: &Device,
        whole_model: bool,
    ) -> Result<Self> {
        let config = &weights.config;
        let mut layers = Vec::with_capacity(config.num_layers());
        for (l, lw) in weights.layers.iter().enumerate() {
            let local_ffn = match (&lw.ffn, config.moe) {
                _ if !whole_model => None,
                (FfnWeights::Moe(m), Some(spec)) => Some(LocalFfn::Moe(DeviceExperts::upload(
                    m,
                    spec.activation,
                    spec.top_k,
                    device,
                )?)),
                (FfnWeights::Dense(mlp), _) => {
                    Some(LocalFfn::Dense(DeviceMlp::upload(mlp, device)?))
                }
                (FfnWeights::Moe(_), None) => {
                    candle_core::bail!("layer {l} has experts but the model no MoE config")
                }
            };
            layers.push(DeviceLayer {
                local_ffn,
                input_norm: vector(&lw.input_norm, device)?,
                attention: DeviceAttention::upload(config, l, lw, device)?,
                post_attention_norm: vector(&lw.post_attention_norm, device)?,
                router: match &lw.ffn {
                    FfnWeights::Moe(m) => Some(DeviceLinear::upload(&m.router, device)?),
                    FfnWeights::Dense(_) => None,
                },
                ffn: config.layers[l].ffn,
            });
        }
        let embed = DeviceWeight::upload(&weights.embed, device)?;
        if matches!(embed, DeviceWeight::Mxfp4 { .. }) {
            candle_core::bail!("an MXFP4 embedding table is not supported on the device");
        }
        let weight_bytes = embed.bytes()
            + layers
                .iter()
                .map(|l| match &l.local_ffn {
                    Some(LocalFfn::Moe(e)) => e.bytes(),
                    Some(LocalFfn::Dense(m)) => m.bytes(),
                    None => 0,
                })
                .sum::<usize>()
            + layers
                .iter()
                .map(|l| l.attention.bytes() + l.router.as_ref().map_or(0, DeviceLinear::bytes))
                .sum::<usize>();
        let final_norm = vector(&weights.final_norm, device)?;
        let lm_head = whole_model
            .then(|| {
                DeviceLinear::upload(
                    &model::weights::Linear {
                        weight: weights.lm_head.clone(),
                        bias: None,
                    },
                    device,
                )
            })
            .transpose()?;
        let weight_bytes = weight_bytes + lm_head.as_ref().map_or(0, DeviceLinear::bytes);
        // The weights are in place before the budget reads the device's free memory.
        device.synchronize()?;
        let capacity = KvCacheConfig {
            memory_bytes: budget(kv, device)?,
            ..*kv
        }
        .capacity(config);
        Ok(DeviceCompute {
            cache: DeviceKvCache::new(config, capacity, device)?,
            device: device.clone(),
            hidden: config.hidden_size,
            eps: config.rms_norm_eps,
            kv_width: config.kv_dim(),
            moe: config.moe,
            embed,
            layers,
            final_norm,
            lm_head,
            weight_bytes,
        })
    }

    /// The KV cache's geometry.
    pub fn capacity(&self) -> KvCapacity {
        self.cache.capacity()
    }

    /// Decoder layers.
    pub fn layers(&self) -> usize {
        self.layers.len()
    }

    /// Bytes of weights on the device.
    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// A micro-batch's inputs and its embedded rows `[rows, hidden]` (token ids checked by the
    /// caller).
    pub fn prepare(
        &self,
        spans: &[SpanInput<'_>],
        rope: &RopeTables,
    ) -> Result<(Tensor, MbInputs)> {
        let inputs = MbInputs::new(spans, rope, self.capacity(), self.kv_width, &self.device)?;
        let DeviceWeight::Dense(table) = &self.embed else {
            candle_core::bail!("an MXFP4 embedding table is not supported on the device");
        };
        let x = table.index_select(&inputs.ids, 0)?.to_dtype(DType::F32)?;
        Ok((x, inputs))
    }

    /// Layer `layer`'s attention half on the device: `x += attention(norm(x))`; returns the
    /// normed rows for the FFN and, on an MoE layer, their experts and weights.
    fn attention_half(
        &self,
        layer: usize,
        x: &mut Tensor,
        inputs: &MbInputs,
    ) -> Result<(Tensor, Option<(Tensor, Tensor)>)> {
        let l = self
            .layers
            .get(layer)
            .ok_or_else(|| candle_core::Error::Msg(format!("no layer {layer}")))?;
        let h = rms_norm(x, &l.input_norm, self.eps).map_err(model_error)?;
        let attn = l.attention.forward(layer, &h, inputs, &self.cache)?;
        *x = (&*x + attn)?;
        let h2 = rms_norm(x, &l.post_attention_norm, self.eps).map_err(model_error)?;
        let routing = match (l.ffn, &l.router, self.moe) {
            (FfnKind::Moe, Some(router), Some(spec)) => Some(top_k(&router.forward(&h2)?, &spec)?),
            (FfnKind::Moe, _, _) => candle_core::bail!("layer {layer} is MoE without a router"),
            (FfnKind::Dense, _, _) => None,
        };
        Ok((h2, routing))
    }

    /// A whole layer on the device (whole-model builds): attention, then `x += ffn(norm(x))`.
    pub fn layer(&self, layer: usize, x: &mut Tensor, inputs: &MbInputs) -> Result<()> {
        let (h2, routing) = self.attention_half(layer, x, inputs)?;
        let ffn = match (&self.layers[layer].local_ffn, routing) {
            (Some(LocalFfn::Moe(experts)), Some((ids, weights))) => {
                experts.forward(&h2, &ids, &weights)?
            }
            (Some(LocalFfn::Dense(mlp)), None) => mlp.forward(&h2)?,
            _ => candle_core::bail!("layer {layer}'s feed-forward half is not on the device"),
        };
        *x = (&*x + ffn)?;
        Ok(())
    }

    /// Logits `[rows.len(), vocab]` (host) of rows `rows` of `x` (whole-model builds).
    pub fn logits(&self, x: &Tensor, rows: &[u32]) -> Result<Vec<f32>> {
        let head = self
            .lm_head
            .as_ref()
            .ok_or_else(|| candle_core::Error::Msg("the LM head is on the cards".into()))?;
        let idx = Tensor::from_slice(rows, rows.len(), &self.device)?;
        let normed =
            rms_norm(&x.index_select(&idx, 0)?, &self.final_norm, self.eps).map_err(model_error)?;
        head.forward(&normed)?.flatten_all()?.to_vec1::<f32>()
    }

    /// Layer `layer`'s attention half for one micro-batch: `x += attention(norm(x))`, then the
    /// normed rows and their routing, copied to the host in one piece.
    pub fn attention(&self, layer: usize, x: &mut Tensor, inputs: &MbInputs) -> Result<FfnInput> {
        let (h2, routing) = self.attention_half(layer, x, inputs)?;
        match (routing, self.moe) {
            (Some((experts, weights)), Some(spec)) => {
                let k = spec.top_k;
                // One copy: [rows | experts as f32 (exact below 2^24) | weights].
                let packed = Tensor::cat(&[&h2, &experts.to_dtype(DType::F32)?, &weights], 1)?;
                let all = packed.flatten_all()?.to_vec1::<f32>()?;
                let width = self.hidden + 2 * k;
                let n = inputs.rows;
                let mut rows = Vec::with_capacity(n * self.hidden);
                let mut ids = Vec::with_capacity(n * k);
                let mut ws = Vec::with_capacity(n * k);
                for r in all.chunks_exact(width) {
                    rows.extend_from_slice(&r[..self.hidden]);
                    ids.extend(r[self.hidden..self.hidden + k].iter().map(|&e| e as u32));
                    ws.extend_from_slice(&r[self.hidden + k..]);
                }
                Ok(FfnInput {
                    rows,
                    routing: Some(Routing {
                        top_k: k,
                        experts: ids,
                        weights: ws,
                    }),
                })
            }
            _ => Ok(FfnInput {
                rows: h2.flatten_all()?.to_vec1::<f32>()?,
                routing: None,
            }),
        }
    }

    /// Adds the cards' partial sums to `x`: `partials` holds every card's rows back to back in
    /// ascending card order, `tokens[i]` the micro-batch row that partial row `i` belongs to.
    /// One copy to the device; the sum runs in that order (candle's `index_add` walks the
    /// indices in order), as the host path's combine does.
    pub fn add_partials(&self, x: &mut Tensor, tokens: Vec<u32>, partials: Vec<f32>) -> Result<()> {
        let (n, hidden) = x.dims2()?;
        let count = tokens.len();
        if partials.len() != count * hidden {
            candle_core::bail!(
                "{} partial floats for {count} rows of {hidden}",
                partials.len()
            );
        }
        let src = Tensor::from_vec(partials, (count, hidden), &self.device)?;
        let idx = Tensor::from_vec(tokens, count, &self.device)?;
        let ffn = Tensor::zeros((n, hidden), DType::F32, &self.device)?.index_add(&idx, &src, 0)?;
        *x = (&*x + ffn)?;
        Ok(())
    }

    /// The final norm of rows `rows` of `x`, on the host `[rows.len(), hidden]`.
    pub fn final_rows(&self, x: &Tensor, rows: &[u32]) -> Result<Vec<f32>> {
        let idx = Tensor::from_slice(rows, rows.len(), &self.device)?;
        let selected = x.index_select(&idx, 0)?;
        rms_norm(&selected, &self.final_norm, self.eps)
            .map_err(model_error)?
            .flatten_all()?
            .to_vec1::<f32>()
    }
}

/// The experts (u32 `[n, k]`) and weights (f32 `[n, k]`) of router logits `[n, experts]`, by
/// the family's rule, best first (candle's sort; ties between equal logits may go either way,
/// where the host path prefers the lower expert id).
pub fn top_k(logits: &Tensor, spec: &MoeSpec) -> Result<(Tensor, Tensor)> {
    let k = spec.top_k;
    let pick = |scores: &Tensor| -> Result<(Tensor, Tensor)> {
        let idx = scores
            .arg_sort_last_dim(false)?
            .narrow(1, 0, k)?
            .contiguous()?;
        let values = scores.gather(&idx, 1)?;
        Ok((idx, values))
    };
    match spec.router {
        RouterKind::TopKThenSoftmax => {
            let (idx, values) = pick(&logits.contiguous()?)?;
            Ok((idx, candle_nn::ops::softmax_last_dim(&values)?))
        }
        RouterKind::SoftmaxThenTopK { renormalize } => {
            let probs = candle_nn::ops::softmax_last_dim(&logits.contiguous()?)?;
            let (idx, values) = pick(&probs)?;
            let weights = if renormalize {
                values.broadcast_div(&values.sum_keepdim(1)?)?
            } else {
                values
            };
            Ok((idx, weights))
        }
    }
}
