//! Prompt logprobs in the scheduler: each chunk asks for the prompt tokens after its own, the
//! scores arrive whole and in order with the first token (never again), a recompute before it
//! does not double them, the prefix cache does not skip a prompt still to be scored, and a
//! node that scores too few fails the request alone.

use super::*;

fn scoring(id: RequestId, prompt_len: usize, top: usize) -> NewRequest {
    let mut r = request(id, prompt_len, 3);
    r.params.prompt_logprobs = Some(top);
    r
}

/// What the fake node scores for `prompt`: every token after the first, given those before.
fn expected(prompt: &[u32], top: usize) -> Vec<ScoredToken> {
    (1..prompt.len())
        .map(|p| FakeNode::prompt_score(&prompt[..p], prompt[p], top))
        .collect()
}

#[test]
fn chunks_score_the_tokens_after_theirs_and_the_first_token_carries_them_all() {
    // A budget of 4: the 10-token prompt goes in chunks of 4, 4 and 2.
    let mut h = Harness::new(config(4, 4, 64), 4, 32);
    let req = scoring(1, 10, 2);
    let prompt = req.prompt.clone();
    h.sched.add_request(req).unwrap();
    let nexts: Vec<Vec<u32>> = (0..3)
        .map(|_| {
            let out = h.step();
            out.batch.entries[0]
                .prompt_logprobs
                .as_ref()
                .expect("a prefill chunk scores")
                .next
                .clone()
        })
        .collect();
    assert_eq!(nexts[0], prompt[1..5].to_vec());
    assert_eq!(nexts[1], prompt[5..9].to_vec());
    assert_eq!(
        nexts[2],
        prompt[9..10].to_vec(),
        "the last chunk: one fewer"
    );
    let first = &h.last_tokens[0];
    assert_eq!(first.prompt_logprobs, Some(expected(&prompt, 2)));
    let out = h.step();
    assert_eq!(
        out.batch.entries[0].prompt_logprobs, None,
        "a decode scores nothing"
    );
    assert_eq!(
        h.last_tokens[0].prompt_logprobs, None,
        "only the first token"
    );
    h.run_to_completion();
}

#[test]
fn a_request_without_prompt_logprobs_asks_for_none() {
    let mut h = Harness::new(config(4, 64, 64), 4, 32);
    h.sched.add_request(request(1, 10, 2)).unwrap();
    let out = h.step();
    assert_eq!(out.batch.entries[0].prompt_logprobs, None);
    assert_eq!(h.last_tokens[0].prompt_logprobs, None);
    h.run_to_completion();
    // A one-token prompt scores nothing, and says so with an empty list.
    h.sched.add_request(scoring(3, 1, 0)).unwrap();
    let out = h.step();
    assert_eq!(out.batch.entries[0].prompt_logprobs, None);
    assert_eq!(h.last_tokens[0].prompt_logprobs, Some(Vec::new()));
}

#[test]
fn a_prompt_to_score_takes_nothing_from_the_prefix_cache() {
    let mut cfg = config(4, 64, 64);
    cfg.enable_prefix_caching = true;
    let mut h = Harness::new(cfg, 4, 32);
    let plain = request(1, 12, 2);
    let prompt = plain.prompt.clone();
    h.sched.add_request(plain).unwrap();
    h.run_to_completion();
    let mut again = scoring(2, 12, 1);
    again.prompt = prompt.clone();
    h.sched.add_request(again).unwrap();
    let out = h.step();
    assert_eq!(
        out.batch.entries[0].start, 0,
        "computed from the first token"
    );
    assert!(out.batch.entries[0].cached_prefix.is_empty());
    assert_eq!(h.last_tokens[0].prompt_logprobs, Some(expected(&prompt, 1)));
    h.run_to_completion();
    let st = h.sched.stats();
    assert_eq!(st.prefix_cache_hits_total, 0);
    assert_eq!(
        st.prefix_cache_queries_total, 12,
        "the scored prompt was not looked up"
    );
}

#[test]
fn a_preempted_prompt_is_scored_again_from_the_start_and_not_twice() {
    // 6 blocks of 2 tokens: request 1 (8-token prompt, chunks of 4) is preempted by the
    // older request 0 growing, before its first token.
    let mut h = Harness::new(config(4, 4, 12), 2, 6);
    h.sched.add_request(request(0, 4, 8)).unwrap();
    h.step();
    let req = scoring(1, 8, 0);
    let prompt = req.prompt.clone();
    h.sched.add_request(req).unwrap();
    let mut preempted = false;
    let mut first = None;
    while h.sched.has_work() {
        let out = h.step();
        preempted |= out.preempted.contains(&1);
        if let Some(t) = h
            .last_tokens
            .iter()
            .find(|t| t.id == 1 && t.prompt_logprobs.is_some())
        {
            assert!(first.is_none(), "scores come once");
            first = t.prompt_logprobs.clone();
        }
    }
    assert!(preempted, "the setup must preempt request 1");
    assert_eq!(first, Some(expected(&prompt, 0)));
}

#[test]
fn a_node_that_scores_too_few_fails_that_request_alone() {
    let mut sched = Scheduler::new(config(4, 64, 64), 4, 32).unwrap();
    sched.add_request(scoring(1, 6, 0)).unwrap();
    sched.add_request(request(2, 6, 2)).unwrap();
    let out = sched.schedule(Instant::now());
    let mut node = FakeNode::new(FakeNodeConfig {
        block_size: 4,
        num_blocks: 32,
        ..Default::default()
    });
    let mut result = node.step(&out.batch).unwrap();
    result.prompt_logprobs[0].tokens.pop();
    let (tokens, failed) = sched.update_from_output(&out, &result, Instant::now());
    assert_eq!(
        failed,
        vec![(1, SequenceFailure::PromptLogprobs { asked: 5, got: 4 })]
    );
    assert_eq!(tokens.iter().map(|t| t.id).collect::<Vec<_>>(), vec![2]);
    assert_eq!(sched.status(1), None, "the failed request is gone");
}
