//! One layer's attention on the device: projections with the weights as stored, the optional
//! q/k norm, RoPE (candle's `rope_thd`, the half-split formula the host path uses), the new keys
//! and values scattered into the paged cache, then attention: rows of short spans (decode) in one
//! paged-attention launch over the block tables, long prompt chunks through the reference's
//! matmul path ([`attention_core`]) on their gathered history.

use candle_core::{Device, Result, Tensor};
use model::config::{AttentionKind, ModelConfig};
use model::forward::attention::attention_core;
use model::forward::ops::rms_norm;
use model::weights::LayerWeights;

use super::inputs::{MbInputs, Piece};
use super::kv::DeviceKvCache;
use super::linear::DeviceLinear;
use super::paged::PagedAttention;

/// A model-crate error as a candle one (the device path speaks candle's `Result`).
pub(crate) fn model_error(e: model::Error) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}

/// One layer's attention, its weights on the device.
#[derive(Debug)]
pub struct DeviceAttention {
    q: DeviceLinear,
    k: DeviceLinear,
    v: DeviceLinear,
    o: DeviceLinear,
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
    sinks: Option<Tensor>,
    kind: AttentionKind,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    eps: f64,
    scale: f64,
}

impl DeviceAttention {
    /// Copies layer `layer`'s attention weights to `device`.
    pub fn upload(
        config: &ModelConfig,
        layer: usize,
        weights: &LayerWeights,
        device: &Device,
    ) -> Result<Self> {
        let a = &weights.attention;
        let vector = |v: &Option<Vec<f32>>| {
            v.as_deref()
                .map(|v| Tensor::from_slice(v, v.len(), device))
                .transpose()
        };
        Ok(DeviceAttention {
            q: DeviceLinear::upload(&a.q, device)?,
            k: DeviceLinear::upload(&a.k, device)?,
            v: DeviceLinear::upload(&a.v, device)?,
            o: DeviceLinear::upload(&a.o, device)?,
            q_norm: vector(&a.q_norm)?,
            k_norm: vector(&a.k_norm)?,
            sinks: vector(&a.sinks)?,
            kind: config.layers[layer].attention,
            heads: config.num_heads,
            kv_heads: config.num_kv_heads,
            head_dim: config.head_dim,
            eps: config.rms_norm_eps,
            scale: (config.head_dim as f64).powf(-0.5),
        })
    }

    /// Bytes of its weights on the device.
    pub fn bytes(&self) -> usize {
        [&self.q, &self.k, &self.v, &self.o]
            .iter()
            .map(|l| l.bytes())
            .sum()
    }

    /// The attention output (before the residual add) of normed rows `h` (`[n, hidden]`) of
    /// one micro-batch, storing its keys and values in `cache`.
    pub fn forward(
        &self,
        layer: usize,
        h: &Tensor,
        inputs: &MbInputs,
        cache: &DeviceKvCache,
    ) -> Result<Tensor> {
        let (n, _) = h.dims2()?;
        let (nh, nkv, d) = (self.heads, self.kv_heads, self.head_dim);
        let mut q = self.q.forward(h)?.reshape((n, nh, d))?;
        let mut k = self.k.forward(h)?.reshape((n, nkv, d))?;
        let v = self.v.forward(h)?.reshape((n, nkv * d))?;
        if let Some(w) = &self.q_norm {
            q = rms_norm(&q, w, self.eps).map_err(model_error)?;
        }
        if let Some(w) = &self.k_norm {
            k = rms_norm(&k, w, self.eps).map_err(model_error)?;
        }
        let rope = |x: Tensor| -> Result<Tensor> {
            candle_nn_rope(&x.unsqueeze(0)?.contiguous()?, &inputs.cos, &inputs.sin)?.squeeze(0)
        };
        let q = rope(q)?;
        let k = rope(k)?.reshape((n, nkv * d))?;
        cache.store(layer, &k, &v, &inputs.store_index)?;
        let mut pieces = Vec::with_capacity(inputs.pieces.len());
        let paged = match &inputs.paged {
            Some(p) => {
                let queries = match &p.select {
                    Some(rows) => q.index_select(rows, 0)?,
                    None => q.clone(),
                };
                let (k_pool, v_pool) = cache.pools(layer)?;
                let op = PagedAttention {
                    heads: nh,
                    kv_heads: nkv,
                    head_dim: d,
                    block_size: cache.capacity().block_size,
                    scale: self.scale as f32,
                    window: match self.kind {
                        AttentionKind::Full => None,
                        AttentionKind::Sliding { window } => Some(window),
                    },
                    sinks: self.sinks.clone(),
                    tables: p.tables.clone(),
                    rows: p.rows.clone(),
                };
                Some(
                    queries
                        .contiguous()?
                        .apply_op3_no_bwd(&k_pool, &v_pool, &op)?
                        .reshape((p.count, nh * d))?,
                )
            }
            None => None,
        };
        for piece in &inputs.pieces {
            match piece {
                Piece::Paged { first, len } => match &paged {
                    Some(out) if paged_covers(inputs, *len) => pieces.push(out.clone()),
                    Some(out) => pieces.push(out.narrow(0, *first, *len)?),
                    None => candle_core::bail!("a paged piece without paged rows"),
                },
                Piece::Prefill {
                    start,
                    len,
                    past,
                    history,
                } => {
                    let (keys, values) = cache.gather(layer, history)?;
                    let qs = q.narrow(0, *start, *len)?.transpose(0, 1)?.contiguous()?;
                    let out = attention_core(
                        &qs,
                        &keys.transpose(0, 1)?.contiguous()?,
                        &values.transpose(0, 1)?.contiguous()?,
                        *past,
                        self.kind,
                        self.sinks.as_ref(),
                        self.scale,
                    )
                    .map_err(model_error)?;
                    pieces.push(out);
                }
            }
        }
        let attn = match pieces.len() {
            1 => pieces.remove(0),
            _ => Tensor::cat(&pieces, 0)?,
        };
        self.o.forward(&attn)
    }
}

/// Whether the one paged launch is the whole micro-batch (no narrowing needed).
fn paged_covers(inputs: &MbInputs, len: usize) -> bool {
    inputs.pieces.len() == 1 && len == inputs.rows
}

/// candle's RoPE over `[b, t, heads, d]` with `cos`/`sin` `[t, d / 2]` (half-split).
fn candle_nn_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    candle_nn::rotary_emb::rope_thd(x, cos, sin)
}
