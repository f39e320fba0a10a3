//! Row-wise building blocks shared by the reference forward and the attention node:
//! linear layers over stored weights, RMSNorm, and the bridge between candle tensors and the
//! CPU kernels.

use candle_core::{DType, Device, Storage, Tensor};

use crate::error::{Error, Result};
use crate::kernels;
use crate::weights::Linear;

/// Runs `f` on the f32 contents of a CPU tensor (made contiguous first if needed).
pub fn with_f32_slice<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    let t = if t.is_contiguous() {
        t.clone()
    } else {
        t.contiguous()?
    };
    let t = if t.dtype() == DType::F32 {
        t
    } else {
        t.to_dtype(DType::F32)?
    };
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(cpu) => {
            let all = cpu.as_slice::<f32>()?;
            let start = layout.start_offset();
            Ok(f(&all[start..start + layout.shape().elem_count()]))
        }
        _ => Err(Error::InvalidInput(
            "the CPU kernels were given a tensor on another device".into(),
        )),
    }
}

/// Copies a tensor's values out as f32.
pub fn to_f32_vec(t: &Tensor) -> Result<Vec<f32>> {
    with_f32_slice(t, <[f32]>::to_vec)
}

impl Linear {
    /// `x W^T + b` for `x` of shape `[tokens, in]`, giving `[tokens, out]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (tokens, cols) = x.dims2()?;
        if cols != self.weight.cols() {
            return Err(Error::InvalidInput(format!(
                "linear layer expects {} input features, got {cols}",
                self.weight.cols()
            )));
        }
        let rows = self.weight.rows();
        let mut out = vec![0f32; tokens * rows];
        with_f32_slice(x, |xs| {
            kernels::matmul(xs, tokens, &self.weight, self.bias.as_deref(), &mut out)
        })?;
        Ok(Tensor::from_vec(out, (tokens, rows), x.device())?)
    }

    /// The one-token product `x W^T + b` into `out`, for [`kernels::matvecs`] to run with
    /// others.
    pub fn matvec<'a>(&'a self, x: &'a [f32], out: &'a mut [f32]) -> kernels::MatVec<'a> {
        kernels::MatVec {
            x,
            w: &self.weight,
            bias: self.bias.as_deref(),
            out,
        }
    }

    /// Same as [`Self::forward`] on a plain row-major slice.
    pub fn forward_rows(&self, x: &[f32], tokens: usize) -> Vec<f32> {
        let mut out = vec![0f32; tokens * self.weight.rows()];
        kernels::matmul(x, tokens, &self.weight, self.bias.as_deref(), &mut out);
        out
    }
}

/// RMSNorm over the last dimension, in f32: `w * x / sqrt(mean(x^2) + eps)`.
///
/// Hugging Face normalizes in f32 and multiplies by the weight in f32 (GPT-OSS) or after
/// casting back to the input dtype (Llama style); in an f32 model both are the same.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let x = x.to_dtype(DType::F32)?;
    let variance = x.sqr()?.mean_keepdim(candle_core::D::Minus1)?;
    // x * rsqrt(var + eps), as transformers writes it.
    let normed = x.broadcast_mul(&(variance + eps)?.sqrt()?.recip()?)?;
    Ok(normed.broadcast_mul(weight)?)
}

/// A 1-D f32 tensor from host values.
pub fn vector(values: &[f32], device: &Device) -> Result<Tensor> {
    Ok(Tensor::from_slice(values, values.len(), device)?)
}
