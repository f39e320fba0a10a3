//! What a node that shares KV blocks between sequences checks of a prefix-cache hit.
//!
//! The router decides which blocks hold a cached prefix; the node only reads them. It cannot
//! tell the keys and values of one token from another's, but it can refuse a hit on a block it
//! never filled: after a restart (a remote node that came back) every block is empty, and a
//! router that still trusted its prefix cache would get a wrong answer instead of an error.

use step::{InvalidStep, KvCapacity, StepBatch, StepEntry, StepError};

/// Which KV blocks this node has filled to their last slot since it started.
#[derive(Debug, Clone)]
pub(crate) struct FilledBlocks {
    block_size: usize,
    full: Vec<bool>,
}

impl FilledBlocks {
    /// No block filled, for a cache of `capacity`.
    pub(crate) fn new(capacity: KvCapacity) -> Self {
        FilledBlocks {
            block_size: capacity.block_size.max(1),
            full: vec![false; capacity.num_blocks],
        }
    }

    /// A cached prefix must be whole blocks of the entry's table, each filled by this node.
    pub(crate) fn check(&self, e: &StepEntry) -> Result<(), StepError> {
        let n = e.cached_prefix.len();
        let blocks = n / self.block_size;
        if !n.is_multiple_of(self.block_size) || e.start != n || e.block_table.len() < blocks {
            return Err(InvalidStep::CachedPrefixNotWholeBlocks {
                seq: e.seq,
                tokens: n,
                start: e.start,
                block_size: self.block_size,
            }
            .into());
        }
        let unfilled = e.block_table[..blocks]
            .iter()
            .find(|&&b| !self.full.get(b as usize).copied().unwrap_or(false));
        if let Some(b) = unfilled {
            return Err(InvalidStep::CachedBlockNotFilled {
                seq: e.seq,
                block: *b,
            }
            .into());
        }
        Ok(())
    }

    /// Records the blocks a step wrote: those it filled to their end are full, those it
    /// started are not.
    pub(crate) fn record(&mut self, batch: &StepBatch) {
        let bs = self.block_size;
        for e in &batch.entries {
            let end = e.start + e.tokens.len();
            for i in e.start / bs..end.div_ceil(bs) {
                if let Some(&b) = e.block_table.get(i)
                    && let Some(full) = self.full.get_mut(b as usize)
                {
                    *full = (i + 1) * bs <= end;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(start: usize, tokens: usize, cached: usize, table: Vec<u32>) -> StepEntry {
        StepEntry {
            seq: 1,
            tokens: vec![3; tokens],
            start,
            prompt_len: start + tokens,
            block_table: table,
            sample: None,
            cached_prefix: vec![5; cached],
            prompt_logprobs: None,
        }
    }

    fn filled(batch: &[StepEntry]) -> FilledBlocks {
        let mut f = FilledBlocks::new(KvCapacity {
            block_size: 4,
            num_blocks: 8,
        });
        f.record(&StepBatch {
            entries: batch.to_vec(),
        });
        f
    }

    #[test]
    fn a_hit_on_blocks_this_node_filled_is_accepted() {
        let f = filled(&[entry(0, 10, 0, vec![6, 2, 7])]);
        assert!(f.check(&entry(8, 2, 8, vec![6, 2, 1])).is_ok());
        assert!(f.check(&entry(4, 2, 4, vec![6, 1])).is_ok());
    }

    #[test]
    fn a_hit_on_a_block_never_filled_or_partly_filled_is_refused() {
        let f = filled(&[entry(0, 10, 0, vec![6, 2, 7])]);
        let partly = f.check(&entry(12, 1, 12, vec![6, 2, 7, 1])).unwrap_err();
        assert!(partly.to_string().contains("block 7"), "{partly}");
        let never = f.check(&entry(4, 1, 4, vec![0, 1])).unwrap_err();
        assert!(
            never.to_string().contains("did the node restart"),
            "{never}"
        );
    }

    #[test]
    fn a_block_started_again_is_no_longer_full() {
        let mut f = filled(&[entry(0, 8, 0, vec![6, 2])]);
        f.record(&StepBatch {
            entries: vec![entry(0, 3, 0, vec![2])],
        });
        assert!(f.check(&entry(4, 1, 4, vec![6])).is_ok());
        assert!(f.check(&entry(8, 1, 8, vec![6, 2])).is_err());
    }

    #[test]
    fn a_prefix_that_is_not_whole_blocks_is_refused() {
        let f = filled(&[entry(0, 8, 0, vec![6, 2])]);
        assert!(
            f.check(&entry(6, 1, 6, vec![6, 2])).is_err(),
            "6 of 4-token blocks"
        );
        assert!(
            f.check(&entry(5, 1, 4, vec![6, 2])).is_err(),
            "start past the prefix"
        );
        assert!(
            f.check(&entry(8, 1, 8, vec![6])).is_err(),
            "a table too short"
        );
    }
}
