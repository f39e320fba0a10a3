//! Servers that close kept-alive connections, as llama.cpp's llama-server does: a hand-written
//! HTTP/1.1 server on a tokio listener answers a set number of requests per connection and then
//! closes it without a `Connection: close` header. afd-loadtest must complete every request,
//! sending one again on a fresh connection only when its kept-alive one failed before any byte
//! of the answer arrived, and never after bytes arrived.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use common::config;
use loadtest::{BenchmarkConfig, BenchmarkResult, run_benchmark};

/// What the server does with each connection.
#[derive(Debug, Clone, Copy)]
struct Behaviour {
    /// Requests answered on one connection before it is closed.
    answers_per_connection: usize,
    /// What follows the last answer on a connection.
    after_last: AfterLast,
    /// Send the answer's head and one token chunk, then close: the request fails after bytes.
    break_mid_stream: bool,
}

#[derive(Debug, Clone, Copy)]
enum AfterLast {
    /// Close at once.
    Close,
    /// Close a little later, as a server does that closes from another thread: a client
    /// sending at once has written its next request by then.
    CloseAfter(Duration),
    /// Read the next request, then close (so it certainly went out on the reused connection
    /// and got no byte back).
    SwallowNext,
}

#[derive(Default)]
struct Counts {
    connections: AtomicUsize,
    requests_read: AtomicUsize,
    answered: AtomicUsize,
}

struct ClosingServer {
    base_url: String,
    counts: Arc<Counts>,
}

async fn start(behaviour: Behaviour) -> ClosingServer {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base_url = format!("http://{}", listener.local_addr().unwrap());
    let counts = Arc::new(Counts::default());
    let shared = Arc::clone(&counts);
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            shared.connections.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(serve_connection(stream, behaviour, Arc::clone(&shared)));
        }
    });
    ClosingServer { base_url, counts }
}

async fn serve_connection(mut stream: TcpStream, behaviour: Behaviour, counts: Arc<Counts>) {
    let mut buffered = Vec::new();
    for answered_here in 0.. {
        let Some(output_len) = read_request(&mut stream, &mut buffered).await else {
            return;
        };
        counts.requests_read.fetch_add(1, Ordering::SeqCst);
        if answered_here == behaviour.answers_per_connection {
            return; // swallowed: closed without a byte of answer
        }
        if behaviour.break_mid_stream {
            let _ = stream.write_all(&answer(output_len, true)).await;
            return;
        }
        // Counted before the write: the client may read the last byte and end its run before
        // this task runs again, and the test then reads the counts.
        counts.answered.fetch_add(1, Ordering::SeqCst);
        if stream.write_all(&answer(output_len, false)).await.is_err() {
            counts.answered.fetch_sub(1, Ordering::SeqCst);
            return;
        }
        if answered_here + 1 == behaviour.answers_per_connection {
            // Closed after the answer, which said nothing of it (no `Connection: close`).
            match behaviour.after_last {
                AfterLast::Close => return,
                AfterLast::CloseAfter(delay) => {
                    tokio::time::sleep(delay).await;
                    return;
                }
                AfterLast::SwallowNext => {}
            }
        }
    }
}

/// Reads one request (head and `Content-Length` body); its `max_tokens`, or `None` at EOF.
async fn read_request(stream: &mut TcpStream, buffered: &mut Vec<u8>) -> Option<usize> {
    let head_end = loop {
        if let Some(i) = buffered.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        read_more(stream, buffered).await?;
    };
    let head = String::from_utf8_lossy(&buffered[..head_end]).to_ascii_lowercase();
    let body_len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    while buffered.len() < head_end + body_len {
        read_more(stream, buffered).await?;
    }
    let body: serde_json::Value =
        serde_json::from_slice(&buffered[head_end..head_end + body_len]).ok()?;
    buffered.drain(..head_end + body_len);
    body["max_tokens"].as_u64().map(|n| n as usize)
}

async fn read_more(stream: &mut TcpStream, buffered: &mut Vec<u8>) -> Option<()> {
    let mut chunk = [0u8; 4096];
    match stream.read(&mut chunk).await {
        Ok(0) | Err(_) => None,
        Ok(n) => {
            buffered.extend_from_slice(&chunk[..n]);
            Some(())
        }
    }
}

/// A streamed completion of `output_len` one-token chunks, usage and `[DONE]`, chunked; cut
/// after its first token chunk when `broken`.
fn answer(output_len: usize, broken: bool) -> Vec<u8> {
    let mut events: Vec<String> = (0..output_len)
        .map(|i| format!(r#"{{"choices":[{{"index":0,"text":"t{i} "}}]}}"#))
        .collect();
    events.push(format!(
        r#"{{"choices":[],"usage":{{"prompt_tokens":16,"completion_tokens":{output_len}}}}}"#
    ));
    events.push("[DONE]".into());
    let mut out =
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            .to_vec();
    for (i, event) in events.iter().enumerate() {
        let data = format!("data: {event}\n\n");
        out.extend_from_slice(format!("{:x}\r\n{data}\r\n", data.len()).as_bytes());
        if broken && i == 0 {
            return out;
        }
    }
    out.extend_from_slice(b"0\r\n\r\n");
    out
}

fn cfg(server: &ClosingServer, requests: usize, concurrency: usize) -> BenchmarkConfig {
    BenchmarkConfig {
        model: Some("m".into()),
        max_concurrency: Some(concurrency),
        ..config(&server.base_url, requests, 4)
    }
}

fn assert_all_completed(r: &BenchmarkResult, requests: usize) {
    assert_eq!(
        (r.completed, r.failed),
        (requests, 0),
        "failures: {:?}",
        r.failure_reasons
    );
    assert_eq!(r.total_output_tokens, 4 * requests as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_closing_after_every_response_loses_no_request() {
    for concurrency in [1, 4] {
        let server = start(Behaviour {
            answers_per_connection: 1,
            after_last: AfterLast::Close,
            break_mid_stream: false,
        })
        .await;
        let r = run_benchmark(&cfg(&server, 24, concurrency)).await.unwrap();
        assert_all_completed(&r, 24);
        assert_eq!(server.counts.answered.load(Ordering::SeqCst), 24);
        // One connection per answer: a request that met a closed one went out on a new one.
        assert_eq!(server.counts.connections.load(Ordering::SeqCst), 24);
        assert!(r.retried_requests <= 24, "{}", r.retried_requests);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_closing_abruptly_after_n_requests_loses_no_request() {
    for concurrency in [1, 4] {
        let server = start(Behaviour {
            answers_per_connection: 5,
            after_last: AfterLast::CloseAfter(Duration::from_millis(10)),
            break_mid_stream: false,
        })
        .await;
        let r = run_benchmark(&cfg(&server, 32, concurrency)).await.unwrap();
        assert_all_completed(&r, 32);
        assert_eq!(server.counts.answered.load(Ordering::SeqCst), 32);
        // A retry always opens a connection of its own.
        let connections = server.counts.connections.load(Ordering::SeqCst);
        assert!(r.retried_requests < connections, "{}", r.retried_requests);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_the_closing_server_read_but_never_answered_is_sent_again_once() {
    // Three answers per connection, then the fourth request is read and the connection closed:
    // at concurrency 1 requests 4, 7 and 10 meet a closing connection and go out again.
    let server = start(Behaviour {
        answers_per_connection: 3,
        after_last: AfterLast::SwallowNext,
        break_mid_stream: false,
    })
    .await;
    let r = run_benchmark(&cfg(&server, 10, 1)).await.unwrap();
    assert_all_completed(&r, 10);
    assert_eq!(r.retried_requests, 3);
    assert_eq!(server.counts.requests_read.load(Ordering::SeqCst), 13);
    assert_eq!(server.counts.connections.load(Ordering::SeqCst), 4);
    let json: serde_json::Value = serde_json::from_str(&r.to_json_pretty()).unwrap();
    assert_eq!(json["retried_requests"], 3);

    // Concurrent requests: still every one completed, each swallowed one sent once more.
    let server = start(Behaviour {
        answers_per_connection: 3,
        after_last: AfterLast::SwallowNext,
        break_mid_stream: false,
    })
    .await;
    let r = run_benchmark(&cfg(&server, 40, 4)).await.unwrap();
    assert_all_completed(&r, 40);
    let read = server.counts.requests_read.load(Ordering::SeqCst);
    assert_eq!(read - 40, r.retried_requests);
    assert!(r.retried_requests > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_is_never_sent_again_after_bytes_of_its_answer_arrived() {
    let server = start(Behaviour {
        answers_per_connection: 1,
        after_last: AfterLast::Close,
        break_mid_stream: true,
    })
    .await;
    let r = run_benchmark(&cfg(&server, 6, 1)).await.unwrap();
    assert_eq!((r.completed, r.failed, r.retried_requests), (0, 6, 0));
    assert_eq!(server.counts.requests_read.load(Ordering::SeqCst), 6);
    assert!(
        r.errors.iter().all(|e| e.contains("the stream broke off")),
        "{:?}",
        r.errors
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_connection_closed_without_an_answer_is_not_tried_again() {
    // Every connection is closed after reading its first request: no connection is ever
    // reused, so nothing qualifies for a second try.
    let server = start(Behaviour {
        answers_per_connection: 0,
        after_last: AfterLast::SwallowNext,
        break_mid_stream: false,
    })
    .await;
    let r = run_benchmark(&cfg(&server, 5, 1)).await.unwrap();
    assert_eq!((r.completed, r.failed, r.retried_requests), (0, 5, 0));
    assert_eq!(server.counts.requests_read.load(Ordering::SeqCst), 5);
    assert!(
        r.errors
            .iter()
            .all(|e| e.contains("closed before message completed")),
        "{:?}",
        r.errors
    );
}
