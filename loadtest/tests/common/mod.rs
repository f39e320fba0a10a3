//! A scripted OpenAI-compatible server for the tests: known delay to the first chunk and
//! between chunks (scheduled on absolute deadlines so sleeps do not drift), usage in the last
//! chunk, and failures on chosen requests.
#![allow(dead_code)]

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{Value, json};
use tokio::time::Instant;

use loadtest::{BenchmarkConfig, PromptConfig};

/// A benchmark of `num_prompts` requests (16-token id prompts, `output_len` tokens, ignore_eos,
/// no warm-up, so the server's request numbers are the measured requests) against `base_url`.
pub fn config(base_url: &str, num_prompts: usize, output_len: usize) -> BenchmarkConfig {
    BenchmarkConfig {
        base_url: base_url.to_string(),
        num_prompts,
        prompts: PromptConfig {
            input_len: 16,
            output_len,
            vocab_size: 500,
            ..PromptConfig::default()
        },
        ignore_eos: true,
        num_warmups: 0,
        ..BenchmarkConfig::default()
    }
}

/// What the server does. Request numbers count from 1 in arrival order at the server.
#[derive(Debug, Clone)]
pub struct Script {
    /// Name listed by /v1/models.
    pub model: String,
    /// Delay from request arrival to the first chunk.
    pub ttft: Duration,
    /// Delay between chunks.
    pub itl: Duration,
    /// Tokens each chunk stands for (usage counts tokens, not chunks).
    pub tokens_per_chunk: u64,
    /// Every k-th request waits this long for its first chunk instead.
    pub slow_every: Option<(usize, Duration)>,
    /// Every k-th request is answered with this HTTP status and an error body.
    pub http_error_every: Option<(usize, u16)>,
    /// Every k-th request sends one chunk, then an error event.
    pub stream_error_every: Option<usize>,
    /// Send the usage chunk.
    pub send_usage: bool,
    /// Status of GET /v1/models.
    pub models_status: u16,
}

impl Default for Script {
    fn default() -> Self {
        Script {
            model: "fake-model".into(),
            ttft: Duration::from_millis(100),
            itl: Duration::from_millis(20),
            tokens_per_chunk: 1,
            slow_every: None,
            http_error_every: None,
            stream_error_every: None,
            send_usage: true,
            models_status: 200,
        }
    }
}

pub struct Shared {
    pub script: Script,
    pub requests: AtomicUsize,
    /// Bodies of every completion request received.
    pub bodies: Mutex<Vec<Value>>,
}

pub struct FakeServer {
    pub base_url: String,
    pub shared: Arc<Shared>,
}

impl FakeServer {
    pub fn request_bodies(&self) -> Vec<Value> {
        self.shared.bodies.lock().unwrap().clone()
    }
}

/// Starts the server on 127.0.0.1 on a free port.
pub async fn start(script: Script) -> FakeServer {
    let shared = Arc::new(Shared {
        script,
        requests: AtomicUsize::new(0),
        bodies: Mutex::new(Vec::new()),
    });
    let app = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .with_state(Arc::clone(&shared));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    FakeServer {
        base_url: format!("http://{addr}"),
        shared,
    }
}

/// A base URL where nothing listens.
pub fn closed_port_url() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    format!("http://{addr}")
}

async fn models(State(s): State<Arc<Shared>>) -> Response {
    let status = StatusCode::from_u16(s.script.models_status).unwrap();
    if !status.is_success() {
        return error_response(status, "models are unavailable");
    }
    Json(json!({"object": "list", "data": [{"id": s.script.model, "object": "model", "root": s.script.model, "owned_by": "test"}]}))
        .into_response()
}

async fn completions(State(s): State<Arc<Shared>>, Json(body): Json<Value>) -> Response {
    let prompt_tokens = match &body["prompt"] {
        Value::Array(ids) => ids.len() as u64,
        Value::String(text) => text.split_whitespace().count() as u64,
        _ => 0,
    };
    let max_tokens = body["max_tokens"].as_u64().unwrap_or(16);
    respond(s, body, false, prompt_tokens, max_tokens)
}

async fn chat(State(s): State<Arc<Shared>>, Json(body): Json<Value>) -> Response {
    let prompt_tokens = body["messages"][0]["content"]
        .as_array()
        .map(|parts| {
            parts
                .iter()
                .filter_map(|p| p["text"].as_str())
                .map(|t| t.split_whitespace().count() as u64)
                .sum()
        })
        .unwrap_or(0);
    let max_tokens = body["max_completion_tokens"].as_u64().unwrap_or(16);
    respond(s, body, true, prompt_tokens, max_tokens)
}

fn error_response(status: StatusCode, message: &str) -> Response {
    let body = json!({"error": {"message": message, "type": "TestError", "param": null, "code": status.as_u16()}});
    (status, Json(body)).into_response()
}

fn respond(
    s: Arc<Shared>,
    body: Value,
    chat: bool,
    prompt_tokens: u64,
    max_tokens: u64,
) -> Response {
    let arrived = Instant::now();
    let n = s.requests.fetch_add(1, Ordering::SeqCst) + 1;
    s.bodies.lock().unwrap().push(body);
    let script = &s.script;
    let every = |k: usize| n.is_multiple_of(k);
    if let Some((k, status)) = script.http_error_every
        && every(k)
    {
        return error_response(StatusCode::from_u16(status).unwrap(), "scripted failure");
    }
    let ttft = match script.slow_every {
        Some((k, slow)) if every(k) => slow,
        _ => script.ttft,
    };
    let chunks = max_tokens.div_ceil(script.tokens_per_chunk).max(1);
    let chunk = |i: u64| -> String {
        let text: String = (0..script.tokens_per_chunk).map(|_| "tok ").collect();
        let payload = if chat {
            let delta = if i == 0 {
                json!({"role": "assistant", "content": text})
            } else {
                json!({"content": text})
            };
            json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": script.model,
                   "choices": [{"index": 0, "delta": delta, "finish_reason": null}]})
        } else {
            json!({"id": "cmpl-1", "object": "text_completion", "model": script.model,
                   "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": null}], "usage": null})
        };
        // Alternate `data: ` and `data:` and add keep-alive comments: clients must cope.
        if i.is_multiple_of(2) {
            format!(": keep-alive\n\ndata: {payload}\n\n")
        } else {
            format!("data:{payload}\n\n")
        }
    };
    let mut events: Vec<(Instant, String)> = Vec::new();
    let stream_error = script.stream_error_every.is_some_and(every);
    for i in 0..chunks {
        let at = arrived + ttft + script.itl * i as u32;
        events.push((at, chunk(i)));
        if stream_error {
            let err = json!({"error": {"message": "scripted stream failure", "type": "InternalServerError", "code": 500}});
            events.push((at, format!("data: {err}\n\ndata: [DONE]\n\n")));
            break;
        }
    }
    if !stream_error {
        let last = events.last().map(|e| e.0).unwrap_or(arrived);
        let mut tail = String::new();
        if script.send_usage {
            let usage = json!({"id": "cmpl-1", "choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens, "total_tokens": prompt_tokens + max_tokens}});
            tail.push_str(&format!("data: {usage}\n\n"));
        }
        tail.push_str("data: [DONE]\n\n");
        events.push((last, tail));
    }
    let stream = futures::stream::unfold(events.into_iter(), |mut events| async move {
        let (at, text) = events.next()?;
        tokio::time::sleep_until(at).await;
        Some((Ok::<_, Infallible>(Bytes::from(text)), events))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .body(Body::from_stream(stream))
        .unwrap()
}
