//! `POST /v1/chat/completions`.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde_json::Value;

use crate::chat_template::{ChatFormat, RenderOptions, normalize_messages, render_harmony};
use crate::completions::parse_body;
use crate::error::ApiError;
use crate::generation::{self, ChoiceDelta, ChoiceEvent, ChoiceSpec, GenerationSpec, TokenLogprob};
use crate::http::body::JsonBody;
use crate::protocol::chat::{
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, ChatDelta, ChatLogprobEntry, ChatLogprobs, ChatMessage, TopLogprob,
};
use crate::protocol::{Usage, random_id, unix_now};
use crate::sse::{ChunkWriter, json_event, stream_response};
use crate::state::AppState;
use crate::validation::{resolve_max_tokens, validate_common};

/// The handler.
pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    JsonBody(body): JsonBody,
) -> Response {
    // The router's clock: wall time, or the modeled clock of `--clock modeled`.
    let arrival = state.router.clock().now();
    match handle(&state, &body, arrival).await {
        Ok(r) => r,
        Err(e) => {
            state.metrics.error(e.error_type());
            e.into_response()
        }
    }
}

/// Renders a conversation to prompt text with the checkpoint's template (or harmony).
pub fn render_prompt(
    state: &AppState,
    messages: &[ChatMessage],
    options: &RenderOptions,
) -> Result<String, ApiError> {
    let messages: Vec<Value> = normalize_messages(messages)?;
    match &state.chat {
        ChatFormat::Template(t) => t.render(&messages, options),
        ChatFormat::Harmony => Ok(render_harmony(&messages, options)),
        ChatFormat::None => Err(ApiError::bad_param(
            "messages",
            "this model has no chat template (no chat_template.jinja or chat_template in \
             tokenizer_config.json); use /v1/completions with a prompt instead.",
        )),
    }
}

async fn handle(
    state: &Arc<AppState>,
    body: &[u8],
    arrival: Instant,
) -> Result<Response, ApiError> {
    let req: ChatCompletionRequest = parse_body(body)?;
    state.check_model(req.common.model.as_deref())?;
    let params = validate_common(&req.common, &state.limits)?;
    state.router.check_sequences(params.n)?;
    let max_lp = state.limits.max_logprobs;
    let want_logprobs = req.logprobs.unwrap_or(false);
    let top_logprobs = match req.top_logprobs {
        None => 0,
        Some(_) if !want_logprobs => {
            return Err(ApiError::bad_param(
                "top_logprobs",
                "top_logprobs needs logprobs to be true.",
            ));
        }
        Some(k) if (0..=max_lp as i64).contains(&k) => k as usize,
        Some(k) => {
            return Err(ApiError::bad_param(
                "top_logprobs",
                format!("top_logprobs must be in [0, {max_lp}], got {k}."),
            ));
        }
    };
    let messages = req
        .messages
        .ok_or_else(|| ApiError::bad_param("messages", "messages is required."))?;
    let mut extra = req.chat_template_kwargs.unwrap_or_default();
    if let Some(tools) = req.tools {
        extra.insert("tools".into(), tools);
    }
    if let Some(effort) = req.reasoning_effort {
        extra.insert("reasoning_effort".into(), Value::String(effort));
    }
    let continue_final_message = req.continue_final_message.unwrap_or(false);
    let options = RenderOptions {
        add_generation_prompt: req.add_generation_prompt.unwrap_or(!continue_final_message),
        continue_final_message,
        extra,
    };
    let text = {
        let state = Arc::clone(state);
        tokio::task::spawn_blocking(move || render_prompt(&state, &messages, &options))
            .await
            .map_err(|e| ApiError::Internal(format!("template task failed: {e}")))??
    };
    let prompt = state
        .encode(text, req.add_special_tokens.unwrap_or(false))
        .await?;
    let max_tokens = resolve_max_tokens(
        params.max_tokens,
        None,
        prompt.len(),
        state.limits.max_model_len,
    )?;
    let choices = (0..params.n)
        .map(|i| ChoiceSpec {
            index: i,
            prompt: prompt.clone(),
            max_tokens,
            sample_index: i,
        })
        .collect();
    let spec = GenerationSpec {
        params: params.clone(),
        top_logprobs,
        want_logprobs,
        extra_stop_ids: state.harmony_stop_ids.clone(),
        arrival,
    };
    let stream = generation::start(state, &spec, choices)?;
    let out = Output {
        state: Arc::clone(state),
        id: random_id("chatcmpl"),
        created: unix_now(),
        want_logprobs,
        return_token_ids: params.return_token_ids,
        include_usage: params.include_usage,
        continuous_usage: params.continuous_usage,
        completion_tokens: vec![0; params.n],
        prompt,
    };
    if params.stream {
        let metrics_state = Arc::clone(state);
        return Ok(stream_response(stream, out, move |e| {
            metrics_state.metrics.error(e.error_type())
        }));
    }
    out.collect(stream, params.n).await
}

struct Output {
    state: Arc<AppState>,
    id: String,
    created: u64,
    want_logprobs: bool,
    return_token_ids: bool,
    include_usage: bool,
    continuous_usage: bool,
    completion_tokens: Vec<usize>,
    prompt: Vec<u32>,
}

impl Output {
    fn logprobs(&self, entries: &[TokenLogprob]) -> ChatLogprobs {
        let entry = |t: u32, l: f32| {
            let token = self.state.token_text(t);
            TopLogprob {
                bytes: token.as_bytes().to_vec(),
                token,
                logprob: l,
            }
        };
        ChatLogprobs {
            content: entries
                .iter()
                .map(|e| {
                    let head = entry(e.token, e.logprob);
                    ChatLogprobEntry {
                        token: head.token,
                        logprob: head.logprob,
                        bytes: head.bytes,
                        top_logprobs: e.top.iter().map(|&(t, l)| entry(t, l)).collect(),
                    }
                })
                .collect(),
        }
    }

    fn totals(&self) -> Usage {
        Usage::new(self.prompt.len(), self.completion_tokens.iter().sum())
    }

    fn chunk(&self, choices: Vec<ChatChunkChoice>, first: bool) -> ChatCompletionChunk {
        ChatCompletionChunk {
            id: self.id.clone(),
            object: "chat.completion.chunk",
            created: self.created,
            model: self.state.model_id.clone(),
            choices,
            usage: self.continuous_usage.then(|| self.totals()),
            prompt_token_ids: (first && self.return_token_ids).then(|| self.prompt.clone()),
        }
    }

    async fn collect(
        mut self,
        mut stream: generation::ChoiceStream,
        n: usize,
    ) -> Result<Response, ApiError> {
        let mut texts = vec![String::new(); n];
        let mut tokens: Vec<Vec<u32>> = vec![Vec::new(); n];
        let mut logprobs: Vec<Vec<TokenLogprob>> = vec![Vec::new(); n];
        let mut finishes = vec![None; n];
        while let Some(event) = stream.next().await {
            let d = match event {
                ChoiceEvent::Delta(d) => d,
                ChoiceEvent::Error(e) => return Err(e),
            };
            let i = d.index;
            self.completion_tokens[i] = d.completion_tokens;
            texts[i].push_str(&d.text);
            tokens[i].extend(d.token_ids);
            logprobs[i].extend(d.logprobs);
            if d.finish.is_some() {
                finishes[i] = d.finish;
            }
        }
        let mut choices = Vec::with_capacity(n);
        for (i, text) in texts.into_iter().enumerate() {
            let finish = finishes[i]
                .take()
                .ok_or_else(|| ApiError::Internal("a choice ended without finishing".into()))?;
            choices.push(ChatChoice {
                index: i,
                message: AssistantMessage {
                    role: "assistant",
                    content: text,
                },
                logprobs: self.want_logprobs.then(|| self.logprobs(&logprobs[i])),
                finish_reason: Some(finish.reason),
                stop_reason: finish.stop_reason,
                token_ids: self
                    .return_token_ids
                    .then(|| std::mem::take(&mut tokens[i])),
            });
        }
        let response = ChatCompletionResponse {
            id: self.id.clone(),
            object: "chat.completion",
            created: self.created,
            model: self.state.model_id.clone(),
            choices,
            usage: self.totals(),
            prompt_token_ids: self.return_token_ids.then(|| self.prompt.clone()),
        };
        Ok(axum::Json(response).into_response())
    }
}

impl ChunkWriter for Output {
    fn delta(&mut self, d: ChoiceDelta) -> Vec<Event> {
        self.completion_tokens[d.index] = d.completion_tokens;
        let mut events = Vec::with_capacity(2);
        if d.first {
            // The role chunk goes out with the first token, never before (client-side TTFT
            // must not count a chunk sent before prefill).
            let role = ChatChunkChoice {
                index: d.index,
                delta: ChatDelta {
                    role: Some("assistant"),
                    content: Some(String::new()),
                },
                logprobs: None,
                finish_reason: None,
                stop_reason: None,
                token_ids: None,
            };
            events.push(json_event(&self.chunk(vec![role], true)));
        }
        let choice = ChatChunkChoice {
            index: d.index,
            delta: ChatDelta {
                role: None,
                content: Some(d.text),
            },
            logprobs: self.want_logprobs.then(|| self.logprobs(&d.logprobs)),
            finish_reason: d.finish.as_ref().map(|f| f.reason),
            stop_reason: d.finish.and_then(|f| f.stop_reason),
            token_ids: self.return_token_ids.then_some(d.token_ids),
        };
        events.push(json_event(&self.chunk(vec![choice], false)));
        events
    }

    fn usage(&mut self) -> Option<Event> {
        self.include_usage.then(|| {
            let mut chunk = self.chunk(Vec::new(), false);
            chunk.usage = Some(self.totals());
            json_event(&chunk)
        })
    }
}
