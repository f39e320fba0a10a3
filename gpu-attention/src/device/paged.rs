//! Paged attention as a candle custom op: query rows against the per-layer key and value pools
//! through the sequences' block tables, read in place (no gather of the history).
//!
//! The CUDA kernel is `afd_paged_attention_f32` in `kernels/afd.cu`; [`PagedAttention::cpu_fwd`]
//! is its twin, step for step: keys in chunks of [`CHUNK`], an online softmax whose running max
//! starts at the sink logit, the sink in the denominator only, a sliding window of `window`
//! keys (`pos - window < j <= pos`), query head `h` reading key/value head
//! `h / (heads / kv_heads)`.

use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};

use super::linear::cpu_slice;

/// Keys per chunk of the online softmax (the kernel's `PA_CHUNK`).
pub const CHUNK: usize = super::kernel_constants::PA_CHUNK;
/// Largest head size the kernel takes (`PA_MAX_HEAD_DIM`).
pub const MAX_HEAD_DIM: usize = super::kernel_constants::PA_MAX_HEAD_DIM;

/// One launch's geometry and tables. Inputs: `q [rows, heads, d]`, `k_pool` and `v_pool`
/// `[num_blocks * block_size, kv_heads, d]`, all f32.
#[derive(Debug, Clone)]
pub struct PagedAttention {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Floats per head.
    pub head_dim: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// `head_dim^-0.5`.
    pub scale: f32,
    /// Keys visible from a query, its own included (sliding window); `None` (or `Some(0)`, as
    /// the kernel reads it): all before it.
    pub window: Option<usize>,
    /// One logit per query head in the softmax denominator (GPT-OSS), f32 `[heads]`.
    pub sinks: Option<Tensor>,
    /// Block tables, u32 `[sequences, max_blocks]` (rows padded with any valid block).
    pub tables: Tensor,
    /// Per query row, u32 `[rows, 2]`: its sequence's row in `tables`, and its position.
    pub rows: Tensor,
}

impl PagedAttention {
    fn check(&self, q: &Layout, k: &Layout, v: &Layout) -> Result<(usize, usize)> {
        let (rows, heads, d) = q.shape().dims3()?;
        let (slots, kv_heads, dk) = k.shape().dims3()?;
        if heads != self.heads
            || d != self.head_dim
            || kv_heads != self.kv_heads
            || dk != d
            || v.shape() != k.shape()
            || self.kv_heads == 0
            || !self.heads.is_multiple_of(self.kv_heads)
            || d > MAX_HEAD_DIM
            || self.block_size == 0
            || !slots.is_multiple_of(self.block_size)
        {
            candle_core::bail!(
                "paged attention: q {:?}, pools {:?} for {} heads over {} kv heads of {} (at most \
                 {MAX_HEAD_DIM}), blocks of {}",
                q.shape(),
                k.shape(),
                self.heads,
                self.kv_heads,
                self.head_dim,
                self.block_size
            );
        }
        if self.rows.dims2()? != (rows, 2) || self.tables.rank() != 2 {
            candle_core::bail!(
                "paged attention: row table {:?} for {rows} rows, block tables {:?}",
                self.rows.shape(),
                self.tables.shape()
            );
        }
        Ok((rows, slots / self.block_size))
    }
}

/// A contiguous u32/f32 copy of a small table held by the op (CPU).
fn host<T: candle_core::WithDType>(t: &Tensor) -> Result<Vec<T>> {
    t.flatten_all()?.to_vec1::<T>()
}

impl CustomOp3 for PagedAttention {
    fn name(&self) -> &'static str {
        "afd-paged-attention"
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
        let (rows, num_blocks) = self.check(l1, l2, l3)?;
        let q = cpu_slice::<f32>(s1, l1, "q")?;
        let k_pool = cpu_slice::<f32>(s2, l2, "key pool")?;
        let v_pool = cpu_slice::<f32>(s3, l3, "value pool")?;
        let tables = host::<u32>(&self.tables)?;
        let row_info = host::<u32>(&self.rows)?;
        let sinks = self.sinks.as_ref().map(host::<f32>).transpose()?;
        let max_blocks = self.tables.dim(1)?;
        let (heads, kv_heads, d, bs) = (self.heads, self.kv_heads, self.head_dim, self.block_size);
        let group = heads / kv_heads;
        let mut out = vec![0f32; rows * heads * d];
        let mut scores = [0f32; CHUNK];
        let mut slot_of = [0usize; CHUNK];
        for row in 0..rows {
            let table = row_info[2 * row] as usize;
            let pos = row_info[2 * row + 1] as usize;
            let tab = &tables[table * max_blocks..(table + 1) * max_blocks];
            let lo = match self.window {
                // 0 means no window, as in the kernel (which is passed 0 for `None`).
                Some(w) if w > 0 && pos + 1 > w => pos + 1 - w,
                _ => 0,
            };
            for h in 0..heads {
                let kvh = h / group;
                let qh = &q[(row * heads + h) * d..(row * heads + h + 1) * d];
                let mut m = sinks.as_ref().map_or(f32::NEG_INFINITY, |s| s[h]);
                let (mut l, mut acc) = (0f32, vec![0f32; d]);
                let mut start = lo;
                while start <= pos {
                    let count = CHUNK.min(pos + 1 - start);
                    for (j, slot) in slot_of.iter_mut().enumerate().take(count) {
                        let p = start + j;
                        let block = tab[p / bs] as usize;
                        // The host checked every block id (as the kernel assumes).
                        let block = if block < num_blocks { block } else { 0 };
                        *slot = block * bs + p % bs;
                    }
                    let at = |slot: usize| (slot * kv_heads + kvh) * d;
                    for j in 0..count {
                        let kp = &k_pool[at(slot_of[j])..at(slot_of[j]) + d];
                        let s: f32 = qh.iter().zip(kp).map(|(a, b)| a * b).sum();
                        scores[j] = s * self.scale;
                    }
                    let chunk_max = scores[..count].iter().fold(m, |a, &b| a.max(b));
                    for s in &mut scores[..count] {
                        *s = (*s - chunk_max).exp();
                    }
                    let chunk_sum: f32 = scores[..count].iter().sum();
                    let alpha = (m - chunk_max).exp();
                    l = l * alpha + chunk_sum;
                    let mut part = vec![0f32; d];
                    for j in 0..count {
                        let vp = &v_pool[at(slot_of[j])..at(slot_of[j]) + d];
                        for (a, &v) in part.iter_mut().zip(vp) {
                            *a += scores[j] * v;
                        }
                    }
                    for (a, p) in acc.iter_mut().zip(&part) {
                        *a = *a * alpha + p;
                    }
                    m = chunk_max;
                    start += CHUNK;
                }
                let denom = l + sinks.as_ref().map_or(0.0, |s| (s[h] - m).exp());
                let oh = &mut out[(row * heads + h) * d..(row * heads + h + 1) * d];
                for (o, a) in oh.iter_mut().zip(&acc) {
                    *o = a / denom;
                }
            }
        }
        Ok((CpuStorage::F32(out), Shape::from((rows, heads, d))))
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
        let (rows, num_blocks) = self.check(l1, l2, l3)?;
        let (heads, d) = (self.heads, self.head_dim);
        let dev = s1.device.clone();
        let q = cuda::view::<f32>(s1, l1, "q")?;
        let k_pool = cuda::view::<f32>(s2, l2, "key pool")?;
        let v_pool = cuda::view::<f32>(s3, l3, "value pool")?;
        let out = cuda::output::<f32>(&dev, rows * heads * d)?;
        let func =
            dev.get_or_load_custom_func("afd_paged_attention_f32", cuda::MODULE, cuda::PTX)?;
        let cfg = cuda::config(
            (
                cuda::grid_dim(heads, "heads")?,
                cuda::grid_dim(rows, "query rows")?,
            ),
            super::kernel_constants::PA_THREADS as u32,
        );
        let ints = cuda::ints([
            (heads, "heads"),
            (self.kv_heads, "kv heads"),
            (d, "head size"),
            (self.block_size, "block size"),
            (self.tables.dim(1)?, "blocks per table"),
            (num_blocks, "blocks"),
        ])?;
        let [window] = cuda::ints([(self.window.unwrap_or(0), "window")])?;
        let has_sinks = i32::from(self.sinks.is_some());
        // Without sinks the kernel never reads the pointer; it still needs a valid one.
        let sinks = match &self.sinks {
            Some(s) => s.clone(),
            None => Tensor::zeros(
                1,
                candle_core::DType::F32,
                &candle_core::Device::Cuda(dev.clone()),
            )?,
        };
        cuda::with_tensor::<u32, _>(&self.tables, "block tables", |tables| {
            cuda::with_tensor::<u32, _>(&self.rows, "row table", |row_info| {
                cuda::with_tensor::<f32, _>(&sinks, "sinks", |sinks| {
                    let mut b = func.builder();
                    b.arg(&q);
                    b.arg(&k_pool);
                    b.arg(&v_pool);
                    b.arg(&tables);
                    b.arg(&row_info);
                    b.arg(&sinks);
                    b.arg(&out);
                    for i in &ints {
                        b.arg(i);
                    }
                    b.arg(&self.scale);
                    b.arg(&window);
                    b.arg(&has_sinks);
                    // SAFETY: the kernel reads q, the pools and `out` at indices it forms
                    // from the launch shape (rows, heads: checked against q's shape above) and
                    // from `tables` and `rows`, which it does not check: each row's table index
                    // must be below the tables' count, its position below blocks per table
                    // times the block size, and every block id a row reads below num_blocks.
                    // They are device data, so this op cannot check them; `MbInputs::new`
                    // (inputs.rs), their only builder outside tests, builds them so and
                    // refuses a block id past the cache.
                    unsafe { b.launch(cfg) }.w().map(|_| ())
                })
            })
        })?;
        Ok(cuda::finished(out, dev, Shape::from((rows, heads, d))))
    }
}
