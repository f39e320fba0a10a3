//! Block accounting, the prefix cache's hits and evictions, and a property test that a hit
//! always names blocks holding exactly the tokens asked for.

use proptest::prelude::*;

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

/// A manager with prefix caching, and one sequence of `tokens` computed into fresh blocks and
/// registered.
fn with_sequence(block_size: usize, num_blocks: usize, tokens: &[u32]) -> (BlockManager, Vec<u32>) {
    let mut m = BlockManager::new(block_size, num_blocks).with_prefix_caching(true);
    let mut table = Vec::new();
    assert!(m.grow_to(&mut table, tokens.len()));
    m.cache_full_blocks(&table, tokens, &mut Vec::new());
    (m, table)
}

#[test]
fn a_second_sequence_finds_the_full_blocks_of_the_first() {
    let first: Vec<u32> = (1..=10).collect();
    let (mut m, table) = with_sequence(4, 8, &first);
    assert_eq!(
        m.num_cached(),
        2,
        "10 tokens fill 2 blocks of 4; the third is partial"
    );
    let mut second = first[..8].to_vec();
    second.extend([99, 98, 97]);
    let hits = m.find_cached_prefix(&second);
    assert_eq!(
        hits.iter().map(|h| h.0).collect::<Vec<_>>(),
        table[..2].to_vec(),
        "the shared 8 tokens are the first sequence's first two blocks"
    );
    let mut other = Vec::new();
    m.share(&mut other, &hits);
    assert_eq!(other, table[..2].to_vec());
    assert_eq!(m.holders(table[0]), 2, "held by both sequences");
    assert_eq!(m.num_used(), 3, "sharing takes no new block");
    let diverging: Vec<u32> = [1, 2, 3, 4, 5, 6, 7, 0].to_vec();
    assert_eq!(
        m.find_cached_prefix(&diverging).len(),
        1,
        "a block that differs in its last token is not a hit, nor is anything after it"
    );
    let shifted: Vec<u32> = (5..=12).collect();
    assert!(
        m.find_cached_prefix(&shifted).is_empty(),
        "the first sequence's second block after other tokens is a different prefix"
    );
}

#[test]
fn without_prefix_caching_nothing_is_registered_or_found() {
    let mut m = BlockManager::new(4, 8);
    let tokens: Vec<u32> = (1..=8).collect();
    let mut table = Vec::new();
    assert!(m.grow_to(&mut table, 8));
    m.cache_full_blocks(&table, &tokens, &mut Vec::new());
    assert_eq!(m.num_cached(), 0);
    assert!(m.find_cached_prefix(&tokens).is_empty());
}

#[test]
fn a_released_cached_block_stays_findable_and_counts_as_free() {
    let tokens: Vec<u32> = (1..=8).collect();
    let (mut m, mut table) = with_sequence(4, 4, &tokens);
    m.release(&mut table);
    assert_eq!(
        m.num_free(),
        4,
        "cached blocks are free: they are evicted when needed"
    );
    let hits = m.find_cached_prefix(&tokens);
    assert_eq!(hits.len(), 2);
    let mut again = Vec::new();
    m.share(&mut again, &hits);
    assert_eq!(
        m.num_free(),
        2,
        "taking the two cached blocks leaves the two empty ones"
    );
    assert_eq!(m.num_evictions(), 0);
}

#[test]
fn empty_blocks_go_first_then_the_least_recently_released_tail_first() {
    let a: Vec<u32> = (1..=8).collect();
    let b: Vec<u32> = (101..=104).collect();
    let (mut m, mut ta) = with_sequence(4, 4, &a);
    let mut tb = Vec::new();
    assert!(m.grow_to(&mut tb, 4));
    m.cache_full_blocks(&tb, &b, &mut Vec::new());
    m.release(&mut ta); // a's second block, then its first
    m.release(&mut tb);
    let mut fresh = Vec::new();
    assert!(m.grow_to(&mut fresh, 4));
    assert_eq!(m.num_evictions(), 0, "the never-used block goes first");
    assert!(m.grow_to(&mut fresh, 8));
    assert_eq!(m.num_evictions(), 1);
    assert_eq!(
        m.find_cached_prefix(&a).len(),
        1,
        "a's tail went first: its first block is still a hit"
    );
    assert!(m.grow_to(&mut fresh, 12));
    assert!(m.find_cached_prefix(&a).is_empty(), "then a's first block");
    assert_eq!(m.find_cached_prefix(&b).len(), 1, "b was released last");
    assert_eq!(m.num_evictions(), 2);
}

#[test]
fn a_prefix_computed_twice_at_once_is_registered_once() {
    let tokens: Vec<u32> = (1..=4).collect();
    let (mut m, first) = with_sequence(4, 4, &tokens);
    let mut second = Vec::new();
    assert!(m.grow_to(&mut second, 4));
    m.cache_full_blocks(&second, &tokens, &mut Vec::new());
    assert_eq!(m.num_cached(), 1);
    assert_eq!(
        m.find_cached_prefix(&tokens)[0].0,
        first[0],
        "the first one wins"
    );
    m.release(&mut second);
    assert_eq!(m.num_free(), 3);
    let mut next = Vec::new();
    assert!(m.grow_to(&mut next, 12));
    assert_eq!(
        m.num_evictions(),
        0,
        "the duplicate was freed as an empty block"
    );
}

#[test]
fn a_reset_forgets_every_prefix_and_keeps_held_blocks_held() {
    let tokens: Vec<u32> = (1..=8).collect();
    let (mut m, table) = with_sequence(4, 4, &tokens);
    m.reset_prefix_cache();
    assert!(m.find_cached_prefix(&tokens).is_empty());
    assert_eq!(m.num_used(), 2);
    assert_eq!(m.holders(table[0]), 1);
}

#[derive(Debug, Clone)]
enum Op {
    /// Start a sequence: `prefix` of the shared prefixes, then `tail` tokens of its own.
    Start { prefix: usize, tail: usize },
    /// Release the `i`-th live sequence (modulo).
    Finish(usize),
    /// Forget every cached prefix.
    Reset,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0usize..3, 0usize..9).prop_map(|(prefix, tail)| Op::Start { prefix, tail }),
        3 => any::<usize>().prop_map(Op::Finish),
        1 => Just(Op::Reset),
    ]
}

proptest! {
    /// Blocks are handed out, shared and released at random, with a model of the node's cache
    /// (the tokens last written into each slot): a hit always names blocks that hold exactly
    /// the tokens asked for, a block is written only while one sequence holds it, and the
    /// counts add up.
    #[test]
    fn a_hit_always_names_blocks_that_hold_the_tokens_asked_for(
        block_size in 1usize..5,
        num_blocks in 1usize..24,
        ops in proptest::collection::vec(op(), 1..60),
    ) {
        let prefixes: [Vec<u32>; 3] = [
            (0..12).map(|i| 1 + i % 3).collect(),
            (0..7).map(|i| 1 + i % 3).collect(),
            (0..9).map(|i| 50 + i).collect(),
        ];
        let mut m = BlockManager::new(block_size, num_blocks).with_prefix_caching(true);
        let mut cache = vec![u32::MAX; block_size * num_blocks];
        let mut live: Vec<(Vec<u32>, Vec<u32>)> = Vec::new();
        let mut salt = 1000u32;
        for op in ops {
            match op {
                Op::Start { prefix, tail } => {
                    let mut tokens = prefixes[prefix].clone();
                    tokens.extend((0..tail as u32).map(|i| salt + i));
                    salt += 100;
                    // At least the last token is computed, as the scheduler does.
                    let hits = m.find_cached_prefix(&tokens[..tokens.len() - 1]);
                    for (i, &(block, _)) in hits.iter().enumerate() {
                        let held = &cache[block as usize * block_size..][..block_size];
                        prop_assert_eq!(held, &tokens[i * block_size..(i + 1) * block_size]);
                    }
                    let mut table = Vec::new();
                    m.share(&mut table, &hits);
                    let mut hashes: Vec<_> = hits.iter().map(|h| h.1).collect();
                    let cached = hits.len() * block_size;
                    if !m.grow_to(&mut table, tokens.len()) {
                        m.release(&mut table);
                        continue;
                    }
                    for (p, &t) in tokens.iter().enumerate().skip(cached) {
                        let block = table[p / block_size];
                        prop_assert_eq!(m.holders(block), 1, "a shared block is written");
                        cache[block as usize * block_size + p % block_size] = t;
                    }
                    m.cache_full_blocks(&table, &tokens, &mut hashes);
                    live.push((table, tokens));
                }
                Op::Finish(i) if !live.is_empty() => {
                    let (mut table, _) = live.remove(i % live.len());
                    m.release(&mut table);
                }
                Op::Finish(_) => {}
                Op::Reset => m.reset_prefix_cache(),
            }
            let mut held = std::collections::HashMap::new();
            for (table, _) in &live {
                for &b in table {
                    *held.entry(b).or_insert(0u32) += 1;
                }
            }
            prop_assert_eq!(m.num_used(), held.len());
            for (&b, &n) in &held {
                prop_assert_eq!(m.holders(b), n);
            }
            prop_assert!(m.num_cached() <= num_blocks);
        }
    }
}
