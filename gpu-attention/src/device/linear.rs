//! Linear layers on the device with their weights as stored: f32 through candle's matmul;
//! bf16, f16 and MXFP4 through custom ops that decode the weights in registers and accumulate
//! in f32 against f32 activations (`afd_linear_*` in `kernels/afd.cu`; on the CPU their twins
//! in `twins.rs`, which walk the data as the kernels do).
//! Long prompt chunks of half-precision weights take candle's f32 matmul on the upcast weight,
//! where arithmetic, not the weight's bytes, is the cost.

use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Device, Layout, Result, Shape, Tensor};
use model::WeightFormat;
use model::weights::{Linear, WeightMatrix};

use super::twins;

/// At most this many tokens go through the half-precision custom op; more take the matmul.
const DECODE_TOKENS: usize = 32;

/// A weight matrix `[out, in]` on the device.
#[derive(Debug, Clone)]
pub enum DeviceWeight {
    /// f32, bf16 or f16 elements.
    Dense(Tensor),
    /// MXFP4: `blocks` u8 `[out, in / 2]`, `scales` u8 `[out, in / 32]`.
    Mxfp4 {
        /// Packed nibbles.
        blocks: Tensor,
        /// E8M0 scales.
        scales: Tensor,
    },
}

impl DeviceWeight {
    /// Copies a stored matrix to `device` in its format (row selections are gathered).
    pub fn upload(w: &WeightMatrix, device: &Device) -> Result<Self> {
        let (rows, cols) = (w.rows(), w.cols());
        let mut bytes = Vec::with_capacity(w.stored_bytes());
        for r in 0..rows {
            bytes.extend_from_slice(w.row_bytes(r));
        }
        let dense = |dtype| Tensor::from_raw_buffer(&bytes, dtype, &[rows, cols], device);
        Ok(match w.format() {
            WeightFormat::F32 => DeviceWeight::Dense(dense(DType::F32)?),
            WeightFormat::Bf16 => DeviceWeight::Dense(dense(DType::BF16)?),
            WeightFormat::F16 => DeviceWeight::Dense(dense(DType::F16)?),
            WeightFormat::Mxfp4 => {
                let mut scales = Vec::with_capacity(rows * cols / 32);
                for r in 0..rows {
                    scales.extend_from_slice(w.row_scales(r));
                }
                DeviceWeight::Mxfp4 {
                    blocks: Tensor::from_raw_buffer(&bytes, DType::U8, &[rows, cols / 2], device)?,
                    scales: Tensor::from_raw_buffer(
                        &scales,
                        DType::U8,
                        &[rows, cols / 32],
                        device,
                    )?,
                }
            }
        })
    }

    /// Bytes on the device.
    pub fn bytes(&self) -> usize {
        let size = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        match self {
            DeviceWeight::Dense(t) => size(t),
            DeviceWeight::Mxfp4 { blocks, scales } => size(blocks) + size(scales),
        }
    }
}

/// `x W^T + b` on the device.
#[derive(Debug, Clone)]
pub struct DeviceLinear {
    weight: DeviceWeight,
    bias: Option<Tensor>,
    rows: usize,
    cols: usize,
}

impl DeviceLinear {
    /// Copies `linear` to `device`.
    pub fn upload(linear: &Linear, device: &Device) -> Result<Self> {
        Ok(DeviceLinear {
            weight: DeviceWeight::upload(&linear.weight, device)?,
            bias: linear
                .bias
                .as_deref()
                .map(|b| Tensor::from_slice(b, b.len(), device))
                .transpose()?,
            rows: linear.weight.rows(),
            cols: linear.weight.cols(),
        })
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Bytes on the device.
    pub fn bytes(&self) -> usize {
        self.weight.bytes() + self.bias.as_ref().map_or(0, |b| b.elem_count() * 4)
    }

    /// `x` (`[tokens, in]`, f32) through the layer: `[tokens, out]`, f32.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (tokens, cols) = x.dims2()?;
        if cols != self.cols {
            candle_core::bail!(
                "linear layer expects {} input features, got {cols}",
                self.cols
            );
        }
        let x = x.contiguous()?;
        let y = match &self.weight {
            DeviceWeight::Dense(w) if w.dtype() == DType::F32 => x.matmul(&w.t()?)?,
            DeviceWeight::Dense(w) if tokens > DECODE_TOKENS => {
                x.matmul(&w.to_dtype(DType::F32)?.t()?)?
            }
            DeviceWeight::Dense(w) => x.apply_op2_no_bwd(w, &HalfLinear)?,
            DeviceWeight::Mxfp4 { blocks, scales } => {
                x.apply_op3_no_bwd(blocks, scales, &Mxfp4Linear)?
            }
        };
        match &self.bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}

/// `x [n, K] f32` times `w [N, K]` bf16/f16, transposed: `[n, N]` f32.
#[derive(Debug, Clone, Copy)]
pub struct HalfLinear;

/// A contiguous slice of a CPU storage under `layout`.
pub(crate) fn cpu_slice<'a, T: candle_core::WithDType>(
    storage: &'a CpuStorage,
    layout: &Layout,
    what: &str,
) -> Result<&'a [T]> {
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("{what} must be contiguous")))?;
    Ok(&storage.as_slice::<T>()?[start..end])
}

/// `(n, K, N)` of `x [n, K]` against `w [N, K]`.
fn dims(x: &Layout, w: &Layout) -> Result<(usize, usize, usize)> {
    let (n, k) = x.shape().dims2()?;
    let (rows, kw) = w.shape().dims2()?;
    if k != kw {
        candle_core::bail!("linear op: x has {k} features, the weight {kw}");
    }
    Ok((n, k, rows))
}

/// Whether `afd_linear_bf16`/`_f16` take 16-byte loads: whole groups of 8 features and
/// aligned starts (the launch and the twin decide alike).
fn vec_loads(k: usize, x: &Layout, w: &Layout) -> bool {
    k.is_multiple_of(8) && x.start_offset().is_multiple_of(4) && w.start_offset().is_multiple_of(8)
}

impl CustomOp2 for HalfLinear {
    fn name(&self) -> &'static str {
        "afd-half-linear"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (n, k, rows) = dims(l1, l2)?;
        let x = cpu_slice::<f32>(s1, l1, "x")?;
        let vec = vec_loads(k, l1, l2);
        let out = match s2 {
            CpuStorage::BF16(_) => {
                let w = cpu_slice::<half::bf16>(s2, l2, "weight")?;
                twins::linear_half(x, |i| w[i].to_f32(), n, k, rows, vec)
            }
            CpuStorage::F16(_) => {
                let w = cpu_slice::<half::f16>(s2, l2, "weight")?;
                twins::linear_half(x, |i| w[i].to_f32(), n, k, rows, vec)
            }
            _ => candle_core::bail!("half linear: the weight must be bf16 or f16"),
        };
        Ok((CpuStorage::F32(out), Shape::from((n, rows))))
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
        match s2.dtype() {
            DType::BF16 => cuda_half::<half::bf16>("afd_linear_bf16", s1, l1, s2, l2),
            DType::F16 => cuda_half::<half::f16>("afd_linear_f16", s1, l1, s2, l2),
            other => candle_core::bail!("half linear: weight dtype {other:?}"),
        }
    }
}

/// Launches `afd_linear_bf16` / `afd_linear_f16`.
#[cfg(feature = "cuda")]
fn cuda_half<W: candle_core::cuda_backend::CudaDType>(
    name: &str,
    s1: &candle_core::CudaStorage,
    l1: &Layout,
    s2: &candle_core::CudaStorage,
    l2: &Layout,
) -> Result<(candle_core::CudaStorage, Shape)> {
    use candle_core::cuda_backend::WrapErr;
    use candle_core::cuda_backend::cudarc::driver::PushKernelArg;

    use super::cuda;
    let (n, k, rows) = dims(l1, l2)?;
    let dev = s1.device.clone();
    let x = cuda::view::<f32>(s1, l1, "x")?;
    let w = cuda::view::<W>(s2, l2, "weight")?;
    let vec = i32::from(vec_loads(k, l1, l2));
    let out = cuda::output::<f32>(&dev, n * rows)?;
    let func = dev.get_or_load_custom_func(name, cuda::MODULE, cuda::PTX)?;
    let cfg = cuda::rows_config(rows, n.div_ceil(cuda::TOKENS_PER_BLOCK), "token tiles")?;
    let dims = cuda::ints([(n, "tokens"), (k, "features"), (rows, "rows")])?;
    let mut b = func.builder();
    b.arg(&x);
    b.arg(&w);
    b.arg(&out);
    for d in &dims {
        b.arg(d);
    }
    b.arg(&vec);
    // SAFETY: the kernel reads n * K floats of x and N * K weights and writes n * N floats,
    // all inside the views and the output allocated above.
    unsafe { b.launch(cfg) }.w()?;
    Ok(cuda::finished(out, dev, Shape::from((n, rows))))
}

/// `x [n, K] f32` times MXFP4 `blocks [N, K / 2]`, `scales [N, K / 32]`, transposed:
/// `[n, N]` f32.
#[derive(Debug, Clone, Copy)]
pub struct Mxfp4Linear;

/// `(n, K, N)` of `x [n, K]` against MXFP4 blocks `[N, K / 2]` and scales `[N, K / 32]`.
fn mxfp4_dims(x: &Layout, blocks: &Layout, scales: &Layout) -> Result<(usize, usize, usize)> {
    let (n, k) = x.shape().dims2()?;
    let (rows, half_k) = blocks.shape().dims2()?;
    let (srows, groups) = scales.shape().dims2()?;
    if k % 32 != 0 || half_k * 2 != k || srows != rows || groups * 32 != k {
        candle_core::bail!(
            "mxfp4 linear: x has {k} features, blocks {:?}, scales {:?}",
            blocks.shape(),
            scales.shape()
        );
    }
    Ok((n, k, rows))
}

impl CustomOp3 for Mxfp4Linear {
    fn name(&self) -> &'static str {
        "afd-mxfp4-linear"
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
        let (n, k, rows) = mxfp4_dims(l1, l2, l3)?;
        let x = cpu_slice::<f32>(s1, l1, "x")?;
        let blocks = cpu_slice::<u8>(s2, l2, "blocks")?;
        let scales = cpu_slice::<u8>(s3, l3, "scales")?;
        let out = twins::linear_mxfp4(x, blocks, scales, n, k, rows);
        Ok((CpuStorage::F32(out), Shape::from((n, rows))))
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
        use candle_core::cuda_backend::WrapErr;
        use candle_core::cuda_backend::cudarc::driver::PushKernelArg;

        use super::cuda;
        let (n, k, rows) = mxfp4_dims(l1, l2, l3)?;
        if !l1.start_offset().is_multiple_of(4) || !l2.start_offset().is_multiple_of(16) {
            candle_core::bail!("mxfp4 linear: x and the blocks must start 16-byte aligned");
        }
        let dev = s1.device.clone();
        let x = cuda::view::<f32>(s1, l1, "x")?;
        let blocks = cuda::view::<u8>(s2, l2, "blocks")?;
        let scales = cuda::view::<u8>(s3, l3, "scales")?;
        let out = cuda::output::<f32>(&dev, n * rows)?;
        let func = dev.get_or_load_custom_func("afd_linear_mxfp4", cuda::MODULE, cuda::PTX)?;
        let cfg = cuda::rows_config(rows, n.div_ceil(cuda::TOKENS_PER_BLOCK), "token tiles")?;
        let dims = cuda::ints([(n, "tokens"), (k, "features"), (rows, "rows")])?;
        let mut b = func.builder();
        b.arg(&x);
        b.arg(&blocks);
        b.arg(&scales);
        b.arg(&out);
        for d in &dims {
            b.arg(d);
        }
        // SAFETY: reads n * K floats, N * K / 2 block bytes and N * K / 32 scales; writes n * N.
        unsafe { b.launch(cfg) }.w()?;
        Ok(cuda::finished(out, dev, Shape::from((n, rows))))
    }
}
