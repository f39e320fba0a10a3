//! The HTTP shell: sends one streaming request and feeds the bytes, with timestamps, to the
//! pure `SseDecoder` and `RequestRecorder`. Never fails: every problem becomes a failed
//! `RequestOutcome` whose `error` says what happened.

use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{Value, json};

use crate::config::EndpointKind;
use crate::error::Error;
use crate::prompts::{Prompt, RequestSpec};
use crate::record::{RequestOutcome, RequestRecorder, error_message};
use crate::sse::{SseDecoder, SseEvent};

/// How long to keep reading after `[DONE]` for the end of the body, so the connection can be
/// reused; a server that keeps the stream open longer is cut off.
const DRAIN_AFTER_DONE: Duration = Duration::from_millis(500);

/// Builds the shared HTTP client: keep-alive pool, no Nagle delay, the request timeout.
pub fn build_http_client(request_timeout: Duration) -> Result<reqwest::Client, Error> {
    reqwest::Client::builder()
        .timeout(request_timeout)
        .connect_timeout(Duration::from_secs(30).min(request_timeout))
        .tcp_nodelay(true)
        .pool_idle_timeout(Duration::from_secs(90))
        .build()
        .map_err(|e| Error::HttpClient(error_chain(&e)))
}

/// `GET {base}/v1/models` and the first model's `id`, as vLLM does without `--model`.
pub async fn first_model(
    http: &reqwest::Client,
    base_url: &str,
    api_key: Option<&str>,
) -> Result<String, Error> {
    let url = format!("{}/v1/models", base_url.trim_end_matches('/'));
    let lookup_error = |reason: String| Error::ModelLookup {
        url: url.clone(),
        reason,
    };
    let mut request = http.get(&url);
    if let Some(key) = api_key {
        request = request.bearer_auth(key);
    }
    let response = request
        .send()
        .await
        .map_err(|e| lookup_error(describe_transport_error(&e, &url)))?;
    let status = response.status();
    let body = response
        .text()
        .await
        .map_err(|e| lookup_error(describe_transport_error(&e, &url)))?;
    if !status.is_success() {
        return Err(lookup_error(describe_http_error(status, &body)));
    }
    let value: Value = serde_json::from_str(&body)
        .map_err(|e| lookup_error(format!("the answer is not JSON ({e})")))?;
    value
        .get("data")
        .and_then(Value::as_array)
        .and_then(|models| models.first())
        .and_then(|m| m.get("id"))
        .and_then(Value::as_str)
        .map(str::to_string)
        .ok_or_else(|| lookup_error("the answer lists no model (`data[0].id` missing)".into()))
}

/// Everything a request needs besides its prompt.
#[derive(Debug, Clone)]
pub struct ApiClient {
    /// Shared connection pool.
    pub http: reqwest::Client,
    /// Full request URL (base + endpoint path).
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
    pub async fn send(
        &self,
        spec: &RequestSpec,
        clock: Instant,
        arrived_at: f64,
    ) -> RequestOutcome {
        let body = self.payload(spec);
        let now = || clock.elapsed().as_secs_f64();
        let start = now();
        let mut request = self.http.post(&self.api_url).json(&body);
        if let Some(key) = &self.api_key {
            request = request.bearer_auth(key);
        }
        let response = match request.send().await {
            Ok(r) => r,
            Err(e) => {
                let reason = describe_transport_error(&e, &self.api_url);
                return RequestOutcome {
                    queue_time: start - arrived_at,
                    ..RequestOutcome::failed(start, now(), spec.prompt_len, reason)
                };
            }
        };
        let status = response.status();
        if !status.is_success() {
            let text = response.text().await.unwrap_or_default();
            return RequestOutcome {
                queue_time: start - arrived_at,
                ..RequestOutcome::failed(
                    start,
                    now(),
                    spec.prompt_len,
                    describe_http_error(status, &text),
                )
            };
        }
        let mut recorder =
            RequestRecorder::new(self.endpoint, start, start - arrived_at, spec.prompt_len);
        let mut decoder = SseDecoder::new();
        let mut stream = response.bytes_stream();
        loop {
            let next = if recorder.is_finished() {
                match tokio::time::timeout(DRAIN_AFTER_DONE, stream.next()).await {
                    Ok(item) => item,
                    Err(_) => break,
                }
            } else {
                stream.next().await
            };
            let Some(item) = next else { break };
            match item {
                Ok(bytes) => {
                    let t = now();
                    for event in decoder.push(&bytes) {
                        match event {
                            SseEvent::Data(data) => recorder.on_data(t, &data),
                            SseEvent::Done => recorder.on_done(),
                        }
                    }
                }
                Err(e) => {
                    recorder.fail(format!(
                        "the stream broke off: {}",
                        describe_transport_error(&e, &self.api_url)
                    ));
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
        recorder.finish(t)
    }
}

/// `HTTP 404 Not Found: <message>` with the message from an OpenAI/vLLM error body, or the
/// start of the body.
pub fn describe_http_error(status: reqwest::StatusCode, body: &str) -> String {
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

/// A transport error in words: connect, timeout, or other, with its chain of causes.
pub fn describe_transport_error(e: &reqwest::Error, url: &str) -> String {
    let chain = error_chain(e);
    if e.is_connect() {
        format!("could not connect to {url} ({chain}); is the server running there?")
    } else if e.is_timeout() {
        format!(
            "timed out talking to {url} ({chain}); raise --request-timeout if the server is just slow"
        )
    } else {
        format!("request to {url} failed ({chain})")
    }
}

/// An error and its sources joined with `: `, skipping repeats.
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut parts: Vec<String> = vec![e.to_string()];
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        source = s.source();
    }
    parts.join(": ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client(endpoint: EndpointKind) -> ApiClient {
        ApiClient {
            http: reqwest::Client::new(),
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
            reqwest::StatusCode::NOT_FOUND,
            r#"{"error":{"message":"model x not found","type":"NotFoundError","code":404}}"#,
        );
        assert_eq!(s, "HTTP 404 Not Found: NotFoundError: model x not found");
        let s = describe_http_error(reqwest::StatusCode::BAD_GATEWAY, "  upstream down ");
        assert_eq!(s, "HTTP 502 Bad Gateway: upstream down");
        assert_eq!(
            describe_http_error(reqwest::StatusCode::INTERNAL_SERVER_ERROR, ""),
            "HTTP 500 Internal Server Error"
        );
    }
}
