//! What the scheduler reports about itself: accessors, gauges and counters, and `fail_step`.

use super::*;

#[test]
fn accessors_report_the_settings_the_queue_and_the_running_set() {
    let cfg = config(3, 50, 64);
    assert_ne!(cfg, SchedulerConfig::default());
    let mut s = Scheduler::new(cfg.clone(), 4, 16).unwrap();
    assert_eq!(s.config(), &cfg, "the settings it was built with");
    assert_eq!(s.num_requests(), 0);
    assert!(s.running().is_empty());
    assert_eq!(s.request_ids().count(), 0);

    s.add_request(request(7, 5, 4)).unwrap();
    s.add_request(request(9, 5, 4)).unwrap();
    assert_eq!(s.num_requests(), 2);
    assert_eq!(s.status(7), Some(RequestStatus::Waiting));
    assert_eq!(s.status(9), Some(RequestStatus::Waiting));
    assert_eq!(s.status(8), None, "never added");
    let mut ids: Vec<RequestId> = s.request_ids().collect();
    ids.sort_unstable();
    assert_eq!(ids, vec![7, 9]);
    assert!(s.running().is_empty(), "nothing runs before a step");

    let out = s.schedule(Instant::now());
    assert_eq!(out.num_scheduled_tokens, vec![(7, 5), (9, 5)]);
    assert_eq!(s.running(), &[7, 9], "oldest first");
    assert_eq!(s.status(7), Some(RequestStatus::Running));
    assert_eq!(s.num_requests(), 2);
}

#[test]
fn stats_count_steps_computed_prompt_and_generated_tokens_of_a_chunked_prefill() {
    // A 10-token prompt in chunks of 4, 4 and 2 (the last one samples), then 2 decodes.
    let mut h = Harness::new(config(8, 4, 128), 4, 32);
    h.sched.add_request(request(1, 10, 3)).unwrap();
    // (scheduled, steps, computed, prompt, generated) after each step.
    let expected = [
        (4, 1, 4, 0, 0),
        (4, 2, 8, 0, 0),
        (2, 3, 10, 10, 1),
        (1, 4, 11, 10, 2),
        (1, 5, 12, 10, 3),
    ];
    for (k, &(n, steps, computed, prompt, generated)) in expected.iter().enumerate() {
        let out = h.step();
        assert_eq!(out.num_scheduled_tokens, vec![(1, n)], "step {}", k + 1);
        let st = h.sched.stats();
        assert_eq!(st.last_step_tokens, n, "step {}", k + 1);
        assert_eq!(st.steps_total, steps, "step {}", k + 1);
        assert_eq!(st.computed_tokens_total, computed, "step {}", k + 1);
        assert_eq!(
            st.prompt_tokens_total,
            prompt,
            "the prompt counts once its prefill completes (step {})",
            k + 1
        );
        assert_eq!(st.generation_tokens_total, generated, "step {}", k + 1);
    }
    assert_eq!(h.finished[&1], FinishReason::Length);
    assert!(!h.sched.has_work());
}

#[test]
fn stats_count_preempted_waiting_requests_apart_from_new_ones() {
    // 4 blocks of 4 tokens. Requests 1 and 2 (4-token prompts, 8 tokens each) hold 2 blocks
    // each after their 5th token; at step 6 request 1 needs a 3rd block (9 tokens), so the
    // newest, request 2, is preempted. Request 3 is held back by max_num_seqs = 2. Without
    // prefix caching, so that request 2 is recomputed whole (`prefix_caching.rs` has the
    // same preemption with it).
    let mut cfg = config(2, 1000, 16);
    cfg.enable_prefix_caching = false;
    let mut h = Harness::new(cfg, 4, 4);
    h.sched.add_request(request(1, 4, 8)).unwrap();
    h.sched.add_request(request(2, 4, 8)).unwrap();
    h.sched.add_request(request(3, 3, 1)).unwrap();
    let st = h.sched.stats();
    assert_eq!((st.waiting_new, st.waiting_preempted), (3, 0));

    assert_eq!(h.step().num_scheduled_tokens, vec![(1, 4), (2, 4)]);
    for _ in 2..=5 {
        assert_eq!(h.step().num_scheduled_tokens, vec![(1, 1), (2, 1)]);
        assert!(h.last_tokens.iter().all(|t| t.num_preemptions == 0));
    }
    let out = h.step(); // step 6
    assert_eq!(out.preempted, vec![2]);
    assert_eq!(out.num_scheduled_tokens, vec![(1, 1)]);
    assert_eq!(h.sched.status(2), Some(RequestStatus::Preempted));
    let st = h.sched.stats();
    assert_eq!(st.running, 1);
    assert_eq!(st.waiting_preempted, 1, "request 2, preempted");
    assert_eq!(st.waiting_new, 1, "request 3, never started");
    assert_eq!((st.kv_blocks_used, st.kv_blocks_total), (3, 4));
    assert_eq!(st.num_preemptions_total, 1);

    // Request 2 now needs 3 blocks for its 9 tokens and only 1 is free until request 1
    // finishes (its 8th token, at step 8); request 3 must not overtake it.
    for _ in 7..=8 {
        assert_eq!(h.step().num_scheduled_tokens, vec![(1, 1)]);
    }
    assert_eq!(h.finished[&1], FinishReason::Length);
    let out = h.step(); // step 9: request 2 is recomputed (prompt + 5 outputs), 3 starts
    assert_eq!(out.num_scheduled_tokens, vec![(2, 9), (3, 3)]);
    assert_eq!(out.started, vec![3], "request 2 started long ago");
    let t2 = h.last_tokens.iter().find(|t| t.id == 2).unwrap();
    assert_eq!(t2.num_preemptions, 1, "request 2 was preempted once");
    let t3 = h.last_tokens.iter().find(|t| t.id == 3).unwrap();
    assert_eq!(t3.num_preemptions, 0);
    let st = h.sched.stats();
    assert_eq!(
        (st.waiting_new, st.waiting_preempted, st.running),
        (0, 0, 1)
    );

    h.run_to_completion(); // steps 10 and 11: request 2's last two tokens
    let st = h.sched.stats();
    assert_eq!(st.steps_total, 11);
    assert_eq!(st.num_preemptions_total, 1);
    assert_eq!(
        st.prompt_tokens_total,
        4 + 4 + 3,
        "a recomputed prompt is not counted again"
    );
    assert_eq!(st.generation_tokens_total, 8 + 8 + 1);
    // Request 1: 4 + 7 decodes; request 2: 4 + 4 decodes, 9 recomputed, 2 decodes; request 3: 3.
    assert_eq!(st.computed_tokens_total, 11 + 19 + 3);
    assert_eq!(h.outputs[&2], alone(&request(2, 4, 8)));
}

#[test]
fn fail_step_drops_and_returns_every_request_of_the_step() {
    let mut s = Scheduler::new(config(2, 100, 64), 4, 16).unwrap();
    s.add_request(request(5, 6, 4)).unwrap();
    s.add_request(request(6, 3, 4)).unwrap();
    s.add_request(request(7, 2, 2)).unwrap();
    let out = s.schedule(Instant::now());
    assert_eq!(out.num_scheduled_tokens, vec![(5, 6), (6, 3)]);
    assert_eq!(s.fail_step(&out), vec![5, 6]);
    assert_eq!(s.status(5), None);
    assert_eq!(s.status(6), None);
    assert_eq!(s.status(7), Some(RequestStatus::Waiting), "not in the step");
    assert_eq!(s.num_requests(), 1);
    assert_eq!(s.block_manager().num_used(), 0);
    let mut freed = s.take_freed();
    freed.sort_unstable();
    assert_eq!(freed, vec![5, 6], "the node must forget both");
}
