//! The HTTP shell: sends one streaming request over the [`ConnectionPool`] and feeds the bytes,
//! with timestamps, to the pure `SseDecoder` and `RequestRecorder`. Never fails: every problem
//! becomes a failed `RequestOutcome` whose `error` says what happened.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::{Method, Response, StatusCode};
use serde_json::{Value, json};

use crate::config::EndpointKind;
use crate::connection::{Answer, Connection, ConnectionPool, HttpRequest, TransportError};
use crate::error::{Cause, Error};
use crate::prompts::{Prompt, RequestSpec};
use crate::record::{RequestOutcome, RequestRecorder, error_message};
use crate::sse::{SseDecoder, SseEvent};

/// How long to keep reading after `[DONE]` for the end of the body, so the connection can be
/// reused; a server that keeps the stream open longer is cut off.
const DRAIN_AFTER_DONE: Duration = Duration::from_millis(500);

/// `GET {base}/v1/models`.
fn models_request(pool: &ConnectionPool, api_key: Option<&str>) -> HttpRequest {
    HttpRequest {
        method: Method::GET,
        path: format!("{}/v1/models", pool.base_path()),
        bearer: api_key.map(str::to_string),
        json: None,
    }
}

/// `GET {base}/v1/models` and the first model's `id`, as vLLM does without `--model`.
pub async fn first_model(pool: &ConnectionPool, api_key: Option<&str>) -> Result<String, Error> {
    let request = models_request(pool, api_key);
    let url = pool.url(&request.path);
    let lookup_error = |reason: String, cause: Option<Cause>| Error::ModelLookup {
        url: url.clone(),
        reason,
        cause,
    };
    let deadline = pool.deadline();
    let answer = pool
        .send(&request, deadline)
        .await
        .map_err(|e| lookup_error(e.to_string(), Some(Box::new(e))))?;
    let status = answer.response.status();
    let body = read_text(pool, answer, &request.path, deadline)
        .await
        .map_err(|e| lookup_error(e.to_string(), Some(Box::new(e))))?;
    if !status.is_success() {
        return Err(lookup_error(describe_http_error(status, &body), None));
    }
    let value: Value = serde_json::from_str(&body)
        .map_err(|e| lookup_error(format!("the answer is not JSON ({e})"), Some(Box::new(e))))?;
    value
        .get("data")
        .and_then(Value::as_array)
        .and_then(|models| models.first())
        .and_then(|m| m.get("id"))
        .and_then(Value::as_str)
        .map(str::to_string)
        .ok_or_else(|| {
            lookup_error(
                "the answer lists no model (`data[0].id` missing)".into(),
                None,
            )
        })
}

/// The response header in which a server that runs on a dilated modeled clock (afd's `serve
/// --clock modeled --time-dilation K`) says its `K`.
pub const TIME_DILATION_HEADER: &str = "x-afd-time-dilation";

/// The header in which such a server says whether its dilation is settled (`false` while an
/// automatic one is still being measured).
pub const TIME_DILATION_SETTLED_HEADER: &str = "x-afd-time-dilation-settled";

/// The time dilation a response says its server runs at (`None`: an ordinary server).
pub fn time_dilation(headers: &hyper::HeaderMap) -> Option<f64> {
    headers
        .get(TIME_DILATION_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|k| k.is_finite() && *k > 0.0)
}

/// Asks a server that answered with a time dilation for it now, with `GET {base}/v1/models`:
/// the dilation and whether it is settled; `None` when it cannot be asked.
pub async fn server_time_dilation(
    pool: &ConnectionPool,
    api_key: Option<&str>,
) -> Option<(f64, bool)> {
    let request = models_request(pool, api_key);
    let deadline = pool.deadline();
    let answer = pool.send(&request, deadline).await.ok()?;
    let headers = answer.response.headers();
    let k = time_dilation(headers);
    let settled = headers
        .get(TIME_DILATION_SETTLED_HEADER)
        .and_then(|v| v.to_str().ok())
        .is_none_or(|v| v != "false");
    let _ = read_text(pool, answer, &request.path, deadline).await;
    k.map(|k| (k, settled))
}

/// The whole body of `answer` as text (invalid UTF-8 replaced); the connection goes back to
/// the pool when the body ended cleanly.
async fn read_text(
    pool: &ConnectionPool,
    answer: Answer,
    path: &str,
    deadline: tokio::time::Instant,
) -> Result<String, TransportError> {
    let Answer {
        response,
        connection,
        ..
    } = answer;
    match tokio::time::timeout_at(deadline, response.into_body().collect()).await {
        Ok(Ok(body)) => {
            pool.keep(connection);
            Ok(String::from_utf8_lossy(&body.to_bytes()).into_owned())
        }
        Ok(Err(e)) => Err(TransportError::Exchange {
            url: pool.url(path),
            reason: crate::connection::error_chain(&e),
        }),
        Err(_) => Err(pool.timed_out(path)),
    }
}

/// Everything a request needs besides its prompt.
#[derive(Debug, Clone)]
pub struct ApiClient {
    /// Shared connection pool.
    pub pool: ConnectionPool,
    /// Request path (base URL's path + endpoint path).
    pub api_path: String,
    /// Full request URL, for messages.
    pub api_url: String,
    /// Completions or chat.
    pub endpoint: EndpointKind,
    /// Model name sent.
    pub model: String,
    /// Bearer token.
    pub api_key: Option<String>,
    /// Send `ignore_eos: true`.
    pub ignore_eos: bool,
    /// Sampling temperature, if set.
    pub temperature: Option<f64>,
}
impl ApiClient {
    /// The JSON body for `spec`, shaped as vLLM's benchmark client sends it.
    pub fn payload(&self, spec: &RequestSpec) -> Value {
        let mut body = match self.endpoint {
            EndpointKind::Completions => {
                let prompt = match &spec.prompt {
                    Prompt::TokenIds(ids) => json!(ids),
                    Prompt::Text(text) => json!(text),
                };
                json!({
                    "model": self.model,
                    "prompt": prompt,
                    "max_tokens": spec.output_len,
                    "stream": true,
                    "stream_options": {"include_usage": true},
                })
            }
            EndpointKind::Chat => {
                let text = match &spec.prompt {
                    Prompt::Text(text) => text.clone(),
                    // Validation keeps token ids away from chat; send them readably if it slips.
                    Prompt::TokenIds(ids) => format!("{ids:?}"),
                };
                json!({
                    "model": self.model,
                    "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}],
                    "max_completion_tokens": spec.output_len,
                    "stream": true,
                    "stream_options": {"include_usage": true},
                })
            }
        };
        if let Some(obj) = body.as_object_mut() {
            if self.ignore_eos {
                obj.insert("ignore_eos".into(), json!(true));
            }
            if let Some(t) = self.temperature {
                obj.insert("temperature".into(), json!(t));
            }
        }
        body
    }

    /// Sends `spec` and measures it. `clock` is the run's time origin; `arrived_at` is when
    /// the request arrived (before any wait for a concurrency slot), in seconds from `clock`.
    /// A retry on a fresh connection (see [`crate::connection`]) is part of the same
    /// measurement: its times count from the first send.
    pub async fn send(
        &self,
        spec: &RequestSpec,
        clock: Instant,
        arrived_at: f64,
    ) -> RequestOutcome {
        let now = || clock.elapsed().as_secs_f64();
        let request = HttpRequest {
            method: Method::POST,
            path: self.api_path.clone(),
            bearer: self.api_key.clone(),
            json: Some(Bytes::from(self.payload(spec).to_string())),
        };
        let start = now();
        let deadline = self.pool.deadline();
        let failed = |reason: String, retried: bool| RequestOutcome {
            queue_time: start - arrived_at,
            retried,
            ..RequestOutcome::failed(start, now(), spec.prompt_len, reason)
        };
        let answer = match self.pool.send(&request, deadline).await {
            Ok(answer) => answer,
            Err(e) => return failed(e.to_string(), e.retried),
        };
        let retried = answer.retried;
        let status = answer.response.status();
        let dilation = time_dilation(answer.response.headers());
        if !status.is_success() {
            let text = read_text(&self.pool, answer, &request.path, deadline)
                .await
                .unwrap_or_default();
            return failed(describe_http_error(status, &text), retried);
        }
        let mut recorder =
            RequestRecorder::new(self.endpoint, start, start - arrived_at, spec.prompt_len);
        self.read_stream(
            answer.response,
            answer.connection,
            &mut recorder,
            now,
            deadline,
        )
        .await;
        let t = now();
        RequestOutcome {
            retried,
            time_dilation: dilation,
            ..recorder.finish(t)
        }
    }

    /// Feeds the event stream of `response` to `recorder` until it ends, breaks off, or
    /// `[DONE]` came and the body does not end soon after.
    async fn read_stream(
        &self,
        response: Response<Incoming>,
        connection: Connection,
        recorder: &mut RequestRecorder,
        now: impl Fn() -> f64,
        deadline: tokio::time::Instant,
    ) {
        let mut connection = Some(connection);
        let mut decoder = SseDecoder::new();
        let mut body = response.into_body();
        loop {
            let next = if recorder.is_finished() {
                match tokio::time::timeout(DRAIN_AFTER_DONE, body.frame()).await {
                    Ok(frame) => frame,
                    Err(_) => break,
                }
            } else {
                match tokio::time::timeout_at(deadline, body.frame()).await {
                    Ok(frame) => frame,
                    Err(_) => {
                        recorder.fail(format!(
                            "the stream broke off: {}",
                            self.pool.timed_out(&self.api_path)
                        ));
                        break;
                    }
                }
            };
            match next {
                None => {
                    // The body ended as HTTP/1.1 frames it: the connection can carry another.
                    if let Some(c) = connection.take() {
                        self.pool.keep(c);
                    }
                    break;
                }
                Some(Ok(frame)) => {
                    let Ok(bytes) = frame.into_data() else {
                        continue;
                    };
                    let t = now();
                    for event in decoder.push(&bytes) {
                        match event {
                            SseEvent::Data(data) => recorder.on_data(t, &data),
                            SseEvent::Done => recorder.on_done(),
                        }
                    }
                }
                Some(Err(e)) => {
                    let error = TransportError::Exchange {
                        url: self.api_url.clone(),
                        reason: crate::connection::error_chain(&e),
                    };
                    recorder.fail(format!("the stream broke off: {error}"));
                    break;
                }
            }
        }
        let t = now();
        match decoder.finish() {
            Some(SseEvent::Data(data)) => recorder.on_data(t, &data),
            Some(SseEvent::Done) => recorder.on_done(),
            None => {}
        }
    }
}

/// `HTTP 404 Not Found: <message>` with the message from an OpenAI/vLLM error body, or the
/// start of the body.
pub fn describe_http_error(status: StatusCode, body: &str) -> String {
    let detail = serde_json::from_str::<Value>(body)
        .ok()
        .and_then(|v| error_message(&v))
        .unwrap_or_else(|| body.trim().chars().take(300).collect());
    if detail.is_empty() {
        format!("HTTP {status}")
    } else {
        format!("HTTP {status}: {detail}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client(endpoint: EndpointKind) -> ApiClient {
        ApiClient {
            pool: ConnectionPool::new("http://x", Duration::from_secs(1)).unwrap(),
            api_path: "/v1/completions".into(),
            api_url: "http://x/v1/completions".into(),
            endpoint,
            model: "m".into(),
            api_key: None,
            ignore_eos: true,
            temperature: Some(0.0),
        }
    }

    #[test]
    fn completions_payload_matches_vllm_client() {
        let spec = RequestSpec {
            prompt: Prompt::TokenIds(vec![1, 2, 3]),
            prompt_len: 3,
            output_len: 16,
        };
        let body = client(EndpointKind::Completions).payload(&spec);
        assert_eq!(body["prompt"], json!([1, 2, 3]));
        assert_eq!(body["max_tokens"], 16);
        assert_eq!(body["stream"], true);
        assert_eq!(body["stream_options"]["include_usage"], true);
        assert_eq!(body["ignore_eos"], true);
        assert_eq!(body["temperature"], 0.0);
        assert_eq!(body["model"], "m");
    }

    #[test]
    fn chat_payload_uses_content_parts_and_max_completion_tokens() {
        let spec = RequestSpec {
            prompt: Prompt::Text("hi there".into()),
            prompt_len: 2,
            output_len: 4,
        };
        let mut c = client(EndpointKind::Chat);
        c.ignore_eos = false;
        let body = c.payload(&spec);
        assert_eq!(body["messages"][0]["role"], "user");
        assert_eq!(body["messages"][0]["content"][0]["type"], "text");
        assert_eq!(body["messages"][0]["content"][0]["text"], "hi there");
        assert_eq!(body["max_completion_tokens"], 4);
        assert!(body.get("max_tokens").is_none());
        assert!(body.get("ignore_eos").is_none());
    }

    #[test]
    fn http_errors_carry_the_server_message() {
        let s = describe_http_error(
            StatusCode::NOT_FOUND,
            r#"{"error":{"message":"model x not found","type":"NotFoundError","code":404}}"#,
        );
        assert_eq!(s, "HTTP 404 Not Found: NotFoundError: model x not found");
        let s = describe_http_error(StatusCode::BAD_GATEWAY, "  upstream down ");
        assert_eq!(s, "HTTP 502 Bad Gateway: upstream down");
        assert_eq!(
            describe_http_error(StatusCode::INTERNAL_SERVER_ERROR, ""),
            "HTTP 500 Internal Server Error"
        );
    }
}
