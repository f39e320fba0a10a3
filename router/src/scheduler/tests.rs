//! The scheduler driven by fake model outputs (the [`crate::fake::FakeNode`]), no model needed.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use model::sampling::SamplingParams;
use proptest::prelude::*;
use step::Penalties;
use step::{AttentionNode, SampleRequest, ScoredToken};

use super::*;
use crate::fake::{FakeNode, FakeNodeConfig};

mod accounting;
mod admission;
mod constraints;
mod prefix_caching;
mod prompt_logprobs;

fn config(max_num_seqs: usize, budget: usize, max_model_len: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_num_seqs,
        max_num_batched_tokens: budget,
        max_model_len,
        enable_chunked_prefill: true,
        enable_prefix_caching: true,
    }
}

fn params(max_tokens: usize) -> SequenceParams {
    SequenceParams {
        max_tokens,
        sample: SampleRequest {
            params: SamplingParams::greedy(),
            penalties: Penalties::default(),
            logprobs: false,
            top_logprobs: 0,
            allowed: None,
        },
        stop_token_ids: Vec::new(),
        constraint: None,
        prompt_logprobs: None,
    }
}

fn request(id: RequestId, prompt_len: usize, max_tokens: usize) -> NewRequest {
    NewRequest {
        id,
        prompt: (0..prompt_len as u32)
            .map(|i| 1 + (i * 31 + id as u32) % 200)
            .collect(),
        params: params(max_tokens),
        arrival: Instant::now(),
    }
}

/// A scheduler and a fake node with the same cache geometry, stepped together.
struct Harness {
    sched: Scheduler,
    node: FakeNode,
    outputs: HashMap<RequestId, Vec<u32>>,
    finished: HashMap<RequestId, FinishReason>,
    /// The tokens the last step produced, as the scheduler reported them.
    last_tokens: Vec<TokenOutput>,
}

impl Harness {
    fn new(cfg: SchedulerConfig, block_size: usize, num_blocks: usize) -> Self {
        let node = FakeNode::new(FakeNodeConfig {
            block_size,
            num_blocks,
            ..Default::default()
        });
        Harness {
            sched: Scheduler::new(cfg, block_size, num_blocks).unwrap(),
            node,
            outputs: HashMap::new(),
            finished: HashMap::new(),
            last_tokens: Vec::new(),
        }
    }

    /// One step; returns what was scheduled.
    fn step(&mut self) -> SchedulerOutput {
        let out = self.sched.schedule(Instant::now());
        self.node.free(&out.freed).unwrap();
        let result = self.node.step(&out.batch).unwrap();
        let (tokens, failed) = self.sched.update_from_output(&out, &result, Instant::now());
        assert!(failed.is_empty(), "{failed:?}");
        for t in &tokens {
            self.outputs.entry(t.id).or_default().push(t.token);
            if let Some(f) = t.finish {
                self.finished.insert(t.id, f);
            }
        }
        self.last_tokens = tokens;
        self.check_invariants();
        out
    }

    fn run_to_completion(&mut self) {
        let mut guard = 0;
        while self.sched.has_work() {
            self.step();
            guard += 1;
            assert!(guard < 100_000, "no progress");
        }
        let freed = self.sched.take_freed();
        self.node.free(&freed).unwrap();
        assert_eq!(
            self.sched.block_manager().num_free(),
            self.sched.block_manager().num_blocks()
        );
    }

    fn check_invariants(&self) {
        let mut holders: HashMap<u32, u32> = HashMap::new();
        for seq in self.sched.seqs.values() {
            let mut own = HashSet::new();
            for &b in &seq.blocks {
                assert!(own.insert(b), "block {b} twice in one table");
                *holders.entry(b).or_default() += 1;
            }
            assert!(seq.blocks.len() >= self.sched.blocks.blocks_for(seq.num_computed));
        }
        assert_eq!(
            holders.len(),
            self.sched.blocks.num_used(),
            "leaked or double-counted blocks"
        );
        for (&b, &n) in &holders {
            assert_eq!(self.sched.blocks.holders(b), n, "holders of block {b}");
            if n > 1 {
                assert!(self.sched.blocks.prefix_caching(), "block {b} shared");
            }
        }
    }
}

/// The tokens a request produces alone.
fn alone(req: &NewRequest) -> Vec<u32> {
    let mut h = Harness::new(config(4, 4096, 4096), 16, 512);
    h.sched.add_request(req.clone()).unwrap();
    h.run_to_completion();
    h.outputs.remove(&req.id).unwrap_or_default()
}

#[test]
fn one_request_prefills_then_decodes_to_max_tokens() {
    let mut h = Harness::new(config(8, 64, 128), 4, 32);
    h.sched.add_request(request(1, 10, 5)).unwrap();
    let first = h.step();
    assert_eq!(first.num_scheduled_tokens, vec![(1, 10)]);
    assert_eq!(first.started, vec![1]);
    assert_eq!(first.batch.entries[0].block_table.len(), 3);
    assert!(first.batch.entries[0].sample.is_some());
    for _ in 0..4 {
        let out = h.step();
        assert_eq!(
            out.num_scheduled_tokens,
            vec![(1, 1)],
            "a decode is one token"
        );
    }
    assert_eq!(h.outputs[&1].len(), 5);
    assert_eq!(h.finished[&1], FinishReason::Length);
    assert!(!h.sched.has_work());
    assert_eq!(h.sched.take_freed(), vec![1], "the node must forget it");
    assert_eq!(h.sched.block_manager().num_free(), 32);
}

#[test]
fn long_prompts_are_prefilled_in_chunks_within_the_budget() {
    let mut h = Harness::new(config(8, 4, 128), 4, 32);
    h.sched.add_request(request(1, 10, 2)).unwrap();
    let chunks: Vec<_> = (0..3).map(|_| h.step()).collect();
    let sizes: Vec<usize> = chunks.iter().map(|c| c.num_scheduled_tokens[0].1).collect();
    assert_eq!(sizes, vec![4, 4, 2]);
    let samples: Vec<bool> = chunks
        .iter()
        .map(|c| c.batch.entries[0].sample.is_some())
        .collect();
    assert_eq!(
        samples,
        vec![false, false, true],
        "only the last chunk samples"
    );
    assert_eq!(chunks[1].batch.entries[0].start, 4);
    h.run_to_completion();
    assert_eq!(h.outputs[&1], alone(&request(1, 10, 2)));
}

#[test]
fn decodes_go_first_and_new_prompts_take_the_rest_of_the_budget() {
    let mut h = Harness::new(config(8, 8, 256), 4, 64);
    h.sched.add_request(request(1, 3, 10)).unwrap();
    h.sched.add_request(request(2, 3, 10)).unwrap();
    h.step();
    h.sched.add_request(request(3, 20, 10)).unwrap();
    let out = h.step();
    // Two decodes (1 token each), then 6 of the new prompt's 20 tokens.
    assert_eq!(out.num_scheduled_tokens, vec![(1, 1), (2, 1), (3, 6)]);
    assert!(out.total_tokens() <= 8);
}

#[test]
fn max_num_seqs_caps_the_running_set() {
    let mut h = Harness::new(config(2, 1000, 256), 4, 64);
    for id in 0..5 {
        h.sched.add_request(request(id, 3, 4)).unwrap();
    }
    let out = h.step();
    assert_eq!(out.batch.entries.len(), 2);
    assert_eq!(h.sched.stats().waiting_new, 3);
    h.run_to_completion();
    assert_eq!(h.finished.len(), 5);
}

#[test]
fn first_come_first_served_even_when_a_later_request_would_fit() {
    // 8 blocks of 4 tokens; request 1 holds 4 blocks, request 2 needs 5, request 3 needs 1.
    let mut h = Harness::new(config(8, 1000, 32), 4, 8);
    h.sched.add_request(request(1, 16, 4)).unwrap();
    h.step();
    h.sched.add_request(request(2, 17, 4)).unwrap();
    h.sched.add_request(request(3, 2, 2)).unwrap();
    let out = h.step();
    assert_eq!(
        out.num_scheduled_tokens,
        vec![(1, 1)],
        "2 does not fit, 3 must not overtake it"
    );
    h.run_to_completion();
    assert_eq!(h.finished.len(), 3);
}

#[test]
fn preemption_by_recompute_frees_the_newest_and_keeps_results_exact() {
    // 6 blocks of 4 tokens = 24 slots; two requests of 8 + 12 tokens each cannot both finish.
    let reqs = [request(1, 8, 12), request(2, 8, 12)];
    let mut h = Harness::new(config(8, 1000, 24), 4, 6);
    for r in &reqs {
        h.sched.add_request(r.clone()).unwrap();
    }
    let mut preempted = Vec::new();
    let mut guard = 0;
    while h.sched.has_work() {
        let out = h.step();
        preempted.extend(out.preempted.iter().copied());
        if !out.preempted.is_empty() {
            assert!(
                out.freed.contains(&2),
                "the node forgets a preempted sequence"
            );
            assert!(
                out.started.is_empty(),
                "nothing starts in a step that preempted"
            );
        }
        guard += 1;
        assert!(guard < 1000);
    }
    assert!(
        preempted.contains(&2),
        "the newer request is the victim: {preempted:?}"
    );
    assert!(!preempted.contains(&1));
    assert!(h.sched.stats().num_preemptions_total >= 1);
    for r in &reqs {
        assert_eq!(
            h.outputs[&r.id],
            alone(r),
            "request {} changed by preemption",
            r.id
        );
    }
}

#[test]
fn a_stop_token_finishes_the_sequence_and_is_kept() {
    let probe = request(1, 5, 8);
    let expected = alone(&probe);
    let stop = expected[2];
    let mut req = probe.clone();
    req.params.stop_token_ids = vec![stop];
    let mut h = Harness::new(config(8, 100, 128), 4, 32);
    h.sched.add_request(req).unwrap();
    h.run_to_completion();
    let cut = expected.iter().position(|&t| t == stop).unwrap();
    assert_eq!(h.outputs[&1], expected[..=cut].to_vec());
    assert_eq!(h.finished[&1], FinishReason::StopToken(stop));
}

#[test]
fn abort_frees_blocks_at_once() {
    let mut h = Harness::new(config(8, 100, 128), 4, 32);
    h.sched.add_request(request(1, 10, 50)).unwrap();
    h.sched.add_request(request(2, 10, 50)).unwrap();
    h.step();
    let used = h.sched.block_manager().num_used();
    assert_eq!(h.sched.abort(1), Some(RequestStatus::Running));
    assert_eq!(h.sched.block_manager().num_used(), used - 3);
    let freed = h.sched.take_freed();
    assert_eq!(freed, vec![1]);
    h.node.free(&freed).unwrap();
    assert_eq!(h.sched.abort(1), None, "a second abort is a no-op");
    h.sched.add_request(request(3, 4, 2)).unwrap();
    assert_eq!(h.sched.abort(3), Some(RequestStatus::Waiting));
    assert!(
        h.sched.take_freed().is_empty(),
        "the node never saw request 3"
    );
    h.run_to_completion();
}

#[test]
fn requests_that_can_never_fit_are_refused() {
    let mut s = Scheduler::new(config(8, 100, 32), 4, 8).unwrap();
    assert!(s.add_request(request(1, 30, 3)).is_err());
    assert!(s.add_request(request(2, 0, 3)).is_err());
    assert!(s.add_request(request(3, 3, 0)).is_err());
    assert!(
        Scheduler::new(config(8, 100, 33), 4, 8).is_err(),
        "33 tokens exceed 8 x 4 slots"
    );
}

#[test]
fn batching_does_not_change_any_sequence() {
    let reqs: Vec<NewRequest> = (0..32)
        .map(|i| request(i, 1 + (i as usize * 7) % 40, 1 + (i as usize * 5) % 30))
        .collect();
    let mut h = Harness::new(config(16, 64, 128), 4, 96);
    for r in &reqs {
        h.sched.add_request(r.clone()).unwrap();
    }
    h.run_to_completion();
    for r in &reqs {
        assert_eq!(h.outputs[&r.id], alone(r));
        assert_eq!(h.outputs[&r.id].len(), r.params.max_tokens);
    }
}

#[derive(Debug, Clone)]
enum Op {
    Add { prompt: usize, max_tokens: usize },
    Abort(usize),
    Step,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (1usize..40, 1usize..20).prop_map(|(prompt, max_tokens)| Op::Add { prompt, max_tokens }),
        1 => (0usize..64).prop_map(Op::Abort),
        6 => Just(Op::Step),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Any interleaving of arrivals, aborts and steps: budgets hold, no block is held twice or
    /// leaked (checked after every step), every request finishes, and all blocks come back.
    #[test]
    fn budgets_hold_and_blocks_never_leak(
        ops in proptest::collection::vec(op(), 1..120),
        max_num_seqs in 1usize..8,
        budget in 1usize..48,
        block_size in 1usize..6,
    ) {
        let max_model_len: usize = 64;
        let num_blocks = max_model_len.div_ceil(block_size) + 4;
        let mut h = Harness::new(config(max_num_seqs, budget, max_model_len), block_size, num_blocks);
        let mut next_id = 0u64;
        let mut live: Vec<RequestId> = Vec::new();
        for op in ops {
            match op {
                Op::Add { prompt, max_tokens } => {
                    h.sched.add_request(request(next_id, prompt, max_tokens)).unwrap();
                    live.push(next_id);
                    next_id += 1;
                }
                Op::Abort(k) if !live.is_empty() => {
                    let id = live.remove(k % live.len());
                    h.sched.abort(id);
                    h.check_invariants();
                }
                Op::Abort(_) => {}
                Op::Step => {
                    let out = h.step();
                    prop_assert!(out.total_tokens() <= budget);
                    prop_assert!(out.batch.entries.len() <= max_num_seqs);
                    for e in &out.batch.entries {
                        prop_assert!(e.block_table.len() * block_size >= e.start + e.tokens.len());
                        prop_assert!(!e.tokens.is_empty());
                    }
                }
            }
        }
        h.run_to_completion();
    }
}
