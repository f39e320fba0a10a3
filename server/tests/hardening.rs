//! Hostile and broken clients over raw TCP: every error the server answers itself carries the
//! OpenAI envelope (hyper's 400/414/431 included), bodies are bounded in size and time, heads
//! in time, and idle connections cannot lock normal requests out.

mod common;

use std::time::{Duration, Instant};

use common::*;
use router::fake::FakeNodeConfig;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Sends `bytes` on a fresh connection and reads until the server closes it (or `wait`
/// passes): what came back and how long it took.
async fn exchange(addr: std::net::SocketAddr, bytes: &[u8], wait: Duration) -> (Vec<u8>, Duration) {
    let started = Instant::now();
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tcp.write_all(bytes).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(wait, tcp.read_to_end(&mut out)).await;
    (out, started.elapsed())
}

/// The status and JSON body of a raw response.
fn parse(raw: &[u8]) -> (u16, String, Value) {
    let text = String::from_utf8_lossy(raw);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let json = serde_json::from_str(body).unwrap_or(Value::Null);
    (status, head.to_string(), json)
}

/// Asserts a raw answer is `status` with the envelope.
fn assert_envelope(raw: &[u8], status: u16) -> Value {
    let (got, head, v) = parse(raw);
    assert_eq!(got, status, "{}", String::from_utf8_lossy(raw));
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: application/json"),
        "{head}"
    );
    let e = &v["error"];
    assert_eq!(e["code"], status, "{v}");
    assert!(
        e["type"].as_str().is_some_and(|t| t.ends_with("Error")),
        "{v}"
    );
    assert!(e["message"].as_str().is_some_and(|m| m.len() > 20), "{v}");
    assert!(e.get("param").is_some(), "{v}");
    v
}

async fn completion_works(s: &TestServer) {
    let (status, v) = s
        .post("/v1/completions", json!({"prompt": "a", "max_tokens": 3}))
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 3);
}

const SECOND: Duration = Duration::from_secs(1);

#[tokio::test]
async fn errors_hyper_answers_by_itself_carry_the_envelope() {
    let s = start().await;
    let many_headers: String = (0..200).map(|i| format!("X-{i}: y\r\n")).collect();
    let long_path = "a".repeat(70_000);
    for (request, status) in [
        ("GARBAGE\r\n\r\n".to_string(), 400),
        ("GET / HTTP/9.9\r\n\r\n".to_string(), 400),
        (
            "GET /health HTTP/1.1\r\nBad Header\r\n\r\n".to_string(),
            400,
        ),
        (format!("GET /{long_path} HTTP/1.1\r\nHost: x\r\n\r\n"), 414),
        (format!("GET /health HTTP/1.1\r\n{many_headers}\r\n"), 431),
    ] {
        let (raw, _) = exchange(s.addr, request.as_bytes(), 5 * SECOND).await;
        assert_envelope(&raw, status);
    }
    // Axum's own: a wrong method on a known route, and unknown routes.
    let (raw, _) = exchange(
        s.addr,
        b"GET /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        5 * SECOND,
    )
    .await;
    assert_envelope(&raw, 405);
    assert!(parse(&raw).1.to_ascii_lowercase().contains("allow: post"));
    let (raw, _) = exchange(
        s.addr,
        b"DELETE /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        5 * SECOND,
    )
    .await;
    assert_envelope(&raw, 405);
    let (raw, _) = exchange(
        s.addr,
        b"GET /nothing HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        5 * SECOND,
    )
    .await;
    assert_envelope(&raw, 404);
    completion_works(&s).await;
}

#[tokio::test]
async fn bodies_are_bounded_and_must_be_json() {
    let s = start_configured(
        FakeNodeConfig::default(),
        vec![Box::new(router::fake::FakeNode::new(
            FakeNodeConfig::default(),
        ))],
        router_config(8, 16),
        |c| c.max_body_bytes = 1000,
    )
    .await;
    // Refused from Content-Length alone, before a byte of the body.
    let (raw, took) = exchange(
        s.addr,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
          Content-Length: 99999999999999\r\n\r\n{",
        10 * SECOND,
    )
    .await;
    let v = assert_envelope(&raw, 413);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("1000 bytes"),
        "{v}"
    );
    assert!(took < 5 * SECOND, "413 at once, took {took:?}");
    // Chunked, no length announced: refused once the limit is passed.
    let chunk = "a".repeat(1500);
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{chunk}\r\n0\r\n\r\n",
        chunk.len()
    );
    let (raw, _) = exchange(s.addr, request.as_bytes(), 5 * SECOND).await;
    assert_envelope(&raw, 413);
    for content_type in ["text/plain", "application/x-www-form-urlencoded"] {
        let r = s
            .client
            .post(s.url("/v1/completions"))
            .header("content-type", content_type)
            .body(r#"{"prompt": "a", "max_tokens": 1}"#)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 415);
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["type"], "UnsupportedMediaTypeError");
    }
    // No content type at all is read as JSON, as vLLM does.
    let r = s
        .client
        .post(s.url("/v1/completions"))
        .body(r#"{"prompt": "a", "max_tokens": 1}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
}

#[tokio::test]
async fn slow_heads_and_bodies_are_cut_off() {
    let s = start_configured(
        FakeNodeConfig::default(),
        vec![Box::new(router::fake::FakeNode::new(
            FakeNodeConfig::default(),
        ))],
        router_config(8, 16),
        |c| {
            c.header_timeout = Duration::from_millis(300);
            c.body_timeout = Duration::from_millis(300);
        },
    )
    .await;
    // Part of a head, then nothing: 408 and closed.
    let (raw, took) = exchange(s.addr, b"GET /health HTTP/1.1\r\nHost: x\r\n", 10 * SECOND).await;
    assert_envelope(&raw, 408);
    assert!(took < 5 * SECOND, "{took:?}");
    // A body shorter than announced: 408 and closed.
    let (raw, took) = exchange(
        s.addr,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
          Content-Length: 100\r\n\r\n{\"prompt\"",
        10 * SECOND,
    )
    .await;
    let v = assert_envelope(&raw, 408);
    assert!(
        v["error"]["message"].as_str().unwrap().contains("body"),
        "{v}"
    );
    assert!(took < 5 * SECOND, "{took:?}");
    // A connection that never sends, and a kept-alive one gone idle: closed without a word.
    let (raw, took) = exchange(s.addr, b"", 10 * SECOND).await;
    assert!(raw.is_empty(), "{}", String::from_utf8_lossy(&raw));
    assert!(took < 5 * SECOND, "{took:?}");
    let mut tcp = TcpStream::connect(s.addr).await.unwrap();
    tcp.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(10 * SECOND, tcp.read_to_end(&mut out))
        .await
        .expect("the idle connection is closed")
        .unwrap();
    let text = String::from_utf8_lossy(&out);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert_eq!(text.matches("HTTP/1.1").count(), 1, "{text}");
    completion_works(&s).await;
}

/// Opens `n` connections that send nothing.
async fn idle_connections(addr: std::net::SocketAddr, n: usize) -> Vec<TcpStream> {
    let mut open = Vec::with_capacity(n);
    for _ in 0..n {
        open.push(TcpStream::connect(addr).await.unwrap());
    }
    open
}

#[tokio::test]
async fn hundreds_of_idle_connections_do_not_lock_normal_requests_out() {
    // Room for them all.
    let s = start().await;
    let idle = idle_connections(s.addr, 500).await;
    for _ in 0..3 {
        completion_works(&s).await;
    }
    drop(idle);

    // Room for 64: the oldest idle ones make room, and a busy connection is never the one.
    let s = start_configured(
        FakeNodeConfig {
            step_delay: Duration::from_millis(5),
            ..Default::default()
        },
        vec![Box::new(router::fake::FakeNode::new(FakeNodeConfig {
            step_delay: Duration::from_millis(5),
            ..Default::default()
        }))],
        router_config(8, 16),
        |c| c.max_connections = Some(64),
    )
    .await;
    let streaming = s.spawn_post(
        "/v1/completions",
        json!({"prompt": "a", "max_tokens": 60, "stream": true, "ignore_eos": true,
               "return_token_ids": true}),
    );
    let mut idle = idle_connections(s.addr, 500).await;
    for _ in 0..3 {
        completion_works(&s).await;
    }
    let (status, sse) = streaming.await.unwrap();
    assert_eq!(status, 200);
    let events = parse_sse(sse.as_str().unwrap());
    assert_eq!(
        streamed_tokens(&chunks(&events)),
        60,
        "the busy stream was left alone"
    );
    // The first idle connections were closed to make room.
    let mut buf = [0u8; 1];
    let read = tokio::time::timeout(5 * SECOND, idle[0].read(&mut buf)).await;
    assert!(matches!(read, Ok(Ok(0)) | Ok(Err(_))), "{read:?}");
}
