//! The router's async shell with fake nodes: admission, least-loaded placement, cancellation,
//! and results that do not depend on batching.

use std::sync::Arc;
use std::time::{Duration, Instant};

use model::sampling::SamplingParams;
use router::fake::{FakeNode, FakeNodeConfig, StepGate};
use router::{Error, GenerationRequest, Router, RouterConfig, SchedulerConfig, SequenceParams};
use step::Penalties;
use step::{AttentionNode, SampleRequest};

fn request(prompt: Vec<u32>, max_tokens: usize) -> GenerationRequest {
    GenerationRequest {
        prompt,
        params: SequenceParams {
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
        },
        arrival: Instant::now(),
    }
}

fn config(max_num_seqs: usize, max_waiting: usize) -> RouterConfig {
    RouterConfig {
        scheduler: SchedulerConfig {
            max_num_seqs,
            max_num_batched_tokens: 64,
            max_model_len: 512,
            enable_chunked_prefill: true,
            enable_prefix_caching: true,
        },
        max_waiting,
    }
}

fn fake(cfg: &FakeNodeConfig) -> Box<dyn AttentionNode> {
    Box::new(FakeNode::new(cfg.clone()))
}

async fn collect(router: &Router, req: GenerationRequest) -> Vec<u32> {
    let mut stream = router.submit(req).unwrap();
    let mut out = Vec::new();
    while let Some(ev) = stream.next().await {
        out.push(ev.unwrap().token);
    }
    out
}

/// Polls `cond` on the router's stats until it holds (at most 10 s).
async fn wait_for(router: &Router, what: &str, cond: impl Fn(&router::RouterStats) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let stats = router.stats();
        if cond(&stats) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}: {stats:?}"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[tokio::test]
async fn concurrent_requests_get_what_they_get_alone() {
    let node_cfg = FakeNodeConfig {
        block_size: 4,
        num_blocks: 200,
        ..Default::default()
    };
    let prompts: Vec<(Vec<u32>, usize)> = (0..32u32)
        .map(|i| {
            (
                (0..1 + (i * 13) % 50).map(|t| 40 + (t * i) % 80).collect(),
                1 + (i as usize * 7) % 40,
            )
        })
        .collect();
    let alone_router = Router::start(config(1, 100), vec![fake(&node_cfg)]).unwrap();
    let mut expected = Vec::new();
    for (p, n) in &prompts {
        expected.push(collect(&alone_router, request(p.clone(), *n)).await);
    }
    // Two nodes, small blocks, a tight cache: batching, chunking and preemption all happen.
    let router =
        Arc::new(Router::start(config(16, 100), vec![fake(&node_cfg), fake(&node_cfg)]).unwrap());
    let tasks: Vec<_> = prompts
        .iter()
        .map(|(p, n)| {
            let r = Arc::clone(&router);
            let req = request(p.clone(), *n);
            tokio::spawn(async move { collect(&r, req).await })
        })
        .collect();
    for (task, want) in tasks.into_iter().zip(&expected) {
        let got = task.await.unwrap();
        assert_eq!(&got, want);
    }
    let stats = router.stats();
    assert!(
        stats
            .nodes
            .iter()
            .all(|n| n.scheduler.generation_tokens_total > 0),
        "both nodes served: {stats:?}"
    );
    assert_eq!(stats.running(), 0);
}

#[tokio::test]
async fn new_requests_go_to_the_least_loaded_node() {
    let gate = StepGate::new();
    gate.pause();
    let cfg = FakeNodeConfig {
        gate: Some(Arc::clone(&gate)),
        ..Default::default()
    };
    let router = Router::start(config(8, 100), vec![fake(&cfg), fake(&cfg), fake(&cfg)]).unwrap();
    let streams: Vec<_> = (0..6)
        .map(|i| router.submit(request(vec![50 + i], 4)).unwrap())
        .collect();
    let nodes: Vec<usize> = streams.iter().map(|s| s.node()).collect();
    assert_eq!(nodes, vec![0, 1, 2, 0, 1, 2]);
    let loads: Vec<usize> = router.stats().nodes.iter().map(|n| n.load).collect();
    assert_eq!(loads, vec![2, 2, 2]);
    gate.resume();
    for mut s in streams {
        while s.next().await.is_some() {}
    }
    wait_for(&router, "loads back to 0", |s| {
        s.nodes.iter().all(|n| n.load == 0)
    })
    .await;
}

#[tokio::test]
async fn a_full_queue_refuses_and_the_router_keeps_serving() {
    let gate = StepGate::new();
    let cfg = FakeNodeConfig {
        gate: Some(Arc::clone(&gate)),
        ..Default::default()
    };
    let router = Router::start(config(1, 1), vec![fake(&cfg)]).unwrap();
    gate.pause();
    let first = router.submit(request(vec![60, 61], 50)).unwrap();
    // The engine has started the first request and is held in its first step.
    wait_for(&router, "the first request to start", |s| {
        s.nodes[0].not_started == 0
    })
    .await;
    // max_num_seqs is 1: the second waits; the third finds the queue (limit 1) full.
    let second = router.submit(request(vec![62], 3)).unwrap();
    match router.submit(request(vec![63], 3)) {
        Err(Error::QueueFull {
            waiting: 1,
            asked: 1,
            limit: 1,
        }) => {}
        other => panic!("expected QueueFull, got {other:?}"),
    }
    gate.resume();
    drop(first);
    let mut second = second;
    let mut n = 0;
    while let Some(ev) = second.next().await {
        ev.unwrap();
        n += 1;
    }
    assert_eq!(n, 3);
    assert_eq!(
        collect(&router, request(vec![64], 2)).await.len(),
        2,
        "still serving"
    );
}

#[tokio::test]
async fn dropping_the_stream_aborts_and_frees_blocks() {
    let cfg = FakeNodeConfig {
        step_delay: Duration::from_millis(1),
        ..Default::default()
    };
    let router = Router::start(config(4, 100), vec![fake(&cfg)]).unwrap();
    let mut stream = router.submit(request((40..80).collect(), 400)).unwrap();
    stream.next().await.unwrap().unwrap();
    assert!(router.stats().nodes[0].scheduler.kv_blocks_used > 0);
    drop(stream);
    wait_for(&router, "blocks freed", |s| {
        s.nodes[0].scheduler.kv_blocks_used == 0 && s.nodes[0].load == 0 && s.running() == 0
    })
    .await;
}

#[tokio::test]
async fn an_explicit_abort_frees_blocks() {
    let cfg = FakeNodeConfig {
        step_delay: Duration::from_millis(1),
        ..Default::default()
    };
    let router = Router::start(config(4, 100), vec![fake(&cfg)]).unwrap();
    let mut stream = router.submit(request(vec![70; 20], 400)).unwrap();
    stream.next().await.unwrap().unwrap();
    stream.abort();
    wait_for(&router, "blocks freed", |s| {
        s.nodes[0].scheduler.kv_blocks_used == 0
    })
    .await;
}

#[tokio::test]
async fn invalid_configurations_are_refused() {
    let cfg = FakeNodeConfig {
        block_size: 4,
        num_blocks: 10,
        ..Default::default()
    };
    let err = Router::start(config(4, 10), vec![fake(&cfg)]).unwrap_err();
    assert!(err.to_string().contains("max_model_len"), "{err}");
    assert!(matches!(
        Router::start(config(4, 10), Vec::new()),
        Err(Error::NoNodes)
    ));
}

/// A router whose only node is held in the step of a first request (max_num_seqs 1), so every
/// later request waits and admission alone decides what is refused.
async fn held_router(max_waiting: usize) -> (Router, Arc<StepGate>, router::RequestStream) {
    let gate = StepGate::new();
    let cfg = FakeNodeConfig {
        gate: Some(Arc::clone(&gate)),
        ..Default::default()
    };
    let router = Router::start(config(1, max_waiting), vec![fake(&cfg)]).unwrap();
    gate.pause();
    let first = router.submit(request(vec![60, 61], 50)).unwrap();
    wait_for(&router, "the first request to start", |s| {
        s.nodes[0].not_started == 0
    })
    .await;
    (router, gate, first)
}

fn group(size: usize) -> Vec<GenerationRequest> {
    (0..size).map(|i| request(vec![70 + i as u32], 2)).collect()
}

#[tokio::test]
async fn a_group_larger_than_the_queue_is_refused_as_never_fitting_and_leaves_no_trace() {
    let (router, gate, first) = held_router(8).await;
    match router.submit_all(group(9)) {
        Err(Error::TooManySequences {
            sequences: 9,
            limit: 8,
        }) => {}
        other => panic!("expected TooManySequences, got {other:?}"),
    }
    assert!(router.check_sequences(9).is_err());
    assert!(router.check_sequences(8).is_ok());
    // Every slot is still free: a group of exactly the limit is admitted at once.
    let all = router.submit_all(group(8)).unwrap();
    assert_eq!(all.len(), 8);
    assert_eq!(router.stats().nodes[0].not_started, 8);
    gate.resume();
    drop(first);
    for mut s in all {
        let mut n = 0;
        while let Some(ev) = s.next().await {
            ev.unwrap();
            n += 1;
        }
        assert_eq!(n, 2);
    }
}

#[tokio::test]
async fn a_group_that_does_not_fit_now_takes_no_slot_from_the_next_client() {
    let (router, gate, first) = held_router(8).await;
    let five = router.submit_all(group(5)).unwrap();
    match router.submit_all(group(4)) {
        Err(Error::QueueFull {
            waiting: 5,
            asked: 4,
            limit: 8,
        }) => {}
        other => panic!("expected QueueFull, got {other:?}"),
    }
    // Nothing of the refused group was queued: the next three single requests all get in,
    // right away, and only then is the queue full.
    let singles: Vec<_> = (0..3)
        .map(|i| router.submit(request(vec![90 + i], 2)).unwrap())
        .collect();
    assert!(matches!(
        router.submit(request(vec![99], 2)),
        Err(Error::QueueFull { waiting: 8, .. })
    ));
    assert_eq!(router.stats().nodes[0].not_started, 8);
    gate.resume();
    drop(first);
    for mut s in five.into_iter().chain(singles) {
        while let Some(ev) = s.next().await {
            ev.unwrap();
        }
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(24))]
    /// Admission is all-or-nothing: while nothing starts, a group is admitted exactly when it
    /// fits beside what is already waiting, a refused group changes nothing, and the waiting
    /// count never passes the limit.
    #[test]
    fn groups_are_admitted_whole_or_not_at_all(
        limit in 1usize..12,
        sizes in proptest::collection::vec(1usize..8, 1..12),
    ) {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        runtime.block_on(async {
            let (router, gate, first) = held_router(limit).await;
            let mut waiting = 0;
            let mut kept = Vec::new();
            for size in sizes {
                let result = router.submit_all(group(size));
                match result {
                    Ok(streams) => {
                        assert!(waiting + size <= limit);
                        assert_eq!(streams.len(), size);
                        waiting += size;
                        kept.extend(streams);
                    }
                    Err(Error::TooManySequences { .. }) => assert!(size > limit),
                    Err(Error::QueueFull { waiting: w, asked, .. }) => {
                        assert!(size <= limit && waiting + size > limit);
                        assert_eq!((w, asked), (waiting, size));
                    }
                    Err(e) => panic!("{e}"),
                }
                assert_eq!(router.stats().nodes[0].not_started, waiting);
            }
            gate.resume();
            drop(first);
            drop(kept);
        });
    }
}

#[tokio::test]
async fn shutdown_ends_running_requests_and_joins_the_engines() {
    let cfg = FakeNodeConfig {
        step_delay: Duration::from_millis(2),
        ..Default::default()
    };
    let router = Router::start(config(4, 16), vec![fake(&cfg), fake(&cfg)]).unwrap();
    let mut a = router.submit(request(vec![40, 41], 400)).unwrap();
    let mut b = router.submit(request(vec![42], 400)).unwrap();
    a.next().await.unwrap().unwrap();
    b.next().await.unwrap().unwrap();
    let router = Arc::new(router);
    let stopping = {
        let router = Arc::clone(&router);
        tokio::task::spawn_blocking(move || router.shutdown(Duration::from_secs(10)))
    };
    for stream in [&mut a, &mut b] {
        let mut last = None;
        while let Some(ev) = stream.next().await {
            last = Some(ev);
        }
        assert_eq!(last, Some(Err(router::GenerationError::Shutdown)));
    }
    assert!(stopping.await.unwrap(), "both engine threads ended");
    assert!(!router.is_healthy());
    assert!(matches!(
        router.submit(request(vec![43], 2)),
        Err(Error::NodeDown { .. })
    ));
}
