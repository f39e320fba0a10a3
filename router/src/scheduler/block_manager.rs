//! KV-block accounting, and the prefix cache over it: which physical blocks of a node's cache
//! are free, which hold a prefix another sequence may reuse, and who holds each.
//!
//! The router owns allocation (as vLLM's `KVCacheManager` does); the node only stores keys and
//! values in the blocks it is told to use. A block is held by a count of sequences. With prefix
//! caching on, every full block a sequence computed is registered under a hash of its tokens
//! and of everything before it (the parent block's hash), so a later sequence whose prompt
//! starts with the same tokens takes those blocks instead of computing them again. Only full
//! blocks are shared, and a full block is never written again, so a shared block is read-only.
//!
//! A block no sequence holds is free. Free blocks that hold nothing reusable are handed out
//! first, lowest id first; then the cached ones, least recently released first (a sequence's
//! blocks are released last block first, so a chain loses its tail before its root). Taking a
//! cached block for new tokens evicts its entry.
//!
//! The hash is SipHash with keys drawn per process, so nobody can craft two prompts whose
//! blocks collide; a hit also compares the block's tokens, so a chance collision of two
//! blocks' hashes cannot make one sequence read another's keys and values.

use std::collections::hash_map::RandomState;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::BuildHasher;

/// The hash of a full block: its tokens and every token before it.
pub type BlockHash = u64;

/// What a cached block holds.
#[derive(Debug, Clone)]
struct CachedBlock {
    hash: BlockHash,
    tokens: Box<[u32]>,
    /// The tick at which the last holder released it, while no sequence holds it.
    released_at: Option<u64>,
}

/// Block accounting and the prefix cache of one attention node's KV cache.
#[derive(Debug, Clone)]
pub struct BlockManager {
    block_size: usize,
    num_blocks: usize,
    prefix_caching: bool,
    /// Sequences holding each block.
    refs: Vec<u32>,
    /// Free blocks that hold no cached prefix, handed out first, lowest id first.
    empty: BTreeSet<u32>,
    /// Free blocks that hold a cached prefix, by release tick (least recently released first).
    evictable: BTreeMap<u64, u32>,
    /// The cached prefix block each block holds, if any.
    entries: Vec<Option<CachedBlock>>,
    by_hash: HashMap<BlockHash, u32>,
    hasher: RandomState,
    tick: u64,
    evictions: u64,
}

impl BlockManager {
    /// A cache of `num_blocks` blocks of `block_size` tokens, all free, without prefix caching.
    pub fn new(block_size: usize, num_blocks: usize) -> Self {
        BlockManager {
            block_size: block_size.max(1),
            num_blocks,
            prefix_caching: false,
            refs: vec![0; num_blocks],
            empty: (0..num_blocks as u32).collect(),
            evictable: BTreeMap::new(),
            entries: vec![None; num_blocks],
            by_hash: HashMap::new(),
            hasher: RandomState::new(),
            tick: 0,
            evictions: 0,
        }
    }

    /// The same cache, with prefix caching on or off.
    pub fn with_prefix_caching(mut self, on: bool) -> Self {
        self.prefix_caching = on;
        if !on {
            self.reset_prefix_cache();
        }
        self
    }

    /// Whether full blocks are registered and shared.
    pub fn prefix_caching(&self) -> bool {
        self.prefix_caching
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the cache.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Blocks no sequence holds (cached ones included: they are evicted when needed).
    pub fn num_free(&self) -> usize {
        self.empty.len() + self.evictable.len()
    }

    /// Blocks held by sequences.
    pub fn num_used(&self) -> usize {
        self.num_blocks - self.num_free()
    }

    /// Blocks registered in the prefix cache, held or free.
    pub fn num_cached(&self) -> usize {
        self.by_hash.len()
    }

    /// Cached blocks taken for new tokens so far.
    pub fn num_evictions(&self) -> u64 {
        self.evictions
    }

    /// Sequences holding `block` (0 for a free or unknown block).
    pub fn holders(&self, block: u32) -> u32 {
        self.refs.get(block as usize).copied().unwrap_or(0)
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
        if need > self.num_free() {
            return false;
        }
        for _ in 0..need {
            match self.take_free() {
                Some(block) => table.push(block),
                None => return false, // unreachable: checked above
            }
        }
        true
    }

    /// Releases every block of `table` (last first) and empties it. A block no other sequence
    /// holds becomes free; if it is cached it stays findable until it is evicted.
    ///
    /// A block that is already free or out of range is a bug in the caller; it is reported
    /// (debug builds panic) and skipped so that the accounting stays consistent.
    pub fn release(&mut self, table: &mut Vec<u32>) {
        for block in table.drain(..).rev() {
            let held = self.refs.get(block as usize).is_some_and(|&r| r > 0);
            if !held {
                debug_assert!(false, "block {block} released twice or out of range");
                tracing::error!(block, "KV block released twice or out of range");
                continue;
            }
            let b = block as usize;
            self.refs[b] -= 1;
            if self.refs[b] > 0 {
                continue;
            }
            match &mut self.entries[b] {
                Some(entry) => {
                    entry.released_at = Some(self.tick);
                    self.evictable.insert(self.tick, block);
                    self.tick += 1;
                }
                None => {
                    self.empty.insert(block);
                }
            }
        }
    }

    /// The hash of a full block of `tokens` after the block whose hash is `parent` (`None`
    /// for the first block of a sequence).
    pub fn hash_block(&self, parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
        self.hasher.hash_one((parent, tokens))
    }

    /// The cached blocks that hold the longest run of full blocks at the start of `tokens`,
    /// with their hashes, in order. Nothing is taken: see [`BlockManager::share`].
    pub fn find_cached_prefix(&self, tokens: &[u32]) -> Vec<(u32, BlockHash)> {
        let mut hits = Vec::new();
        if !self.prefix_caching {
            return hits;
        }
        let mut parent = None;
        for chunk in tokens.chunks_exact(self.block_size) {
            let hash = self.hash_block(parent, chunk);
            let Some(&block) = self.by_hash.get(&hash) else {
                break;
            };
            let same = self.entries[block as usize]
                .as_ref()
                .is_some_and(|e| *e.tokens == *chunk);
            if !same {
                break;
            }
            hits.push((block, hash));
            parent = Some(hash);
        }
        hits
    }

    /// Appends cached blocks (from [`BlockManager::find_cached_prefix`]) to `table`, held by
    /// one more sequence each.
    pub fn share(&mut self, table: &mut Vec<u32>, hits: &[(u32, BlockHash)]) {
        for &(block, _) in hits {
            let b = block as usize;
            if self.refs[b] == 0
                && let Some(tick) = self.entries[b].as_mut().and_then(|e| e.released_at.take())
            {
                self.evictable.remove(&tick);
            }
            self.refs[b] += 1;
            table.push(block);
        }
    }

    /// Registers the full blocks of a sequence whose first `computed.len()` tokens are in the
    /// node's cache through `table`; `hashes` holds the hashes of the blocks registered before
    /// and is extended. A block whose prefix another block already holds stays unregistered
    /// (two sequences computed the same prefix at once): the first one is what later hits get.
    pub fn cache_full_blocks(
        &mut self,
        table: &[u32],
        computed: &[u32],
        hashes: &mut Vec<BlockHash>,
    ) {
        if !self.prefix_caching {
            return;
        }
        let full = (computed.len() / self.block_size).min(table.len());
        for i in hashes.len()..full {
            let chunk = &computed[i * self.block_size..(i + 1) * self.block_size];
            let hash = self.hash_block(hashes.last().copied(), chunk);
            hashes.push(hash);
            let block = table[i];
            if self.by_hash.contains_key(&hash) || self.entries[block as usize].is_some() {
                continue;
            }
            self.by_hash.insert(hash, block);
            self.entries[block as usize] = Some(CachedBlock {
                hash,
                tokens: chunk.into(),
                released_at: None,
            });
        }
    }

    /// Forgets every cached prefix (the node's cache can no longer be trusted, for example
    /// after a failed step): free cached blocks become empty, held ones stay held.
    pub fn reset_prefix_cache(&mut self) {
        for (_, block) in std::mem::take(&mut self.evictable) {
            self.empty.insert(block);
        }
        self.by_hash.clear();
        for entry in &mut self.entries {
            *entry = None;
        }
    }

    /// A free block for new tokens: an empty one if any, else the least recently released
    /// cached one, whose entry is evicted.
    fn take_free(&mut self) -> Option<u32> {
        let block = match self.empty.pop_first() {
            Some(block) => block,
            None => {
                let (_, block) = self.evictable.pop_first()?;
                if let Some(entry) = self.entries[block as usize].take()
                    && self.by_hash.get(&entry.hash) == Some(&block)
                {
                    self.by_hash.remove(&entry.hash);
                }
                self.evictions += 1;
                block
            }
        };
        self.refs[block as usize] = 1;
        Some(block)
    }
}

#[cfg(test)]
mod tests;
