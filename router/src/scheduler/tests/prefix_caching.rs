//! Prefix caching in the scheduler: what a hit skips, what the node is told, what is counted,
//! and a property test that outputs are the same with it and without.

use super::*;

fn with_prompt(id: RequestId, prompt: Vec<u32>, max_tokens: usize) -> NewRequest {
    NewRequest {
        id,
        prompt,
        params: params(max_tokens),
        arrival: Instant::now(),
    }
}

/// A shared prefix of `n` tokens followed by `tail` tokens of the request's own.
fn shared(id: RequestId, n: usize, tail: usize) -> NewRequest {
    let mut prompt: Vec<u32> = (0..n as u32).map(|i| 1 + i % 50).collect();
    prompt.extend((0..tail as u32).map(|i| 100 + id as u32 * 10 + i));
    with_prompt(id, prompt, 3)
}

fn caching(on: bool) -> SchedulerConfig {
    let mut cfg = config(8, 1000, 64);
    cfg.enable_prefix_caching = on;
    cfg
}

#[test]
fn a_request_sharing_a_finished_ones_prefix_skips_its_full_blocks() {
    let mut h = Harness::new(caching(true), 4, 32);
    h.sched.add_request(shared(1, 10, 2)).unwrap();
    h.run_to_completion();
    h.sched.add_request(shared(2, 10, 3)).unwrap();
    let out = h.step();
    assert_eq!(
        out.num_scheduled_tokens,
        vec![(2, 5)],
        "the 10 shared tokens fill 2 blocks of 4: 8 are cached, 5 of 13 computed"
    );
    let e = &out.batch.entries[0];
    assert_eq!(e.start, 8);
    assert_eq!(e.cached_prefix, shared(2, 10, 3).prompt[..8].to_vec());
    assert!(e.starts_sequence());
    let next = h.step();
    assert!(
        next.batch.entries[0].cached_prefix.is_empty(),
        "only the first step names the cached prefix"
    );
    h.run_to_completion();
    let st = h.sched.stats();
    assert_eq!(
        st.prefix_cache_queries_total,
        12 + 13,
        "every token of both admissions"
    );
    assert_eq!(st.prefix_cache_hits_total, 8);
    assert_eq!(
        h.outputs[&2],
        alone(&shared(2, 10, 3)),
        "the same tokens as computing the prompt whole"
    );
}

#[test]
fn requests_running_together_share_blocks_once_the_first_has_computed_them() {
    let mut h = Harness::new(caching(true), 4, 32);
    h.sched.add_request(shared(1, 16, 1)).unwrap();
    h.step();
    h.sched.add_request(shared(2, 16, 1)).unwrap();
    let out = h.step();
    let e = out.batch.entries.iter().find(|e| e.seq == 2).unwrap();
    assert_eq!(
        e.start, 16,
        "the 4 blocks request 1 computed, while it still runs"
    );
    let table_1 = &out
        .batch
        .entries
        .iter()
        .find(|e| e.seq == 1)
        .unwrap()
        .block_table;
    assert_eq!(e.block_table[..4], table_1[..4], "the same physical blocks");
    assert_eq!(h.sched.block_manager().holders(e.block_table[0]), 2);
    h.run_to_completion();
}

#[test]
fn a_prompt_cached_whole_still_computes_its_last_token() {
    let mut h = Harness::new(caching(true), 4, 32);
    let prompt: Vec<u32> = (1..=8).collect();
    h.sched
        .add_request(with_prompt(1, prompt.clone(), 2))
        .unwrap();
    h.run_to_completion();
    h.sched
        .add_request(with_prompt(2, prompt.clone(), 2))
        .unwrap();
    let out = h.step();
    assert_eq!(
        out.num_scheduled_tokens,
        vec![(2, 4)],
        "the last block holds the last token, which needs logits: only the first is a hit"
    );
    h.run_to_completion();
    assert_eq!(h.outputs[&1], h.outputs[&2]);
}

#[test]
fn without_prefix_caching_nothing_is_shared_or_counted() {
    let mut h = Harness::new(caching(false), 4, 32);
    h.sched.add_request(shared(1, 10, 2)).unwrap();
    h.run_to_completion();
    h.sched.add_request(shared(2, 10, 3)).unwrap();
    assert_eq!(h.step().num_scheduled_tokens, vec![(2, 13)]);
    let st = h.sched.stats();
    assert_eq!(
        (st.prefix_cache_queries_total, st.prefix_cache_hits_total),
        (0, 0)
    );
}

#[test]
fn a_node_that_cannot_share_blocks_turns_prefix_caching_off() {
    let node = FakeNode::new(FakeNodeConfig {
        shares_kv_blocks: false,
        ..Default::default()
    });
    assert!(!node.shares_kv_blocks());
    let kv = node.kv_capacity();
    let mut cfg = caching(true);
    cfg.enable_prefix_caching &= node.shares_kv_blocks();
    let s = Scheduler::new(cfg, kv.block_size, kv.num_blocks).unwrap();
    assert!(!s.block_manager().prefix_caching());
}

#[test]
fn a_preempted_request_recomputes_only_past_its_cached_blocks() {
    // The scenario of `stats_count_preempted_waiting_requests_apart_from_new_ones`, with
    // prefix caching: request 2's first block (its 4-token prompt) survives its preemption,
    // so it recomputes 5 of its 9 tokens instead of 9.
    let mut h = Harness::new(config(2, 1000, 16), 4, 4);
    h.sched.add_request(request(1, 4, 8)).unwrap();
    h.sched.add_request(request(2, 4, 8)).unwrap();
    for _ in 1..=5 {
        h.step();
    }
    assert_eq!(h.step().preempted, vec![2]);
    for _ in 7..=8 {
        h.step();
    }
    let out = h.step();
    assert_eq!(out.num_scheduled_tokens, vec![(2, 5)]);
    assert_eq!(out.batch.entries[0].cached_prefix.len(), 4);
    h.run_to_completion();
    assert_eq!(h.outputs[&2], alone(&request(2, 4, 8)));
}

#[test]
fn a_failed_step_forgets_the_prefix_cache() {
    let mut h = Harness::new(caching(true), 4, 32);
    h.sched.add_request(shared(1, 10, 2)).unwrap();
    h.run_to_completion();
    h.sched.add_request(shared(2, 10, 2)).unwrap();
    let out = h.sched.schedule(Instant::now());
    assert_eq!(out.batch.entries[0].start, 8);
    assert_eq!(h.sched.fail_step(&out), vec![2]);
    assert_eq!(h.sched.block_manager().num_cached(), 0);
    h.sched.add_request(shared(3, 10, 2)).unwrap();
    assert_eq!(
        h.sched.schedule(Instant::now()).batch.entries[0].start,
        0,
        "the node may have lost its cache: no hit"
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Random request sets whose prompts share prefixes, arriving over time into a small
    /// cache (so blocks are evicted and requests preempted): every request produces the same
    /// tokens with prefix caching as without, and the fake node, which checks that every
    /// cached prefix holds the tokens the router names, accepts every step.
    #[test]
    fn outputs_are_the_same_with_and_without_prefix_caching(
        block_size in 1usize..6,
        extra_blocks in 0usize..24,
        budget in 2usize..40,
        reqs in proptest::collection::vec((0usize..3, 0usize..30, 0usize..12, 1usize..8, 0usize..3), 1..24),
    ) {
        let max_model_len: usize = 64;
        let num_blocks = max_model_len.div_ceil(block_size) + extra_blocks;
        let prefixes: [Vec<u32>; 3] = [
            (0..40).map(|i| 1 + i % 7).collect(),
            (0..40).map(|i| 1 + i % 7).take(13).chain(200..230).collect(),
            (0..40).map(|i| 60 + i).collect(),
        ];
        let requests: Vec<(NewRequest, usize)> = reqs
            .iter()
            .enumerate()
            .map(|(i, &(p, shared, tail, max_tokens, wait))| {
                let mut prompt = prefixes[p][..shared].to_vec();
                prompt.extend((0..tail as u32).map(|t| 300 + i as u32 * 13 + t));
                if prompt.is_empty() {
                    prompt.push(5);
                }
                (with_prompt(i as u64, prompt, max_tokens), wait)
            })
            .collect();
        let run = |on: bool| {
            let mut cfg = config(4, budget, max_model_len);
            cfg.enable_prefix_caching = on;
            let mut h = Harness::new(cfg, block_size, num_blocks);
            for (r, wait) in &requests {
                h.sched.add_request(r.clone()).unwrap();
                for _ in 0..*wait {
                    if h.sched.has_work() {
                        h.step();
                    }
                }
            }
            h.run_to_completion();
            (h.outputs, h.sched.stats())
        };
        let (with, stats) = run(true);
        let (without, _) = run(false);
        prop_assert_eq!(with, without);
        prop_assert!(stats.prefix_cache_hits_total <= stats.prefix_cache_queries_total);
    }
}
