//! What one request measured, and the state machine that builds it from stream chunks.
//! Pure: the HTTP shell passes in timestamps (seconds since the run started) and decoded
//! SSE data, so every rule here is tested without a network.
//!
//! vLLM `bench serve` rules: TTFT is the time to the first chunk whose `choices` is not empty
//! (even if its text is empty, e.g. a chat role chunk); ITL holds the gaps between successive
//! such chunks (per chunk, not per token); end-to-end latency ends at the last such chunk, not
//! at the usage chunk or `[DONE]`; the output token count is `usage.completion_tokens`.

use serde_json::Value;

use crate::config::EndpointKind;

/// The measurements of one request (vLLM's `RequestFuncOutput`). Times are seconds.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RequestOutcome {
    /// The stream delivered at least one token chunk and no error.
    pub success: bool,
    /// Why it failed; empty on success (as in vLLM's `errors`).
    pub error: String,
    /// Concatenated text of the token chunks.
    pub generated_text: String,
    /// Send to first token chunk (0 for failures).
    pub ttft: f64,
    /// Gaps between successive token chunks.
    pub itl: Vec<f64>,
    /// Send to last token chunk (0 for failures).
    pub latency: f64,
    /// `usage.completion_tokens` of the stream, if the server sent usage.
    pub usage_completion_tokens: Option<u64>,
    /// `usage.prompt_tokens` of the stream, if the server sent usage.
    pub usage_prompt_tokens: Option<u64>,
    /// The client's prompt length (exact for token-id prompts).
    pub client_prompt_len: usize,
    /// When the request was sent, seconds after the run started.
    pub start_time: f64,
    /// When the request ended (last byte, or the failure), seconds after the run started.
    pub end_time: f64,
    /// Time waiting for a `--max-concurrency` slot between arrival and send.
    pub queue_time: f64,
    /// Token chunks received.
    pub content_chunks: usize,
    /// Sent a second time, on a fresh connection, after a kept-alive one failed before any
    /// byte of the answer arrived (the times count from the first send).
    pub retried: bool,
    /// The time dilation the server said it runs at (`x-afd-time-dilation`), if it said one.
    pub time_dilation: Option<f64>,
}

impl RequestOutcome {
    /// Prompt tokens as the result reports them: the server's count when it gave one.
    pub fn prompt_len(&self) -> usize {
        self.usage_prompt_tokens
            .map(|n| n as usize)
            .unwrap_or(self.client_prompt_len)
    }

    /// A request that failed before any stream, e.g. refused connection or an HTTP error.
    pub fn failed(start_time: f64, end_time: f64, client_prompt_len: usize, error: String) -> Self {
        RequestOutcome {
            success: false,
            error,
            client_prompt_len,
            start_time,
            end_time,
            ..RequestOutcome::default()
        }
    }
}

/// What one `data:` payload of an OpenAI stream says.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ChunkInfo {
    /// `choices` is present and not empty: a token chunk.
    pub has_choices: bool,
    /// Text of `choices[0]` (`text`, or `delta.content` plus any `delta.reasoning_content`).
    pub text: String,
    /// `usage.completion_tokens`.
    pub completion_tokens: Option<u64>,
    /// `usage.prompt_tokens`.
    pub prompt_tokens: Option<u64>,
    /// An error reported inside the stream.
    pub error: Option<String>,
}

/// Reads one `data:` payload. Invalid JSON is an error of the request.
pub fn parse_chunk(data: &str, endpoint: EndpointKind) -> Result<ChunkInfo, String> {
    let value: Value = serde_json::from_str(data).map_err(|e| {
        let shown: String = data.chars().take(200).collect();
        format!("the stream carried invalid JSON ({e}): {shown}")
    })?;
    let mut info = ChunkInfo {
        error: error_message(&value),
        ..ChunkInfo::default()
    };
    if let Some(first) = value
        .get("choices")
        .and_then(Value::as_array)
        .and_then(|c| c.first())
    {
        info.has_choices = true;
        let piece = |v: Option<&Value>| v.and_then(Value::as_str).unwrap_or("").to_string();
        info.text = match endpoint {
            EndpointKind::Completions => piece(first.get("text")),
            EndpointKind::Chat => {
                let delta = first.get("delta");
                let reasoning = piece(
                    delta.and_then(|d| d.get("reasoning_content").or_else(|| d.get("reasoning"))),
                );
                reasoning + &piece(delta.and_then(|d| d.get("content")))
            }
        };
    }
    if let Some(usage) = value.get("usage").filter(|u| u.is_object()) {
        info.completion_tokens = usage.get("completion_tokens").and_then(Value::as_u64);
        info.prompt_tokens = usage.get("prompt_tokens").and_then(Value::as_u64);
    }
    Ok(info)
}

/// The message of an error object: `{"error": {"message": ..}}`, `{"error": ".."}`, or the
/// flat `{"object": "error", "message": ..}` of older vLLM and SGLang.
pub fn error_message(value: &Value) -> Option<String> {
    match value.get("error") {
        Some(Value::String(s)) => return Some(s.clone()),
        Some(obj @ Value::Object(_)) => {
            let message = obj.get("message").and_then(Value::as_str).unwrap_or("");
            let kind = obj.get("type").and_then(Value::as_str).unwrap_or("");
            let text = match (kind.is_empty(), message.is_empty()) {
                (false, false) => format!("{kind}: {message}"),
                (true, false) => message.to_string(),
                (false, true) => kind.to_string(),
                (true, true) => obj.to_string(),
            };
            return Some(text);
        }
        Some(Value::Null) | None => {}
        Some(other) => return Some(other.to_string()),
    }
    if value.get("object").and_then(Value::as_str) == Some("error") {
        let message = value.get("message").and_then(Value::as_str).unwrap_or("");
        return Some(message.to_string());
    }
    None
}

/// Builds a `RequestOutcome` from the chunks of one stream.
#[derive(Debug)]
pub struct RequestRecorder {
    endpoint: EndpointKind,
    outcome: RequestOutcome,
    first_chunk_at: Option<f64>,
    last_chunk_at: f64,
    failure: Option<String>,
    done: bool,
}

impl RequestRecorder {
    /// A request sent at `start_time` after waiting `queue_time` for a concurrency slot.
    pub fn new(
        endpoint: EndpointKind,
        start_time: f64,
        queue_time: f64,
        client_prompt_len: usize,
    ) -> Self {
        RequestRecorder {
            endpoint,
            outcome: RequestOutcome {
                start_time,
                queue_time,
                client_prompt_len,
                ..RequestOutcome::default()
            },
            first_chunk_at: None,
            last_chunk_at: start_time,
            failure: None,
            done: false,
        }
    }

    /// One `data:` payload, received at `now`. Ignored after a failure or `[DONE]`.
    pub fn on_data(&mut self, now: f64, data: &str) {
        if self.failure.is_some() || self.done {
            return;
        }
        let info = match parse_chunk(data, self.endpoint) {
            Ok(info) => info,
            Err(reason) => {
                self.failure = Some(reason);
                return;
            }
        };
        if let Some(message) = info.error {
            self.failure = Some(format!(
                "the server reported an error in the stream: {message}"
            ));
            return;
        }
        if info.has_choices {
            match self.first_chunk_at {
                None => {
                    self.first_chunk_at = Some(now);
                    self.outcome.ttft = now - self.outcome.start_time;
                }
                Some(_) => self.outcome.itl.push(now - self.last_chunk_at),
            }
            self.last_chunk_at = now;
            self.outcome.content_chunks += 1;
            self.outcome.generated_text.push_str(&info.text);
        }
        // Later usage (e.g. continuous usage stats) replaces earlier.
        if info.completion_tokens.is_some() {
            self.outcome.usage_completion_tokens = info.completion_tokens;
        }
        if info.prompt_tokens.is_some() {
            self.outcome.usage_prompt_tokens = info.prompt_tokens;
        }
    }

    /// `data: [DONE]` arrived.
    pub fn on_done(&mut self) {
        self.done = true;
    }

    /// Whether `[DONE]` has been seen or the request already failed (no need to read on).
    pub fn is_finished(&self) -> bool {
        self.done || self.failure.is_some()
    }

    /// Marks the request failed (transport error, timeout); the first reason wins.
    pub fn fail(&mut self, reason: String) {
        if self.failure.is_none() {
            self.failure = Some(reason);
        }
    }

    /// The outcome once the stream has ended at `end_time`.
    pub fn finish(mut self, end_time: f64) -> RequestOutcome {
        self.outcome.end_time = end_time;
        if self.failure.is_none() && self.first_chunk_at.is_none() {
            self.failure = Some(
                "the stream ended without a chunk carrying choices, so there is no first token \
                 (does the server stream this endpoint?)"
                    .to_string(),
            );
        }
        match self.failure {
            Some(reason) => RequestOutcome {
                success: false,
                error: reason,
                ttft: 0.0,
                latency: 0.0,
                itl: Vec::new(),
                ..self.outcome
            },
            None => RequestOutcome {
                success: true,
                latency: self.last_chunk_at - self.outcome.start_time,
                ..self.outcome
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn completion_chunk(text: &str) -> String {
        format!(
            r#"{{"id":"c","object":"text_completion","choices":[{{"index":0,"text":"{text}","finish_reason":null}}],"usage":null}}"#
        )
    }
    const USAGE: &str = r#"{"id":"c","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":7,"total_tokens":12}}"#;

    #[test]
    fn records_ttft_itl_latency_and_usage_like_vllm() {
        let mut r = RequestRecorder::new(EndpointKind::Completions, 1.0, 0.25, 4);
        r.on_data(1.5, &completion_chunk("a"));
        r.on_data(1.6, &completion_chunk("b"));
        r.on_data(1.8, &completion_chunk("c"));
        r.on_data(1.9, USAGE);
        r.on_done();
        let o = r.finish(2.0);
        assert!(o.success, "{}", o.error);
        assert!((o.ttft - 0.5).abs() < 1e-12);
        assert_eq!(o.itl.len(), 2);
        assert!((o.itl[0] - 0.1).abs() < 1e-12 && (o.itl[1] - 0.2).abs() < 1e-12);
        // Latency ends at the last token chunk, not at the usage chunk.
        assert!((o.latency - 0.8).abs() < 1e-12);
        assert_eq!(o.usage_completion_tokens, Some(7));
        assert_eq!(o.prompt_len(), 5);
        assert_eq!(o.generated_text, "abc");
        assert_eq!(o.queue_time, 0.25);
    }

    #[test]
    fn chat_role_chunk_counts_as_first_token_and_reasoning_is_text() {
        let mut r = RequestRecorder::new(EndpointKind::Chat, 0.0, 0.0, 3);
        r.on_data(
            0.3,
            r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#,
        );
        r.on_data(
            0.4,
            r#"{"choices":[{"index":0,"delta":{"reasoning_content":"hm ","content":"Hi"}}]}"#,
        );
        let o = r.finish(0.5);
        assert!(o.success);
        assert!((o.ttft - 0.3).abs() < 1e-12);
        assert_eq!(o.generated_text, "hm Hi");
        assert_eq!(o.usage_completion_tokens, None);
        assert_eq!(o.prompt_len(), 3);
    }

    #[test]
    fn error_event_fails_the_request_with_its_message() {
        let mut r = RequestRecorder::new(EndpointKind::Completions, 0.0, 0.0, 1);
        r.on_data(0.1, &completion_chunk("a"));
        r.on_data(
            0.2,
            r#"{"error":{"message":"KV cache exhausted","type":"InternalServerError","code":500}}"#,
        );
        r.on_data(0.3, &completion_chunk("b"));
        let o = r.finish(0.4);
        assert!(!o.success);
        assert!(o.error.contains("KV cache exhausted"), "{}", o.error);
        assert!(o.error.contains("InternalServerError"), "{}", o.error);
        assert_eq!(o.ttft, 0.0);
        assert!(o.itl.is_empty());
    }

    #[test]
    fn stream_without_choices_fails_and_bad_json_fails() {
        let mut r = RequestRecorder::new(EndpointKind::Completions, 0.0, 0.0, 1);
        r.on_data(0.1, USAGE);
        let o = r.finish(0.2);
        assert!(!o.success);
        assert!(o.error.contains("without a chunk carrying choices"));

        let mut r = RequestRecorder::new(EndpointKind::Completions, 0.0, 0.0, 1);
        r.on_data(0.1, "{not json");
        let o = r.finish(0.2);
        assert!(
            !o.success && o.error.contains("invalid JSON"),
            "{}",
            o.error
        );
    }

    #[test]
    fn error_shapes() {
        let v: Value = serde_json::from_str(r#"{"error":"boom"}"#).unwrap();
        assert_eq!(error_message(&v).as_deref(), Some("boom"));
        let v: Value =
            serde_json::from_str(r#"{"object":"error","message":"flat","type":"x"}"#).unwrap();
        assert_eq!(error_message(&v).as_deref(), Some("flat"));
        let v: Value = serde_json::from_str(r#"{"choices":[],"error":null}"#).unwrap();
        assert_eq!(error_message(&v), None);
    }
}
