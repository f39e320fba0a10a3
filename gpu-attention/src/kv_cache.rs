//! The paged KV cache: per layer, one key and one value tensor of `num_blocks * block_size`
//! token slots on the node's candle `Device`. The router allocates blocks; each step hands the
//! node every scheduled sequence's block table, and [`PagedStep`] implements the model crate's
//! [`KvCache`] trait over those tables, so the attention math is the reference's.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use model::ModelConfig;
use model::forward::attention::{KvCache, SeqId};

use crate::step::KvCapacity;

/// How much KV memory a node has and how it is cut into blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvCacheConfig {
    /// Tokens per block (vLLM's `block_size`).
    pub block_size: usize,
    /// Bytes for keys and values of every layer together.
    pub memory_bytes: usize,
}

impl Default for KvCacheConfig {
    fn default() -> Self {
        KvCacheConfig {
            block_size: 16,
            memory_bytes: 512 << 20,
        }
    }
}

impl KvCacheConfig {
    /// Bytes one token takes in every layer (keys and values, f32).
    pub fn bytes_per_token(model: &ModelConfig) -> usize {
        model.num_layers() * 2 * model.kv_dim() * 4
    }

    /// The geometry this budget gives for `model` (at least one block).
    pub fn capacity(&self, model: &ModelConfig) -> KvCapacity {
        let per_block = Self::bytes_per_token(model) * self.block_size;
        KvCapacity {
            block_size: self.block_size,
            num_blocks: (self.memory_bytes / per_block.max(1)).max(1),
        }
    }
}

/// Keys and values of every layer, in fixed-size blocks of token slots.
#[derive(Debug)]
pub struct PagedKvCache {
    capacity: KvCapacity,
    kv_heads: usize,
    head_dim: usize,
    /// Per layer: `[num_blocks * block_size, kv_heads, head_dim]`.
    keys: Vec<Tensor>,
    values: Vec<Tensor>,
}

impl PagedKvCache {
    /// Allocates the cache on `device`.
    pub fn new(
        model: &ModelConfig,
        capacity: KvCapacity,
        device: &Device,
    ) -> candle_core::Result<Self> {
        let slots = capacity.num_blocks * capacity.block_size;
        let shape = (slots, model.num_kv_heads, model.head_dim);
        let mut keys = Vec::with_capacity(model.num_layers());
        let mut values = Vec::with_capacity(model.num_layers());
        for _ in 0..model.num_layers() {
            keys.push(Tensor::zeros(shape, DType::F32, device)?);
            values.push(Tensor::zeros(shape, DType::F32, device)?);
        }
        Ok(PagedKvCache {
            capacity,
            kv_heads: model.num_kv_heads,
            head_dim: model.head_dim,
            keys,
            values,
        })
    }

    /// The geometry.
    pub fn capacity(&self) -> KvCapacity {
        self.capacity
    }

    /// A view for one step: sequence -> (block table, tokens cached before this step).
    pub fn step<'a>(&'a mut self, tables: &'a HashMap<SeqId, (&'a [u32], usize)>) -> PagedStep<'a> {
        PagedStep {
            cache: self,
            tables,
        }
    }

    /// Slot index of position `p` under `table`.
    fn slot(&self, table: &[u32], p: usize) -> usize {
        let bs = self.capacity.block_size;
        table[p / bs] as usize * bs + p % bs
    }
}

/// The paged cache seen through one step's block tables.
#[derive(Debug)]
pub struct PagedStep<'a> {
    cache: &'a mut PagedKvCache,
    tables: &'a HashMap<SeqId, (&'a [u32], usize)>,
}

impl KvCache for PagedStep<'_> {
    fn append(
        &mut self,
        layer: usize,
        seq: SeqId,
        k: &Tensor,
        v: &Tensor,
    ) -> model::Result<(Tensor, Tensor)> {
        let (table, start) = *self.tables.get(&seq).ok_or_else(|| {
            model::Error::InvalidInput(format!("sequence {seq} has no block table this step"))
        })?;
        let (_, t, _) = k.dims3()?;
        let c = &*self.cache;
        let bs = c.capacity.block_size;
        let k_rows = k.transpose(0, 1)?.contiguous()?;
        let v_rows = v.transpose(0, 1)?.contiguous()?;
        // Write runs of consecutive positions that share a block in one slice_set each.
        let mut i = 0;
        while i < t {
            let p = start + i;
            let run = (bs - p % bs).min(t - i);
            let slot = c.slot(table, p);
            c.keys[layer].slice_set(&k_rows.narrow(0, i, run)?, 0, slot)?;
            c.values[layer].slice_set(&v_rows.narrow(0, i, run)?, 0, slot)?;
            i += run;
        }
        let total = start + t;
        let slots: Vec<u32> = (0..total).map(|p| c.slot(table, p) as u32).collect();
        let index = Tensor::from_vec(slots, total, c.keys[layer].device())?;
        let gather = |cache: &Tensor| -> candle_core::Result<Tensor> {
            cache
                .index_select(&index, 0)?
                .reshape((total, c.kv_heads, c.head_dim))?
                .transpose(0, 1)?
                .contiguous()
        };
        Ok((gather(&c.keys[layer])?, gather(&c.values[layer])?))
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
    fn paged_history_equals_contiguous_history() {
        let cfg = config();
        let dev = Device::Cpu;
        let capacity = KvCacheConfig {
            block_size: 3,
            memory_bytes: 1 << 20,
        }
        .capacity(&cfg);
        let mut paged = PagedKvCache::new(&cfg, capacity, &dev).unwrap();
        let mut contiguous = model::forward::attention::ContiguousKvCache::new();
        // Scattered, out-of-order blocks.
        let table = [7u32, 2, 5, 0];
        let mut start = 0;
        for (step, t) in [4usize, 1, 3, 2].into_iter().enumerate() {
            let k = Tensor::arange((step * 100) as f32, (step * 100 + t * 8) as f32, &dev)
                .unwrap()
                .reshape((1, t, 8))
                .unwrap();
            let v = (&k * 2.0).unwrap();
            let tables = HashMap::from([(9u64, (&table[..], start))]);
            let (pk, pv) = paged.step(&tables).append(1, 9, &k, &v).unwrap();
            let (ck, cv) = contiguous.append(1, 9, &k, &v).unwrap();
            assert_eq!(pk.to_vec3::<f32>().unwrap(), ck.to_vec3::<f32>().unwrap());
            assert_eq!(pv.to_vec3::<f32>().unwrap(), cv.to_vec3::<f32>().unwrap());
            start += t;
        }
    }

    #[test]
    fn capacity_follows_the_memory_budget() {
        let cfg = config();
        // 2 layers * 2 (k, v) * 8 floats * 4 bytes = 128 bytes per token.
        assert_eq!(KvCacheConfig::bytes_per_token(&cfg), 128);
        let c = KvCacheConfig {
            block_size: 4,
            memory_bytes: 128 * 4 * 10,
        }
        .capacity(&cfg);
        assert_eq!((c.block_size, c.num_blocks), (4, 10));
    }
}
