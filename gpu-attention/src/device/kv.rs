//! The paged KV cache in device memory: per layer one key pool and one value pool of
//! `num_blocks * block_size` slots of `kv_heads * head_dim` f32, with the router's block tables
//! unchanged (slot of position `p` = `table[p / block_size] * block_size + p % block_size`).
//! New keys and values are scattered into their slots in place; decode attention reads the
//! pools through the block tables ([`super::paged`]); long prompt chunks gather their history.

use candle_core::{DType, Device, Result, Tensor};
use model::ModelConfig;
use step::KvCapacity;

use crate::kv_cache::KvCacheConfig;

/// Device memory kept free beside the weights and the KV cache when the cache is sized from
/// `gpu_memory_utilization`: activations of a step (prompt chunks' score matrices, upcast
/// weights of the prefill matmuls) and the allocator's slack.
pub const ACTIVATION_RESERVE_BYTES: usize = 2 << 30;

/// Keys and values of every layer on the device.
#[derive(Debug)]
pub struct DeviceKvCache {
    capacity: KvCapacity,
    kv_heads: usize,
    head_dim: usize,
    /// Per layer `[slots, kv_heads * head_dim]`.
    keys: Vec<Tensor>,
    values: Vec<Tensor>,
}

/// The KV budget in bytes on `device`: `gpu_memory_utilization` of the GPU's memory less what
/// is already in use (the weights) and [`ACTIVATION_RESERVE_BYTES`], else `memory_bytes`.
pub fn budget(config: &KvCacheConfig, device: &Device) -> Result<usize> {
    let Some(fraction) = config.gpu_memory_utilization else {
        return Ok(config.memory_bytes);
    };
    if !(fraction > 0.0 && fraction <= 1.0) {
        candle_core::bail!("--gpu-memory-utilization must be in (0, 1], not {fraction}");
    }
    let (free, total) = device_memory(device)?;
    let used = total.saturating_sub(free);
    let allowed = (fraction * total as f64) as usize;
    allowed
        .checked_sub(used + ACTIVATION_RESERVE_BYTES)
        .filter(|&b| b > 0)
        .ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "--gpu-memory-utilization {fraction} allows {:.1} GiB of the GPU's {:.1} GiB, but \
                 {:.1} GiB are in use (weights, other processes) and {:.1} GiB are kept for \
                 activations: raise it, or give the cache a size with --kv-cache-memory",
                gib(allowed),
                gib(total),
                gib(used),
                gib(ACTIVATION_RESERVE_BYTES)
            ))
        })
}

fn gib(bytes: usize) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// `(free, total)` bytes of a GPU.
#[cfg(feature = "cuda")]
pub fn device_memory(device: &Device) -> Result<(usize, usize)> {
    match device {
        Device::Cuda(d) => super::cuda::memory(d),
        _ => candle_core::bail!(
            "--gpu-memory-utilization sizes the KV cache of a GPU; on the CPU give \
             --kv-cache-memory instead"
        ),
    }
}

/// `(free, total)` bytes of a GPU (none in a build without CUDA).
#[cfg(not(feature = "cuda"))]
pub fn device_memory(_device: &Device) -> Result<(usize, usize)> {
    candle_core::bail!(
        "--gpu-memory-utilization sizes the KV cache of a GPU; on the CPU give --kv-cache-memory \
         instead"
    )
}

/// The slot of position `p` under `table`, if the table reaches that far and names a block
/// the cache has.
pub fn slot(capacity: KvCapacity, table: &[u32], p: usize) -> Option<u32> {
    let bs = capacity.block_size;
    let block = *table.get(p / bs)? as usize;
    (block < capacity.num_blocks).then(|| (block * bs + p % bs) as u32)
}

impl DeviceKvCache {
    /// Zeroed pools for `capacity` on `device`.
    pub fn new(model: &ModelConfig, capacity: KvCapacity, device: &Device) -> Result<Self> {
        let slots = capacity.num_blocks * capacity.block_size;
        let row = model.kv_dim();
        let pool = || Tensor::zeros((slots, row), DType::F32, device);
        let layers = model.num_layers();
        Ok(DeviceKvCache {
            capacity,
            kv_heads: model.num_kv_heads,
            head_dim: model.head_dim,
            keys: (0..layers).map(|_| pool()).collect::<Result<_>>()?,
            values: (0..layers).map(|_| pool()).collect::<Result<_>>()?,
        })
    }

    /// The geometry.
    pub fn capacity(&self) -> KvCapacity {
        self.capacity
    }

    /// Writes rows `k`, `v` (`[n, kv_heads * head_dim]`) of `layer` into their slots;
    /// `index` is `[n, kv_heads * head_dim]` u32, every column of row `i` holding row `i`'s
    /// slot (the scatter's index shape).
    pub fn store(&self, layer: usize, k: &Tensor, v: &Tensor, index: &Tensor) -> Result<()> {
        let (keys, values) = self.layer(layer)?;
        keys.scatter_set(index, &k.contiguous()?, 0)?;
        values.scatter_set(index, &v.contiguous()?, 0)
    }

    /// The pools of `layer` as `[slots, kv_heads, head_dim]` (views, no copy).
    pub fn pools(&self, layer: usize) -> Result<(Tensor, Tensor)> {
        let (keys, values) = self.layer(layer)?;
        let shape = (keys.dim(0)?, self.kv_heads, self.head_dim);
        Ok((keys.reshape(shape)?, values.reshape(shape)?))
    }

    /// Keys and values of `slots` (u32 `[t]`) of `layer`, `[t, kv_heads, head_dim]` each.
    pub fn gather(&self, layer: usize, slots: &Tensor) -> Result<(Tensor, Tensor)> {
        let (keys, values) = self.pools(layer)?;
        Ok((keys.index_select(slots, 0)?, values.index_select(slots, 0)?))
    }

    fn layer(&self, layer: usize) -> Result<(&Tensor, &Tensor)> {
        match (self.keys.get(layer), self.values.get(layer)) {
            (Some(k), Some(v)) => Ok((k, v)),
            _ => candle_core::bail!("layer {layer} is outside the KV cache"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> ModelConfig {
        let json = r#"{"model_type": "mixtral", "num_hidden_layers": 2, "hidden_size": 16,
            "intermediate_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 10}"#;
        ModelConfig::from_json(json, std::path::Path::new("config.json")).unwrap()
    }

    #[test]
    fn stored_rows_come_back_from_their_slots_in_any_block_order() {
        let cfg = config();
        let capacity = KvCapacity {
            block_size: 3,
            num_blocks: 8,
        };
        let dev = Device::Cpu;
        let cache = DeviceKvCache::new(&cfg, capacity, &dev).unwrap();
        let row = cfg.kv_dim();
        let table = [7u32, 2, 5];
        let positions: Vec<usize> = (0..8).collect();
        let slots: Vec<u32> = positions
            .iter()
            .map(|&p| slot(capacity, &table, p).unwrap())
            .collect();
        assert_eq!(&slots[..4], &[21, 22, 23, 6]);
        let k: Vec<f32> = (0..8 * row).map(|i| i as f32).collect();
        let v: Vec<f32> = k.iter().map(|x| -x).collect();
        let kt = Tensor::from_vec(k.clone(), (8, row), &dev).unwrap();
        let vt = Tensor::from_vec(v.clone(), (8, row), &dev).unwrap();
        let index = Tensor::from_vec(slots.clone(), (8, 1), &dev)
            .unwrap()
            .broadcast_as((8, row))
            .unwrap()
            .contiguous()
            .unwrap();
        cache.store(1, &kt, &vt, &index).unwrap();
        let sl = Tensor::from_vec(slots, 8, &dev).unwrap();
        let (gk, gv) = cache.gather(1, &sl).unwrap();
        assert_eq!(gk.flatten_all().unwrap().to_vec1::<f32>().unwrap(), k);
        assert_eq!(gv.flatten_all().unwrap().to_vec1::<f32>().unwrap(), v);
        // Layer 0 was not written.
        let (g0, _) = cache.gather(0, &sl).unwrap();
        assert!(
            g0.flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .all(|&x| x == 0.0)
        );
        assert!(slot(capacity, &table, 9).is_none(), "past the table");
        assert!(slot(capacity, &[9], 0).is_none(), "a block the cache lacks");
    }

    #[test]
    fn a_fixed_budget_needs_no_gpu_and_a_fraction_needs_one() {
        let fixed = KvCacheConfig {
            block_size: 16,
            memory_bytes: 1 << 20,
            gpu_memory_utilization: None,
        };
        assert_eq!(budget(&fixed, &Device::Cpu).unwrap(), 1 << 20);
        let fraction = KvCacheConfig {
            gpu_memory_utilization: Some(0.9),
            ..fixed
        };
        let err = budget(&fraction, &Device::Cpu).unwrap_err().to_string();
        assert!(err.contains("--kv-cache-memory"), "{err}");
        let bad = KvCacheConfig {
            gpu_memory_utilization: Some(1.5),
            ..fixed
        };
        assert!(budget(&bad, &Device::Cpu).is_err());
    }
}
