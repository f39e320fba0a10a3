//! The CUDA side of the custom ops (the `cuda` feature): afd's kernels (`kernels/afd.cu`,
//! compiled to PTX by build.rs) loaded through candle's per-device module cache, and the few
//! helpers every launch needs.

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, LaunchConfig};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaDevice, CudaStorage, Layout, Result, Shape, Storage, Tensor};

/// The PTX of `kernels/afd.cu`, loaded with candle's `get_or_load_custom_func` (which caches
/// the module per device): `dev.get_or_load_custom_func(name, MODULE, PTX)`.
pub const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/afd.ptx"));
/// The module's name in candle's cache.
pub const MODULE: &str = "afd_kernels";

/// The contiguous elements of a CUDA storage under `layout`.
pub fn view<'a, T: CudaDType>(
    storage: &'a CudaStorage,
    layout: &Layout,
    what: &str,
) -> Result<CudaView<'a, T>> {
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("{what} must be contiguous")))?;
    Ok(storage.as_cuda_slice::<T>()?.slice(start..end))
}

/// Runs `f` on the CUDA storage of a tensor held by an op (block tables, row tables, sinks).
pub fn with_tensor<T: CudaDType, R>(
    t: &Tensor,
    what: &str,
    f: impl FnOnce(CudaView<'_, T>) -> Result<R>,
) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cuda(s) => f(view::<T>(s, layout, what)?),
        _ => Err(candle_core::Error::Msg(format!(
            "{what} is not on the GPU the op runs on"
        ))),
    }
}

/// Uninitialised device memory for `len` elements that the kernel writes in full.
pub fn output<T: candle_core::cuda_backend::cudarc::driver::DeviceRepr>(
    dev: &CudaDevice,
    len: usize,
) -> Result<CudaSlice<T>> {
    // SAFETY: every launch that uses this writes each of the `len` elements before any read.
    unsafe { dev.alloc::<T>(len.max(1)) }
}

/// A launch of `grid` blocks of `block` threads.
pub fn config(grid: (u32, u32), block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid.0.max(1), grid.1.max(1), 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Output rows per block of the linear and expert kernels (`LIN_WARPS`: a warp each).
const ROWS_PER_BLOCK: usize = super::kernel_constants::LIN_WARPS;
/// Tokens per block of the linear kernels (`LIN_TOKENS`).
pub const TOKENS_PER_BLOCK: usize = super::kernel_constants::LIN_TOKENS;

/// The launch of a kernel with one warp per output row: `rows` across, `down` blocks down
/// (token tiles or (token, expert) pairs).
pub fn rows_config(rows: usize, down: usize, what: &str) -> Result<LaunchConfig> {
    let across = u32::try_from(rows.div_ceil(ROWS_PER_BLOCK)).map_err(|_| {
        candle_core::Error::Msg(format!("{rows} output rows are too many for a grid"))
    })?;
    Ok(config(
        (across, grid_dim(down, what)?),
        (ROWS_PER_BLOCK * 32) as u32,
    ))
}

/// Dimensions as the `int`s the kernels take, or an error naming one that does not fit.
pub fn ints<const N: usize>(values: [(usize, &str); N]) -> Result<[i32; N]> {
    let mut out = [0i32; N];
    for (o, (value, what)) in out.iter_mut().zip(values) {
        *o = i32::try_from(value).map_err(|_| {
            candle_core::Error::Msg(format!("{what} ({value}) is too large for a kernel"))
        })?;
    }
    Ok(out)
}

/// A grid dimension (at most 65535 for y).
pub fn grid_dim(value: usize, what: &str) -> Result<u32> {
    u32::try_from(value)
        .ok()
        .filter(|&v| v <= 65_535)
        .ok_or_else(|| {
            candle_core::Error::Msg(format!("{what} ({value}) exceeds a kernel grid (65535)"))
        })
}

/// A kernel's f32 output as candle storage of `shape`.
pub fn finished(out: CudaSlice<f32>, dev: CudaDevice, shape: Shape) -> (CudaStorage, Shape) {
    (CudaStorage::wrap_cuda_slice(out, dev), shape)
}

/// `(free, total)` bytes of the GPU behind `dev`.
pub fn memory(dev: &CudaDevice) -> Result<(usize, usize)> {
    dev.cuda_stream().context().mem_get_info().w()
}
