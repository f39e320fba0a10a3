//! Where attention keeps keys and values: the [`KvCache`] trait and the reference's
//! [`ContiguousKvCache`].
//!
//! Keys and values are host `f32` rows (`[kv_heads * head_dim]` per position). A cache hands
//! a sequence's history back as runs of consecutive positions that are contiguous in its
//! memory, so attention reads them in place: no gather, no tensor per sequence. A paged cache
//! gives one run per block, the contiguous cache one run in all.

use std::collections::HashMap;
use std::ops::Range;

use crate::error::{Error, Result};

/// Identifies a sequence across steps.
pub type SeqId = u64;

/// Keys and values of consecutive positions, each `[positions, kv_heads * head_dim]` row-major.
#[derive(Debug, Clone, Copy)]
pub struct KvRun<'a> {
    /// Key rows.
    pub keys: &'a [f32],
    /// Value rows, the same positions as `keys`.
    pub values: &'a [f32],
}

/// Storage of keys and values per (layer, sequence). `Sync`, so that the sequences of a batch
/// can read their histories side by side.
pub trait KvCache: Sync {
    /// Stores the rows `k` and `v` (`[t, kv_heads * head_dim]`) of `seq` at `layer` for
    /// positions `past..past + t`. `past` must equal what the cache already holds for `seq`.
    fn store(&mut self, layer: usize, seq: SeqId, past: usize, k: &[f32], v: &[f32]) -> Result<()>;

    /// Appends to `out` the keys and values of `seq` at `layer` for `positions`, in order, as
    /// runs of consecutive positions. Every position must have been stored.
    fn history<'s>(
        &'s self,
        layer: usize,
        seq: SeqId,
        positions: Range<usize>,
        out: &mut Vec<KvRun<'s>>,
    ) -> Result<()>;
}

/// A KV cache that keeps one growing pair of row buffers per (layer, sequence).
#[derive(Debug)]
pub struct ContiguousKvCache {
    entries: HashMap<(usize, SeqId), (Vec<f32>, Vec<f32>)>,
    /// Floats per position (`kv_heads * head_dim`).
    row: usize,
}

impl ContiguousKvCache {
    /// An empty cache for positions of `row` floats (`kv_heads * head_dim`).
    pub fn new(row: usize) -> Self {
        ContiguousKvCache {
            entries: HashMap::new(),
            row,
        }
    }

    /// Drops everything cached for `seq`.
    pub fn free(&mut self, seq: SeqId) {
        self.entries.retain(|(_, s), _| *s != seq);
    }

    /// Tokens cached for `seq` (0 if unknown).
    pub fn len(&self, seq: SeqId) -> usize {
        match self.entries.get(&(0, seq)) {
            Some((k, _)) if self.row > 0 => k.len() / self.row,
            _ => 0,
        }
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

impl KvCache for ContiguousKvCache {
    fn store(&mut self, layer: usize, seq: SeqId, past: usize, k: &[f32], v: &[f32]) -> Result<()> {
        if k.len() != v.len() || self.row == 0 || !k.len().is_multiple_of(self.row) {
            return Err(Error::InvalidInput(format!(
                "keys ({}) and values ({}) of sequence {seq} are not whole rows of {}",
                k.len(),
                v.len(),
                self.row
            )));
        }
        let (keys, values) = self.entries.entry((layer, seq)).or_default();
        let held = keys.len().checked_div(self.row).unwrap_or(0);
        if held != past {
            return Err(Error::InvalidInput(format!(
                "sequence {seq} has {held} cached tokens at layer {layer}, expected {past}"
            )));
        }
        keys.extend_from_slice(k);
        values.extend_from_slice(v);
        Ok(())
    }

    fn history<'s>(
        &'s self,
        layer: usize,
        seq: SeqId,
        positions: Range<usize>,
        out: &mut Vec<KvRun<'s>>,
    ) -> Result<()> {
        if positions.is_empty() {
            return Ok(());
        }
        let (keys, values) = self
            .entries
            .get(&(layer, seq))
            .filter(|(k, _)| self.row > 0 && k.len() / self.row >= positions.end)
            .ok_or_else(|| {
                Error::InvalidInput(format!(
                    "sequence {seq} has fewer than {} cached tokens at layer {layer}",
                    positions.end
                ))
            })?;
        let span = positions.start * self.row..positions.end * self.row;
        out.push(KvRun {
            keys: &keys[span.clone()],
            values: &values[span],
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn history_returns_what_was_stored_in_order() {
        let mut c = ContiguousKvCache::new(2);
        c.store(0, 7, 0, &[1.0, 2.0, 3.0, 4.0], &[5.0, 6.0, 7.0, 8.0])
            .unwrap();
        c.store(0, 7, 2, &[9.0, 10.0], &[11.0, 12.0]).unwrap();
        assert_eq!(c.len(7), 3);
        let mut runs = Vec::new();
        c.history(0, 7, 1..3, &mut runs).unwrap();
        assert_eq!(runs.len(), 1);
        assert_eq!(runs[0].keys, &[3.0, 4.0, 9.0, 10.0]);
        assert_eq!(runs[0].values, &[7.0, 8.0, 11.0, 12.0]);
    }

    #[test]
    fn a_gap_or_a_missing_position_is_an_error() {
        let mut c = ContiguousKvCache::new(2);
        c.store(0, 1, 0, &[1.0, 2.0], &[1.0, 2.0]).unwrap();
        assert!(c.store(0, 1, 2, &[1.0, 2.0], &[1.0, 2.0]).is_err());
        assert!(c.store(0, 1, 1, &[1.0], &[1.0]).is_err());
        let mut runs = Vec::new();
        assert!(c.history(0, 1, 0..2, &mut runs).is_err());
        assert!(c.history(1, 1, 0..1, &mut runs).is_err());
        c.free(1);
        assert!(c.is_empty());
    }
}
