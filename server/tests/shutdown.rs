//! Draining at a stop: new requests get 503 and `/health` says so, requests in flight finish;
//! at the deadline what still runs ends with an error (an SSE error event then `[DONE]`, or an
//! error JSON), and the server closes.

mod common;

use std::time::{Duration, Instant};

use common::*;
use futures::StreamExt;
use router::fake::{FakeNode, FakeNodeConfig};
use serde_json::{Value, json};

fn slow_node() -> FakeNodeConfig {
    FakeNodeConfig {
        step_delay: Duration::from_millis(10),
        ..Default::default()
    }
}

async fn slow_server(shutdown_timeout: Duration) -> TestServer {
    let node = slow_node();
    start_configured(
        node.clone(),
        vec![Box::new(FakeNode::new(node))],
        router_config(16, 64),
        |c| c.shutdown_timeout = shutdown_timeout,
    )
    .await
}

/// Starts a stream of `max_tokens` tokens and waits for its first chunk; the task returns
/// every SSE payload.
async fn open_stream(s: &TestServer, max_tokens: usize) -> tokio::task::JoinHandle<Vec<String>> {
    let r = s
        .client
        .post(s.url("/v1/completions"))
        .json(
            &json!({"prompt": "a", "max_tokens": max_tokens, "stream": true, "ignore_eos": true,
                       "return_token_ids": true}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let mut body = r.bytes_stream();
    let first = body.next().await.unwrap().unwrap();
    tokio::spawn(async move {
        let mut text = String::from_utf8_lossy(&first).into_owned();
        while let Some(Ok(bytes)) = body.next().await {
            text.push_str(&String::from_utf8_lossy(&bytes));
        }
        parse_sse(&text)
    })
}

/// A fresh client (no kept-alive connection to reuse) asking `path`.
async fn fresh(s: &TestServer, path: &str, body: Option<Value>) -> (u16, Value) {
    let client = reqwest::Client::new();
    let r = match body {
        Some(b) => client.post(s.url(path)).json(&b).send().await.unwrap(),
        None => client.get(s.url(path)).send().await.unwrap(),
    };
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

#[tokio::test]
async fn a_stop_refuses_new_work_and_lets_what_runs_finish() {
    let mut s = slow_server(Duration::from_secs(60)).await;
    let mut streams = Vec::new();
    for _ in 0..4 {
        streams.push(open_stream(&s, 60).await);
    }
    let plain = s.spawn_post(
        "/v1/completions",
        json!({"prompt": "b", "max_tokens": 40, "ignore_eos": true}),
    );
    tokio::time::sleep(Duration::from_millis(50)).await;
    let stopped = Instant::now();
    let running = s.stop();
    tokio::time::sleep(Duration::from_millis(20)).await;
    let (status, v) = fresh(&s, "/v1/completions", Some(json!({"prompt": "c"}))).await;
    assert_eq!(status, 503, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("draining"),
        "{v}"
    );
    let (status, v) = fresh(&s, "/health", None).await;
    assert_eq!(status, 503, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("draining"),
        "{v}"
    );
    assert_eq!(fresh(&s, "/metrics", None).await.0, 200, "metrics stay up");

    for stream in streams {
        let events = stream.await.unwrap();
        let chunks = chunks(&events);
        assert_eq!(streamed_tokens(&chunks), 60, "finished, not cut");
        assert_eq!(
            chunks.last().unwrap()["choices"][0]["finish_reason"],
            "length"
        );
    }
    let (status, v) = plain.await.unwrap();
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 40);
    let report = tokio::time::timeout(Duration::from_secs(30), running)
        .await
        .expect("the server closes once drained")
        .unwrap()
        .unwrap();
    assert!(report.in_flight >= 5, "{report:?}");
    assert_eq!(report.cut_off, 0, "{report:?}");
    assert!(
        stopped.elapsed() < Duration::from_secs(30),
        "did not wait for the deadline"
    );
    assert!(
        tokio::net::TcpStream::connect(s.addr).await.is_err(),
        "the listener is closed"
    );
}

#[tokio::test]
async fn at_the_deadline_what_still_runs_ends_with_an_error() {
    let mut s = slow_server(Duration::from_millis(300)).await;
    // 240 tokens at 10 ms a step: far past the deadline.
    let streams = [open_stream(&s, 240).await, open_stream(&s, 240).await];
    let plain = s.spawn_post(
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "a"}], "max_tokens": 200, "ignore_eos": true}),
    );
    tokio::time::sleep(Duration::from_millis(50)).await;
    let stopped = Instant::now();
    let running = s.stop();
    for stream in streams {
        cut_off_error(&stream.await.unwrap());
    }
    let (status, v) = plain.await.unwrap();
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["error"]["type"], "ServiceUnavailableError");
    let report = tokio::time::timeout(Duration::from_secs(30), running)
        .await
        .expect("the server closes after the deadline")
        .unwrap()
        .unwrap();
    assert!(report.cut_off >= 3, "{report:?}");
    let took = stopped.elapsed();
    assert!(took >= Duration::from_millis(300), "{took:?}");
    assert!(took < Duration::from_secs(20), "{took:?}");
}
