//! The paged KV cache: per layer, one key and one value buffer of `num_blocks * block_size`
//! token slots. The router allocates blocks; each step hands the node every scheduled
//! sequence's block table, and [`PagedStep`] implements the model crate's [`KvCache`] trait
//! over those tables, so the attention math is the reference's. A sequence's history is read
//! in place, one run per block.
//!
//! This is the host path's cache (host memory, read by afd's CPU kernels); the device path keeps
//! the same geometry in device memory ([`crate::device::kv`]), read by its paged-attention op.

use std::collections::HashMap;
use std::ops::Range;

use model::ModelConfig;
use model::forward::attention::{KvCache, KvRun, SeqId};

use step::KvCapacity;

/// How much KV memory a node has and how it is cut into blocks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvCacheConfig {
    /// Tokens per block (vLLM's `block_size`).
    pub block_size: usize,
    /// Bytes for keys and values of every layer together.
    pub memory_bytes: usize,
    /// On a GPU: size the cache to this fraction of the device's memory less what is in use
    /// (vLLM's `gpu_memory_utilization`) instead of `memory_bytes`.
    pub gpu_memory_utilization: Option<f64>,
}

impl Default for KvCacheConfig {
    fn default() -> Self {
        KvCacheConfig {
            block_size: 16,
            memory_bytes: 512 << 20,
            gpu_memory_utilization: None,
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
    /// Floats per slot (`kv_heads * head_dim`).
    row: usize,
    /// Per layer: `[num_blocks * block_size, kv_heads * head_dim]`.
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
}

impl PagedKvCache {
    /// Allocates the cache (zeroed pages are only touched when first written).
    pub fn new(model: &ModelConfig, capacity: KvCapacity) -> Self {
        let row = model.kv_dim();
        let floats = capacity.num_blocks * capacity.block_size * row;
        let layers = model.num_layers();
        PagedKvCache {
            capacity,
            row,
            keys: (0..layers).map(|_| vec![0f32; floats]).collect(),
            values: (0..layers).map(|_| vec![0f32; floats]).collect(),
        }
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

    /// Slot index of position `p` under `table`, if the table reaches that far and names a
    /// block that exists.
    fn slot(&self, table: &[u32], p: usize) -> Option<usize> {
        let bs = self.capacity.block_size;
        let block = *table.get(p / bs)? as usize;
        (block < self.capacity.num_blocks).then_some(block * bs + p % bs)
    }
}

/// The paged cache seen through one step's block tables.
#[derive(Debug)]
pub struct PagedStep<'a> {
    cache: &'a mut PagedKvCache,
    tables: &'a HashMap<SeqId, (&'a [u32], usize)>,
}

impl<'a> PagedStep<'a> {
    /// The block table of `seq` and the tokens it held before this step.
    fn table(&self, seq: SeqId) -> model::Result<(&'a [u32], usize)> {
        let tables: &'a HashMap<SeqId, (&'a [u32], usize)> = self.tables;
        tables.get(&seq).copied().ok_or_else(|| {
            model::Error::InvalidInput(format!("sequence {seq} has no block table this step"))
        })
    }

    /// The slot of position `p` of `seq`, or an error naming what is missing.
    fn slot(&self, seq: SeqId, table: &[u32], p: usize) -> model::Result<usize> {
        self.cache.slot(table, p).ok_or_else(|| {
            model::Error::InvalidInput(format!(
                "position {p} of sequence {seq} is outside its block table ({} blocks of {})",
                table.len(),
                self.cache.capacity.block_size
            ))
        })
    }
}

impl KvCache for PagedStep<'_> {
    fn store(
        &mut self,
        layer: usize,
        seq: SeqId,
        past: usize,
        k: &[f32],
        v: &[f32],
    ) -> model::Result<()> {
        let (table, start) = self.table(seq)?;
        let row = self.cache.row;
        if start != past
            || k.len() != v.len()
            || !k.len().is_multiple_of(row)
            || layer >= self.cache.keys.len()
        {
            return Err(model::Error::InvalidInput(format!(
                "sequence {seq} at layer {layer}: {start} tokens cached, {past} expected, \
                 {} key and {} value floats for rows of {row}",
                k.len(),
                v.len()
            )));
        }
        for (i, (kr, vr)) in k.chunks_exact(row).zip(v.chunks_exact(row)).enumerate() {
            let at = self.slot(seq, table, past + i)? * row;
            self.cache.keys[layer][at..at + row].copy_from_slice(kr);
            self.cache.values[layer][at..at + row].copy_from_slice(vr);
        }
        Ok(())
    }

    fn history<'s>(
        &'s self,
        layer: usize,
        seq: SeqId,
        positions: Range<usize>,
        out: &mut Vec<KvRun<'s>>,
    ) -> model::Result<()> {
        let (table, _) = self.table(seq)?;
        let (bs, row) = (self.cache.capacity.block_size, self.cache.row);
        let (keys, values) = match (self.cache.keys.get(layer), self.cache.values.get(layer)) {
            (Some(k), Some(v)) => (k, v),
            _ => {
                return Err(model::Error::InvalidInput(format!(
                    "layer {layer} is outside the KV cache"
                )));
            }
        };
        let mut p = positions.start;
        while p < positions.end {
            let run = (bs - p % bs).min(positions.end - p);
            let at = self.slot(seq, table, p)? * row;
            let span = at..at + run * row;
            out.push(KvRun {
                keys: &keys[span.clone()],
                values: &values[span],
            });
            p += run;
        }
        Ok(())
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

    /// Reads a cache's whole history of `seq` at layer 1 as (keys, values).
    fn read(cache: &dyn KvCache, seq: SeqId, len: usize) -> (Vec<f32>, Vec<f32>) {
        let mut runs = Vec::new();
        cache.history(1, seq, 0..len, &mut runs).unwrap();
        let k = runs.iter().flat_map(|r| r.keys.iter().copied()).collect();
        let v = runs.iter().flat_map(|r| r.values.iter().copied()).collect();
        (k, v)
    }

    #[test]
    fn paged_history_equals_contiguous_history() {
        let cfg = config();
        let capacity = KvCacheConfig {
            block_size: 3,
            memory_bytes: 1 << 20,
            gpu_memory_utilization: None,
        }
        .capacity(&cfg);
        let mut paged = PagedKvCache::new(&cfg, capacity);
        let mut contiguous = model::forward::attention::ContiguousKvCache::new(cfg.kv_dim());
        // Scattered, out-of-order blocks.
        let table = [7u32, 2, 5, 0];
        let mut start = 0;
        for (step, t) in [4usize, 1, 3, 2].into_iter().enumerate() {
            let k: Vec<f32> = (0..t * 8).map(|i| (step * 100 + i) as f32).collect();
            let v: Vec<f32> = k.iter().map(|x| x * 2.0).collect();
            let tables = HashMap::from([(9u64, (&table[..], start))]);
            let mut view = paged.step(&tables);
            view.store(1, 9, start, &k, &v).unwrap();
            contiguous.store(1, 9, start, &k, &v).unwrap();
            start += t;
            assert_eq!(read(&view, 9, start), read(&contiguous, 9, start));
        }
    }

    #[test]
    fn positions_outside_the_block_table_are_errors() {
        let cfg = config();
        let capacity = KvCacheConfig {
            block_size: 2,
            memory_bytes: 1 << 12,
            gpu_memory_utilization: None,
        }
        .capacity(&cfg);
        let mut paged = PagedKvCache::new(&cfg, capacity);
        let table = [0u32];
        let tables = HashMap::from([(1u64, (&table[..], 0))]);
        let mut view = paged.step(&tables);
        let rows = vec![1f32; 3 * 8];
        // Three positions need two blocks; the table has one.
        assert!(view.store(0, 1, 0, &rows, &rows).is_err());
        // A past that disagrees with the table is refused.
        assert!(view.store(0, 1, 1, &rows[..8], &rows[..8]).is_err());
        // An unknown sequence is refused.
        assert!(view.store(0, 2, 0, &rows[..8], &rows[..8]).is_err());
        let bad = [u32::MAX];
        let tables = HashMap::from([(1u64, (&bad[..], 0))]);
        assert!(
            paged
                .step(&tables)
                .store(0, 1, 0, &rows[..8], &rows[..8])
                .is_err()
        );
    }

    #[test]
    fn capacity_follows_the_memory_budget() {
        let cfg = config();
        // 2 layers * 2 (k, v) * 8 floats * 4 bytes = 128 bytes per token.
        assert_eq!(KvCacheConfig::bytes_per_token(&cfg), 128);
        let c = KvCacheConfig {
            block_size: 4,
            memory_bytes: 128 * 4 * 10,
            gpu_memory_utilization: None,
        }
        .capacity(&cfg);
        assert_eq!((c.block_size, c.num_blocks), (4, 10));
    }
}
