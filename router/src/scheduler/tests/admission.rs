//! Where admission stops: `max_model_len` and, without chunked prefill, the step's budget.

use super::*;

#[test]
fn a_request_of_exactly_max_model_len_tokens_is_accepted() {
    let mut s = Scheduler::new(config(8, 100, 32), 4, 8).unwrap();
    assert!(s.add_request(request(1, 30, 2)).is_ok(), "30 + 2 = 32 fits");
    assert!(
        s.add_request(request(2, 30, 3)).is_err(),
        "30 + 3 = 33 does not"
    );
    assert_eq!(s.num_requests(), 1);
}

#[test]
fn without_chunked_prefill_a_prompt_waits_until_the_rest_of_the_budget_holds_it_whole() {
    let cfg = SchedulerConfig {
        enable_chunked_prefill: false,
        ..config(8, 8, 8)
    };
    let mut h = Harness::new(cfg, 4, 16);
    h.sched.add_request(request(1, 2, 6)).unwrap();
    h.sched.add_request(request(2, 2, 2)).unwrap();
    assert_eq!(h.step().num_scheduled_tokens, vec![(1, 2), (2, 2)]);
    h.sched.add_request(request(3, 7, 1)).unwrap();
    // Two decodes leave 6 of 8 tokens: the 7-token prompt is not cut, it waits.
    assert_eq!(h.step().num_scheduled_tokens, vec![(1, 1), (2, 1)]);
    assert_eq!(h.finished[&2], FinishReason::Length);
    // One decode leaves 7: exactly the prompt.
    let out = h.step();
    assert_eq!(out.num_scheduled_tokens, vec![(1, 1), (3, 7)]);
    assert_eq!(out.started, vec![3]);
    h.run_to_completion();
    assert_eq!(h.outputs[&3], alone(&request(3, 7, 1)));
}
