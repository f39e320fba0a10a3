//! KV-block accounting: which physical blocks of a node's cache are free.
//!
//! The router owns allocation (as vLLM's `KVCacheManager` does); the node only stores keys and
//! values in the blocks it is told to use. Blocks are handed out lowest id first from a free list
//! and returned as a sequence finishes, is aborted or is preempted.

use std::collections::BTreeSet;

/// Free-block accounting for one attention node's KV cache.
#[derive(Debug, Clone)]
pub struct BlockManager {
    block_size: usize,
    num_blocks: usize,
    /// Free block ids; a set so that a double free is detected instead of corrupting the list.
    free: BTreeSet<u32>,
}

impl BlockManager {
    /// A cache of `num_blocks` blocks of `block_size` tokens, all free.
    pub fn new(block_size: usize, num_blocks: usize) -> Self {
        BlockManager {
            block_size: block_size.max(1),
            num_blocks,
            free: (0..num_blocks as u32).collect(),
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the cache.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Blocks not held by any sequence.
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Blocks held by sequences.
    pub fn num_used(&self) -> usize {
        self.num_blocks - self.free.len()
    }

    /// Fraction of blocks in use, 0 to 1 (vLLM's `kv_cache_usage_perc`).
    pub fn usage(&self) -> f64 {
        if self.num_blocks == 0 {
            0.0
        } else {
            self.num_used() as f64 / self.num_blocks as f64
        }
    }

    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Grows `table` so that it holds `tokens` tokens. Returns false, and changes nothing, when
    /// there are not enough free blocks.
    pub fn grow_to(&mut self, table: &mut Vec<u32>, tokens: usize) -> bool {
        let need = self.blocks_for(tokens).saturating_sub(table.len());
        if need > self.free.len() {
            return false;
        }
        for _ in 0..need {
            match self.free.pop_first() {
                Some(block) => table.push(block),
                None => return false, // unreachable: checked above
            }
        }
        true
    }

    /// Returns every block of `table` to the free list and empties it.
    ///
    /// A block that is already free or out of range is a bug in the caller; it is reported
    /// (debug builds panic) and skipped so that the free list stays consistent.
    pub fn release(&mut self, table: &mut Vec<u32>) {
        for block in table.drain(..) {
            let known = (block as usize) < self.num_blocks;
            let inserted = known && self.free.insert(block);
            if !inserted {
                debug_assert!(false, "block {block} released twice or out of range");
                tracing::error!(block, "KV block released twice or out of range");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_and_releases() {
        let mut m = BlockManager::new(4, 3);
        let mut t = Vec::new();
        assert!(m.grow_to(&mut t, 5));
        assert_eq!(t, vec![0, 1]);
        assert_eq!(m.num_free(), 1);
        assert!(m.grow_to(&mut t, 8), "8 tokens still fit in two blocks");
        assert_eq!(t.len(), 2);
        assert!(
            !m.grow_to(&mut t, 13),
            "13 tokens need 4 blocks, only 3 exist"
        );
        assert_eq!(t.len(), 2, "a failed grow changes nothing");
        m.release(&mut t);
        assert!(t.is_empty());
        assert_eq!(m.num_free(), 3);
        assert!((m.usage() - 0.0).abs() < 1e-12);
    }

    #[test]
    fn block_size_is_the_one_given() {
        assert_eq!(BlockManager::new(4, 3).block_size(), 4);
        assert_eq!(BlockManager::new(16, 3).blocks_for(17), 2);
    }

    #[test]
    fn usage_is_the_fraction_of_blocks_held() {
        let mut m = BlockManager::new(4, 4);
        assert_eq!(m.usage(), 0.0);
        let mut t = Vec::new();
        assert!(m.grow_to(&mut t, 5));
        assert_eq!(m.usage(), 0.5, "2 of 4 blocks");
        let mut u = Vec::new();
        assert!(m.grow_to(&mut u, 3));
        assert_eq!(m.usage(), 0.75, "3 of 4 blocks");
        assert!(m.grow_to(&mut u, 8));
        assert_eq!(m.usage(), 1.0, "all 4 blocks");
        assert_eq!(
            BlockManager::new(4, 0).usage(),
            0.0,
            "an empty cache is not in use"
        );
    }

    #[test]
    fn grow_to_can_take_the_last_free_blocks() {
        let mut m = BlockManager::new(4, 3);
        let mut t = Vec::new();
        assert!(m.grow_to(&mut t, 12), "12 tokens need exactly the 3 blocks");
        assert_eq!(t, vec![0, 1, 2]);
        assert_eq!(m.num_free(), 0);
        let mut u = Vec::new();
        assert!(!m.grow_to(&mut u, 1), "none left");
        m.release(&mut t);
        assert!(m.grow_to(&mut u, 4), "one block needed, three free");
        assert!(m.grow_to(&mut t, 8), "two blocks needed, exactly two free");
        assert_eq!(m.num_free(), 0);
    }

    #[test]
    fn release_rejects_the_block_id_just_past_the_cache() {
        let mut m = BlockManager::new(4, 3);
        let mut t = vec![3];
        let released = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            m.release(&mut t);
        }));
        assert_eq!(
            released.is_err(),
            cfg!(debug_assertions),
            "block 3 of a 3-block cache is out of range: a bug, reported (debug builds panic)"
        );
        assert_eq!(
            m.num_free(),
            3,
            "the out-of-range block is not added to the free list"
        );
        let mut u = Vec::new();
        assert!(!m.grow_to(&mut u, 13), "still only 3 blocks to hand out");
        assert!(m.grow_to(&mut u, 12));
        assert_eq!(u, vec![0, 1, 2]);
    }
}
