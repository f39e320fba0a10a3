//! Continuous batching over HTTP: concurrent requests, client disconnects, a full queue.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use router::fake::{FakeNodeConfig, StepGate};
use serde_json::{Value, json};

#[tokio::test]
async fn concurrent_requests_get_exactly_what_they_get_alone() {
    // Two attention nodes with small caches: batching, chunked prefill and preemption all happen.
    let node = FakeNodeConfig {
        block_size: 4,
        num_blocks: 80,
        ..Default::default()
    };
    let s = Arc::new(start_with(node, 2, router_config(16, 256)).await);
    let requests: Vec<(Vec<u32>, usize)> = (0..32u32)
        .map(|i| {
            (
                (0..1 + (i * 11) % 60)
                    .map(|t| 33 + (t * 7 + i) % 90)
                    .collect(),
                1 + (i as usize * 13) % 50,
            )
        })
        .collect();
    let tasks: Vec<_> = requests
        .iter()
        .enumerate()
        .map(|(i, (prompt, max_tokens))| {
            let s = Arc::clone(&s);
            let body = json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": true,
                              "stream": i % 2 == 0});
            tokio::spawn(async move {
                if i % 2 == 0 {
                    let c = chunks(&s.stream("/v1/completions", body).await);
                    c.iter().flat_map(|c| c["choices"][0]["token_ids"].as_array().unwrap().clone()).collect::<Vec<Value>>()
                } else {
                    let (status, v) = s.post("/v1/completions", body).await;
                    assert_eq!(status, 200, "{v}");
                    v["choices"][0]["token_ids"].as_array().unwrap().clone()
                }
            })
        })
        .collect();
    for (task, (prompt, max_tokens)) in tasks.into_iter().zip(&requests) {
        let got = task.await.unwrap();
        assert_eq!(json!(got), json!(s.expected(prompt, *max_tokens)));
    }
    let (_, text) = s.get("/metrics").await;
    for node in 0..2 {
        assert!(text.contains(&format!(
            "afd_node_healthy{{model_name=\"tiny\",node=\"{node}\"}} 1"
        )));
    }
    assert_eq!(s.metric("vllm:num_requests_running").await, Some(0.0));
    assert_eq!(s.metric("vllm:kv_cache_usage_perc").await, Some(0.0));
}

#[tokio::test]
async fn a_client_that_disconnects_mid_stream_frees_its_kv_blocks() {
    let node = FakeNodeConfig {
        step_delay: Duration::from_millis(2),
        ..Default::default()
    };
    let s = start_with(node, 1, router_config(8, 16)).await;
    let mut r = s
        .client
        .post(s.url("/v1/completions"))
        .json(&json!({"prompt": "a long story", "max_tokens": 240, "stream": true}))
        .send()
        .await
        .unwrap();
    r.chunk().await.unwrap().unwrap();
    s.wait_metric("vllm:kv_cache_usage_perc", |v| v > 0.0).await;
    assert_eq!(s.metric("vllm:num_requests_running").await, Some(1.0));
    drop(r);
    s.wait_metric("vllm:kv_cache_usage_perc", |v| v == 0.0)
        .await;
    assert_eq!(s.metric("vllm:num_requests_running").await, Some(0.0));
    s.wait_metric(
        "vllm:request_success_total{model_name=\"tiny\",finished_reason=\"abort\"}",
        |v| v == 1.0,
    )
    .await;
    let generated = s.metric("vllm:generation_tokens_total").await.unwrap();
    assert!(
        generated < 240.0,
        "aborted early, not run to the end: {generated}"
    );
}

#[tokio::test]
async fn a_full_queue_answers_429_and_the_server_keeps_serving() {
    let gate = StepGate::new();
    let node = FakeNodeConfig {
        gate: Some(Arc::clone(&gate)),
        ..Default::default()
    };
    // One running sequence at a time, one waiting.
    let s = Arc::new(start_with(node, 1, router_config(1, 1)).await);
    gate.pause();
    let first = {
        let s = Arc::clone(&s);
        tokio::spawn(async move {
            s.post("/v1/completions", json!({"prompt": "a", "max_tokens": 3}))
                .await
        })
    };
    // Held in its first step, so it has started.
    s.wait_metric("vllm:num_requests_running", |v| v == 1.0)
        .await;
    let second = {
        let s = Arc::clone(&s);
        tokio::spawn(async move {
            s.post("/v1/completions", json!({"prompt": "b", "max_tokens": 3}))
                .await
        })
    };
    s.wait_metric("vllm:num_requests_waiting", |v| v == 1.0)
        .await;
    let (status, v) = s
        .post("/v1/completions", json!({"prompt": "c", "max_tokens": 3}))
        .await;
    assert_eq!(status, 429, "{v}");
    assert_eq!(v["error"]["code"], 429);
    assert!(v["error"]["message"].as_str().unwrap().contains("retry"));
    let r = s
        .client
        .post(s.url("/v1/completions"))
        .json(&json!({"prompt": "c", "max_tokens": 3}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 429);
    assert_eq!(r.headers()["retry-after"], "1", "429 says when to retry");
    gate.resume();
    assert_eq!(first.await.unwrap().0, 200);
    assert_eq!(second.await.unwrap().0, 200);
    let (status, _) = s
        .post("/v1/completions", json!({"prompt": "d", "max_tokens": 3}))
        .await;
    assert_eq!(status, 200, "still serving after refusing");
}

#[tokio::test]
async fn a_request_that_can_never_be_admitted_is_400_naming_the_limit() {
    let s = start_with(FakeNodeConfig::default(), 1, router_config(4, 8)).await;
    let chat = json!({"messages": [{"role": "user", "content": "a"}], "n": 9, "max_tokens": 2});
    let completions = json!({"prompt": vec!["a"; 12], "max_tokens": 2});
    let pairs = json!({"prompt": vec!["a"; 3], "n": 3, "max_tokens": 2});
    for (path, body, sequences) in [
        ("/v1/chat/completions", chat, 9),
        ("/v1/completions", completions, 12),
        ("/v1/completions", pairs, 9),
    ] {
        let (status, v) = s.post(path, body).await;
        assert_eq!(status, 400, "{v}");
        assert_eq!(v["error"]["type"], "BadRequestError");
        let message = v["error"]["message"].as_str().unwrap();
        for part in [
            &format!("{sequences} sequences"),
            "max_waiting 8",
            "--max-waiting",
        ] {
            assert!(message.contains(part), "{part}: {message}");
        }
    }
    // Exactly the limit is admitted and served.
    let (status, v) = s
        .post(
            "/v1/completions",
            json!({"prompt": vec!["a"; 4], "n": 2, "max_tokens": 2}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"].as_array().unwrap().len(), 8);
}

#[tokio::test]
async fn a_refused_request_takes_no_waiting_slot_from_the_next_client() {
    let gate = StepGate::new();
    let node = FakeNodeConfig {
        gate: Some(Arc::clone(&gate)),
        ..Default::default()
    };
    // One running sequence, eight waiting slots.
    let s = Arc::new(start_with(node, 1, router_config(1, 8)).await);
    gate.pause();
    let post = |body: Value| {
        let s = Arc::clone(&s);
        tokio::spawn(async move { s.post("/v1/completions", body).await })
    };
    let first = post(json!({"prompt": "a", "max_tokens": 2}));
    s.wait_metric("vllm:num_requests_running", |v| v == 1.0)
        .await;
    let five = post(json!({"prompt": vec!["b"; 5], "max_tokens": 2}));
    s.wait_metric("vllm:num_requests_waiting", |v| v == 5.0)
        .await;
    // Four more do not fit now: refused whole...
    let (status, v) = s
        .post(
            "/v1/completions",
            json!({"prompt": vec!["c"; 4], "max_tokens": 2}),
        )
        .await;
    assert_eq!(status, 429, "{v}");
    // ... leaving all three free slots to the next clients, at once.
    let singles: Vec<_> = (0..3)
        .map(|_| post(json!({"prompt": "d", "max_tokens": 2})))
        .collect();
    s.wait_metric("vllm:num_requests_waiting", |v| v == 8.0)
        .await;
    gate.resume();
    assert_eq!(first.await.unwrap().0, 200);
    assert_eq!(five.await.unwrap().0, 200);
    for single in singles {
        let (status, v) = single.await.unwrap();
        assert_eq!(status, 200, "{v}");
    }
}
