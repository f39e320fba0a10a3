//! The experts on the device, for the GPU-only baseline: each MoE layer's gate, up and down
//! projections stacked `[experts, out, in]` in their stored format (MXFP4 decoded in the kernel,
//! bf16 as stored), and every (token, chosen expert) pair of a step through them in one launch
//! per projection (`afd_moe_*` in `kernels/afd.cu`), whatever experts the tokens chose.

use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Device, Layout, Result, Shape, Tensor};
use model::config::Activation;
use model::weights::{GatedMlp, MoeWeights, WeightMatrix};

use super::linear::{DeviceLinear, DeviceWeight, cpu_slice};
use super::twins;

/// Most pairs in one launch (the grid's y limit).
const MAX_PAIRS: usize = 65_535;

/// One projection of every expert of a layer, `[experts, out, in]`.
#[derive(Debug)]
struct Stacked {
    weight: DeviceWeight,
    rows: usize,
    bias: Option<Tensor>,
}

impl Stacked {
    fn upload(
        mats: &[&WeightMatrix],
        biases: Option<Vec<&[f32]>>,
        device: &Device,
    ) -> Result<Self> {
        let Some(first) = mats.first() else {
            candle_core::bail!("a MoE layer with no experts cannot be uploaded");
        };
        let (rows, cols, format) = (first.rows(), first.cols(), first.format());
        let e = mats.len();
        // The experts' rows back to back: one matrix of e * rows rows.
        let mut bytes = Vec::new();
        let mut scales = Vec::new();
        for m in mats {
            if (m.rows(), m.cols(), m.format()) != (rows, cols, format) {
                candle_core::bail!("experts of one layer differ in shape or format");
            }
            for r in 0..rows {
                bytes.extend_from_slice(m.row_bytes(r));
                scales.extend_from_slice(m.row_scales(r));
            }
        }
        let weight = match format {
            model::WeightFormat::Mxfp4 => DeviceWeight::Mxfp4 {
                blocks: Tensor::from_raw_buffer(&bytes, DType::U8, &[e * rows, cols / 2], device)?,
                scales: Tensor::from_raw_buffer(
                    &scales,
                    DType::U8,
                    &[e * rows, cols / 32],
                    device,
                )?,
            },
            f => {
                let dtype = match f {
                    model::WeightFormat::F32 => DType::F32,
                    model::WeightFormat::Bf16 => DType::BF16,
                    _ => DType::F16,
                };
                DeviceWeight::Dense(Tensor::from_raw_buffer(
                    &bytes,
                    dtype,
                    &[e * rows, cols],
                    device,
                )?)
            }
        };
        let bias = biases
            .map(|b| {
                let flat: Vec<f32> = b.concat();
                Tensor::from_vec(flat, (e, rows), device)
            })
            .transpose()?;
        Ok(Stacked { weight, rows, bias })
    }

    /// `out[p] = W[expert[p]] x[token[p]] (+ bias)` for every pair, `[pairs, rows]`.
    fn forward(&self, x: &Tensor, tokens: &Tensor, experts: &Tensor) -> Result<Tensor> {
        let pairs = tokens.dim(0)?;
        let mut pieces = Vec::new();
        for start in (0..pairs).step_by(MAX_PAIRS) {
            let len = MAX_PAIRS.min(pairs - start);
            let op = MoeOp {
                tokens: tokens.narrow(0, start, len)?.contiguous()?,
                experts: experts.narrow(0, start, len)?.contiguous()?,
                rows: self.rows,
            };
            pieces.push(match &self.weight {
                DeviceWeight::Dense(w) => x.apply_op2_no_bwd(w, &op)?,
                DeviceWeight::Mxfp4 { blocks, scales } => {
                    x.apply_op3_no_bwd(blocks, scales, &op)?
                }
            });
        }
        let y = if pieces.len() == 1 {
            pieces.remove(0)
        } else {
            Tensor::cat(&pieces, 0)?
        };
        match &self.bias {
            Some(b) => y + b.index_select(experts, 0)?,
            None => Ok(y),
        }
    }
}

/// The experts of one MoE layer on the device.
#[derive(Debug)]
pub struct DeviceExperts {
    gate: Stacked,
    up: Stacked,
    down: Stacked,
    activation: Activation,
    top_k: usize,
}

impl DeviceExperts {
    /// Copies every expert of `moe` (all must be loaded) to `device`.
    pub fn upload(
        moe: &MoeWeights,
        activation: Activation,
        top_k: usize,
        device: &Device,
    ) -> Result<Self> {
        // The kernels trust the router's top-k ids to name uploaded experts.
        let count = moe.experts.len();
        if moe.router.weight.rows() != count || top_k == 0 || top_k > count {
            candle_core::bail!(
                "a MoE layer of {count} experts with a router of {} scores and top-k {top_k}",
                moe.router.weight.rows()
            );
        }
        let experts: Vec<&GatedMlp> = (0..moe.experts.len())
            .map(|e| moe.expert(e).map_err(super::attention::model_error))
            .collect::<Result<_>>()?;
        let stack = |pick: fn(&GatedMlp) -> &model::weights::Linear| {
            let mats: Vec<&WeightMatrix> = experts.iter().map(|m| &pick(m).weight).collect();
            let biases: Option<Vec<&[f32]>> =
                experts.iter().map(|m| pick(m).bias.as_deref()).collect();
            Stacked::upload(&mats, biases, device)
        };
        Ok(DeviceExperts {
            gate: stack(|m| &m.gate)?,
            up: stack(|m| &m.up)?,
            down: stack(|m| &m.down)?,
            activation,
            top_k,
        })
    }

    /// Bytes on the device.
    pub fn bytes(&self) -> usize {
        [&self.gate, &self.up, &self.down]
            .iter()
            .map(|s| s.weight.bytes() + s.bias.as_ref().map_or(0, |b| b.elem_count() * 4))
            .sum()
    }

    /// The layer's output `[n, hidden]` for normed rows `h` routed to `experts` (u32 `[n, k]`)
    /// with `weights` (f32 `[n, k]`): every chosen expert's output, weighted, summed per token.
    pub fn forward(&self, h: &Tensor, experts: &Tensor, weights: &Tensor) -> Result<Tensor> {
        let (n, hidden) = h.dims2()?;
        let k = self.top_k;
        // The kernels index by these ids unchecked: [n, k] as the upload's router made them.
        if experts.dims2()? != (n, k) || weights.dims2()? != (n, k) {
            candle_core::bail!(
                "moe layer: {n} tokens routed to {:?} experts with {:?} weights, expected [{n}, {k}]",
                experts.shape(),
                weights.shape()
            );
        }
        let dev = h.device();
        let pairs = n * k;
        let tokens: Vec<u32> = (0..pairs as u32).map(|p| p / k as u32).collect();
        let tokens = Tensor::from_vec(tokens, pairs, dev)?;
        let experts = experts.flatten_all()?.contiguous()?;
        let gate = self.gate.forward(h, &tokens, &experts)?;
        let up = self.up.forward(h, &tokens, &experts)?;
        let act = activate(self.activation, &gate, &up)?;
        let each = Tensor::arange(0u32, pairs as u32, dev)?;
        let down = self.down.forward(&act, &each, &experts)?;
        let weighted = down.broadcast_mul(&weights.flatten_all()?.unsqueeze(1)?)?;
        weighted.reshape((n, k, hidden))?.sum(1)
    }
}

/// A dense gated MLP on the device (Qwen3-MoE's `mlp_only_layers`), SwiGLU.
#[derive(Debug)]
pub struct DeviceMlp {
    gate: DeviceLinear,
    up: DeviceLinear,
    down: DeviceLinear,
}

impl DeviceMlp {
    /// Copies `mlp` to `device`.
    pub fn upload(mlp: &GatedMlp, device: &Device) -> Result<Self> {
        Ok(DeviceMlp {
            gate: DeviceLinear::upload(&mlp.gate, device)?,
            up: DeviceLinear::upload(&mlp.up, device)?,
            down: DeviceLinear::upload(&mlp.down, device)?,
        })
    }

    /// Bytes on the device.
    pub fn bytes(&self) -> usize {
        self.gate.bytes() + self.up.bytes() + self.down.bytes()
    }

    /// `down(silu(gate h) * up h)`.
    pub fn forward(&self, h: &Tensor) -> Result<Tensor> {
        let a = activate(
            Activation::SwiGlu,
            &self.gate.forward(h)?,
            &self.up.forward(h)?,
        )?;
        self.down.forward(&a)
    }
}

/// The gated activation, elementwise (model::kernels::activate in tensor ops).
fn activate(act: Activation, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    match act {
        Activation::SwiGlu => gate.silu()? * up,
        Activation::ClampedSwiGlu { alpha, limit } => {
            let limit = limit as f64;
            let gate = gate.minimum(limit)?;
            let up = up.clamp(-limit, limit)?;
            let glu = (&gate * candle_nn::ops::sigmoid(&(&gate * alpha as f64)?)?)?;
            (up + 1.0)? * glu
        }
    }
}

/// Pairs of (token, expert) through stacked weights `[experts * rows, cols]`: input `x`
/// `[tokens, cols]` f32 and the weight (dense, or MXFP4 blocks and scales); `[pairs, rows]` f32.
#[derive(Debug, Clone)]
struct MoeOp {
    /// u32 `[pairs]`: the row of `x` of each pair.
    tokens: Tensor,
    /// u32 `[pairs]`: the expert of each pair.
    experts: Tensor,
    /// Output rows of one expert.
    rows: usize,
}

impl MoeOp {
    /// `(cols, experts)` after checking `x` against a weight of `weight_rows` rows.
    fn dims(&self, x: &Layout, weight_rows: usize) -> Result<(usize, usize)> {
        let (_, cols) = x.shape().dims2()?;
        if self.rows == 0 || !weight_rows.is_multiple_of(self.rows) {
            candle_core::bail!(
                "moe op: {weight_rows} weight rows for experts of {}",
                self.rows
            );
        }
        Ok((cols, weight_rows / self.rows))
    }

    /// The pairs' tokens and experts for the CPU twins (`twins::moe_*`, which walk the data
    /// as the kernels do), each checked against `x`'s rows and the experts there are.
    fn cpu_pairs(
        &self,
        x: &[f32],
        cols: usize,
        experts_count: usize,
    ) -> Result<(Vec<u32>, Vec<u32>)> {
        let tokens = self.tokens.to_vec1::<u32>()?;
        let experts = self.experts.to_vec1::<u32>()?;
        if tokens.len() != experts.len() {
            candle_core::bail!(
                "moe op: {} pair tokens for {} pair experts",
                tokens.len(),
                experts.len()
            );
        }
        for (p, (&t, &e)) in tokens.iter().zip(&experts).enumerate() {
            if e as usize >= experts_count || (t as usize + 1) * cols > x.len() {
                candle_core::bail!("moe op: pair {p} names token {t} and expert {e}");
            }
        }
        Ok((tokens, experts))
    }

    /// The dense op on the CPU, the weight read through `w(flat index)`.
    fn cpu_dense(
        &self,
        x: &[f32],
        cols: usize,
        experts_count: usize,
        w: impl Fn(usize) -> f32,
    ) -> Result<(CpuStorage, Shape)> {
        let (tokens, experts) = self.cpu_pairs(x, cols, experts_count)?;
        let out = twins::moe_dense(x, &tokens, &experts, w, cols, self.rows);
        Ok((CpuStorage::F32(out), Shape::from((tokens.len(), self.rows))))
    }
}

impl CustomOp2 for MoeOp {
    fn name(&self) -> &'static str {
        "afd-moe"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (weight_rows, wcols) = l2.shape().dims2()?;
        let (cols, count) = self.dims(l1, weight_rows)?;
        if wcols != cols {
            candle_core::bail!("moe op: x has {cols} features, the weight {wcols}");
        }
        let x = cpu_slice::<f32>(s1, l1, "x")?;
        match s2 {
            CpuStorage::F32(_) => {
                let w = cpu_slice::<f32>(s2, l2, "weight")?;
                self.cpu_dense(x, cols, count, |i| w[i])
            }
            CpuStorage::BF16(_) => {
                let w = cpu_slice::<half::bf16>(s2, l2, "weight")?;
                self.cpu_dense(x, cols, count, |i| w[i].to_f32())
            }
            CpuStorage::F16(_) => {
                let w = cpu_slice::<half::f16>(s2, l2, "weight")?;
                self.cpu_dense(x, cols, count, |i| w[i].to_f32())
            }
            _ => candle_core::bail!("moe op: the weight must be f32, bf16 or f16"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let (weight_rows, wcols) = l2.shape().dims2()?;
        let (cols, _) = self.dims(l1, weight_rows)?;
        if wcols != cols {
            candle_core::bail!("moe op: x has {cols} features, the weight {wcols}");
        }
        match s2.dtype() {
            DType::F32 => self.launch::<f32>("afd_moe_f32", s1, l1, &[(s2, l2)], cols),
            DType::BF16 => self.launch::<half::bf16>("afd_moe_bf16", s1, l1, &[(s2, l2)], cols),
            DType::F16 => self.launch::<half::f16>("afd_moe_f16", s1, l1, &[(s2, l2)], cols),
            other => candle_core::bail!("moe op: weight dtype {other:?}"),
        }
    }
}

impl CustomOp3 for MoeOp {
    fn name(&self) -> &'static str {
        "afd-moe-mxfp4"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (weight_rows, block_bytes) = l2.shape().dims2()?;
        let (cols, count) = self.dims(l1, weight_rows)?;
        if !cols.is_multiple_of(32)
            || block_bytes != cols / 2
            || l3.shape().dims2()? != (weight_rows, cols / 32)
        {
            candle_core::bail!(
                "moe op: x has {cols} features; MXFP4 blocks {:?} and scales {:?} do not fit",
                l2.shape(),
                l3.shape()
            );
        }
        let x = cpu_slice::<f32>(s1, l1, "x")?;
        let blocks = cpu_slice::<u8>(s2, l2, "blocks")?;
        let scales = cpu_slice::<u8>(s3, l3, "scales")?;
        let (tokens, experts) = self.cpu_pairs(x, cols, count)?;
        let out = twins::moe_mxfp4(x, &tokens, &experts, blocks, scales, cols, self.rows);
        Ok((CpuStorage::F32(out), Shape::from((tokens.len(), self.rows))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (weight_rows, block_bytes) = l2.shape().dims2()?;
        let (cols, _) = self.dims(l1, weight_rows)?;
        if l3.shape().dims2()? != (weight_rows, cols / 32) || block_bytes != cols / 2 {
            candle_core::bail!(
                "moe op: x has {cols} features; MXFP4 blocks {:?} and scales {:?} do not fit",
                l2.shape(),
                l3.shape()
            );
        }
        if !cols.is_multiple_of(32)
            || !l1.start_offset().is_multiple_of(4)
            || !l2.start_offset().is_multiple_of(16)
        {
            candle_core::bail!("moe op: MXFP4 needs 32-column blocks and aligned starts");
        }
        self.launch::<u8>("afd_moe_mxfp4", s1, l1, &[(s2, l2), (s3, l3)], cols)
    }
}

#[cfg(feature = "cuda")]
impl MoeOp {
    /// Launches `name` over the pairs: x, pair tokens, pair experts, the weight views, out.
    fn launch<W: candle_core::cuda_backend::CudaDType>(
        &self,
        name: &str,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        weights: &[(&candle_core::CudaStorage, &Layout)],
        cols: usize,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::cuda_backend::WrapErr;
        use candle_core::cuda_backend::cudarc::driver::PushKernelArg;

        use super::cuda;
        let pairs = self.tokens.dim(0)?;
        let dev = s1.device.clone();
        let x = cuda::view::<f32>(s1, l1, "x")?;
        let views = weights
            .iter()
            .map(|(s, l)| cuda::view::<W>(s, l, "weight"))
            .collect::<Result<Vec<_>>>()?;
        let out = cuda::output::<f32>(&dev, pairs * self.rows)?;
        let func = dev.get_or_load_custom_func(name, cuda::MODULE, cuda::PTX)?;
        let cfg = cuda::rows_config(self.rows, pairs, "pairs")?;
        let [k_i, n_i] = cuda::ints([(cols, "features"), (self.rows, "rows")])?;
        cuda::with_tensor::<u32, _>(&self.tokens, "pair tokens", |tokens| {
            cuda::with_tensor::<u32, _>(&self.experts, "pair experts", |experts| {
                let mut b = func.builder();
                b.arg(&x);
                b.arg(&tokens);
                b.arg(&experts);
                for v in &views {
                    b.arg(v);
                }
                b.arg(&out);
                b.arg(&k_i);
                b.arg(&n_i);
                // SAFETY: the kernel reads row `pair_token[p]` of x and rows `pair_expert[p]
                // * rows ..` of the weight, `cols` wide (the widths checked above), and writes
                // pairs * rows floats. It does not check the ids, which are device data this
                // op cannot see: `DeviceExperts::forward` makes the tokens (p / k, below x's
                // rows), and the expert ids are the router's top-k over as many logits as the
                // layer has experts (`DeviceExperts::upload` checks the router's width,
                // `forward` the routing's shape).
                unsafe { b.launch(cfg) }.w().map(|_| ())
            })
        })?;
        Ok(cuda::finished(out, dev, Shape::from((pairs, self.rows))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_layer_of_no_experts_is_refused_with_a_reason() {
        let err = Stacked::upload(&[], None, &Device::Cpu).unwrap_err();
        assert!(err.to_string().contains("no experts"), "{err}");
    }
}
