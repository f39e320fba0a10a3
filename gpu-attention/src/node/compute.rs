//! Where the disaggregated node's numerics run, chosen when the node is built: the host path
//! (afd's CPU kernels, the default) or the device path ([`crate::device`]: candle tensors on a
//! GPU, or on candle's CPU device for checking). The pipeline ([`super::pipeline`]) calls the
//! same four steps on either: embed a micro-batch, the attention half of a layer, adding the
//! cards' partial sums, and the final norm of the rows to sample.

use std::collections::HashMap;

use candle_core::{Device, Tensor};
use model::config::FfnKind;
use model::forward::attention::{AttentionBlock, KvCache};
use model::forward::moe::route;
use model::forward::{LmHead, embed, ops};
use model::weights::{FfnWeights, Linear};
use model::{ModelConfig, ModelWeights, WeightMatrix};
use step::{InvalidStep, KvCapacity, ModelFailure, SeqId, StepError};

use super::pipeline::MicroBatch;
use crate::device::inputs::{MbInputs, SpanInput};
use crate::device::{AttentionDevice, DeviceCompute, FfnInput};
use crate::dispatch::{DispatchPlan, combine};
use crate::kv_cache::{KvCacheConfig, PagedKvCache};

/// One layer's host-path weights.
struct HostLayer {
    input_norm: Tensor,
    attention: AttentionBlock,
    post_attention_norm: Tensor,
    router: Option<Linear>,
}

/// The host path: afd's CPU kernels over host memory.
pub(super) struct HostCompute {
    embed: WeightMatrix,
    layers: Vec<HostLayer>,
    lm_head: LmHead,
    cache: PagedKvCache,
}

/// The node's numerics.
pub(super) enum Compute {
    /// The fast CPU path.
    Host(Box<HostCompute>),
    /// candle tensors on a device.
    Device(Box<DeviceCompute>),
}

impl Compute {
    /// The backend `device` names, with the attention-side `weights` in place.
    pub fn new(
        weights: &ModelWeights,
        kv: &KvCacheConfig,
        device: AttentionDevice,
    ) -> Result<Self, StepError> {
        let config = &weights.config;
        let Some(dev) = device
            .open()
            .map_err(|e| InvalidStep::Setup(e.to_string()))?
        else {
            if kv.gpu_memory_utilization.is_some() {
                return Err(InvalidStep::Setup(
                    "--gpu-memory-utilization sizes the KV cache of a GPU; with --device cpu \
                     give --kv-cache-memory instead"
                        .into(),
                )
                .into());
            }
            return HostCompute::new(weights, kv).map(|h| Compute::Host(Box::new(h)));
        };
        let compute = DeviceCompute::new(weights, kv, &dev).map_err(|e| ModelFailure::Prepare {
            device: device.to_string(),
            reason: format!(
                "{} {}: {e}",
                config.family,
                if config.moe.is_some() {
                    "attention"
                } else {
                    "layers"
                }
            ),
        })?;
        Ok(Compute::Device(Box::new(compute)))
    }

    /// The KV cache's geometry.
    pub fn capacity(&self) -> KvCapacity {
        match self {
            Compute::Host(h) => h.cache.capacity(),
            Compute::Device(d) => d.capacity(),
        }
    }

    /// The embedded rows `[rows, hidden]` of a micro-batch and, on a device, its inputs there.
    /// `spans` are the micro-batch's sequences in row order, `tokens` their new tokens back to
    /// back.
    pub fn embed(
        &self,
        config: &ModelConfig,
        spans: &[SpanInput<'_>],
        tokens: &[u32],
        rope: &model::forward::rope::RopeTables,
    ) -> Result<(Tensor, Option<MbInputs>), StepError> {
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= config.vocab_size) {
            return Err(InvalidStep::TokenOutOfRange {
                token: t,
                vocab: config.vocab_size,
            }
            .into());
        }
        match self {
            Compute::Host(h) => {
                let rows = embed(&h.embed, tokens).map_err(StepError::compute)?;
                let x = Tensor::from_vec(rows, (tokens.len(), config.hidden_size), &Device::Cpu)
                    .map_err(StepError::compute)?;
                Ok((x, None))
            }
            Compute::Device(d) => {
                let (x, inputs) = d.prepare(spans, rope).map_err(StepError::compute)?;
                Ok((x, Some(inputs)))
            }
        }
    }

    /// The attention half of `layer` for `mb`: its residual gains the attention output, and out
    /// come the normed rows for the FFN with their routing on an MoE layer.
    pub fn attention(
        &mut self,
        config: &ModelConfig,
        layer: usize,
        mb: &mut MicroBatch,
        tables: &HashMap<SeqId, (&[u32], usize)>,
    ) -> Result<FfnInput, StepError> {
        match self {
            Compute::Host(h) => h.attention(config, layer, mb, tables),
            Compute::Device(d) => {
                let inputs = mb.device.as_ref().ok_or_else(|| {
                    StepError::from(ModelFailure::Missing(
                        "a micro-batch without its device inputs",
                    ))
                })?;
                d.attention(layer, &mut mb.x, inputs)
                    .map_err(StepError::compute)
            }
        }
    }

    /// Adds the cards' partial sums (`partials[i]` from `plan.cards[i]`, or with no plan every
    /// dense card's sums for every row) to `mb`'s residual, in card order.
    pub fn add_ffn(
        &self,
        mb: &mut MicroBatch,
        plan: Option<&DispatchPlan>,
        partials: Vec<Vec<f32>>,
        hidden: usize,
    ) -> Result<(), StepError> {
        let rows = mb.positions.len();
        match self {
            Compute::Host(_) => {
                let mut ffn = vec![0f32; rows * hidden];
                match plan {
                    Some(plan) => combine(plan, &partials, hidden, &mut ffn),
                    None => {
                        for part in &partials {
                            for (d, s) in ffn.iter_mut().zip(part) {
                                *d += s;
                            }
                        }
                    }
                }
                let ffn = Tensor::from_vec(ffn, (rows, hidden), &Device::Cpu)
                    .map_err(StepError::compute)?;
                mb.x = (&mb.x + ffn).map_err(StepError::compute)?;
                Ok(())
            }
            Compute::Device(d) => {
                let total: usize = partials.iter().map(Vec::len).sum();
                let mut tokens = Vec::with_capacity(total / hidden.max(1));
                let mut flat = Vec::with_capacity(total);
                for (i, part) in partials.into_iter().enumerate() {
                    match plan {
                        Some(plan) => tokens.extend(plan.cards[i].rows.iter().map(|&r| r as u32)),
                        None => tokens.extend(0..rows as u32),
                    }
                    flat.extend(part);
                }
                d.add_partials(&mut mb.x, tokens, flat)
                    .map_err(StepError::compute)
            }
        }
    }

    /// The final norm of rows `rows` of `mb`'s residual, `[rows.len(), hidden]` on the host.
    pub fn final_rows(&self, mb: &MicroBatch, rows: &[usize]) -> Result<Vec<f32>, StepError> {
        match self {
            Compute::Host(h) => {
                let mut selected = Vec::with_capacity(rows.len());
                for &r in rows {
                    selected.push(mb.x.narrow(0, r, 1).map_err(StepError::compute)?);
                }
                let selected = Tensor::cat(&selected, 0).map_err(StepError::compute)?;
                ops::to_f32_vec(&h.lm_head.norm(&selected).map_err(StepError::compute)?)
                    .map_err(StepError::compute)
            }
            Compute::Device(d) => {
                let rows: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
                d.final_rows(&mb.x, &rows).map_err(StepError::compute)
            }
        }
    }
}

impl HostCompute {
    fn new(weights: &ModelWeights, kv: &KvCacheConfig) -> Result<Self, StepError> {
        let config = &weights.config;
        let device = Device::Cpu;
        let layers = weights
            .layers
            .iter()
            .enumerate()
            .map(|(l, lw)| {
                Ok(HostLayer {
                    input_norm: ops::vector(&lw.input_norm, &device)?,
                    attention: AttentionBlock::new(config, l, lw, &device)?,
                    post_attention_norm: ops::vector(&lw.post_attention_norm, &device)?,
                    router: match &lw.ffn {
                        FfnWeights::Moe(m) => Some(m.router.clone()),
                        FfnWeights::Dense(_) => None,
                    },
                })
            })
            .collect::<model::Result<Vec<_>>>()
            .map_err(StepError::compute)?;
        Ok(HostCompute {
            embed: weights.embed.clone(),
            lm_head: LmHead::new(weights, &device).map_err(StepError::compute)?,
            cache: PagedKvCache::new(config, kv.capacity(config)),
            layers,
        })
    }

    fn attention(
        &mut self,
        config: &ModelConfig,
        layer: usize,
        mb: &mut MicroBatch,
        tables: &HashMap<SeqId, (&[u32], usize)>,
    ) -> Result<FfnInput, StepError> {
        let eps = config.rms_norm_eps;
        let l = &self.layers[layer];
        let h = ops::rms_norm(&mb.x, &l.input_norm, eps).map_err(StepError::compute)?;
        let mut view = self.cache.step(tables);
        let attn = l
            .attention
            .forward(
                layer,
                &h,
                &mb.spans,
                &mb.rope,
                &mut view as &mut dyn KvCache,
            )
            .map_err(StepError::compute)?;
        mb.x = (&mb.x + attn).map_err(StepError::compute)?;
        let rows = ops::to_f32_vec(
            &ops::rms_norm(&mb.x, &l.post_attention_norm, eps).map_err(StepError::compute)?,
        )
        .map_err(StepError::compute)?;
        let routing = match config.layers[layer].ffn {
            FfnKind::Moe => {
                let spec = config.moe.ok_or(ModelFailure::Missing(
                    "an MoE layer without its experts' settings",
                ))?;
                let router = l
                    .router
                    .as_ref()
                    .ok_or(ModelFailure::Missing("an MoE layer without a router"))?;
                Some(route(router, &spec, &rows, mb.positions.len()))
            }
            FfnKind::Dense => None,
        };
        Ok(FfnInput { rows, routing })
    }
}
