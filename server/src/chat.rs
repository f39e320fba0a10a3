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
use crate::prompt_logprobs;
use crate::protocol::chat::{
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, ChatDelta, ChatLogprobEntry, ChatLogprobs, ChatMessage, FunctionCall,
    FunctionCallDelta, ToolCall, ToolCallDelta, TopLogprob,
};
use crate::protocol::prompt_logprobs::PromptLogprobsField;
use crate::protocol::{Usage, random_id, unix_now};
use crate::sse::{ChunkWriter, error_event, json_event, stream_response};
use crate::state::AppState;
use crate::structured;
use crate::tool_parsing::{ChoiceParser, ParseEvent, ParsedOutput, ReasoningParserKind};
use crate::tools::{prepare_tool_turns, resolve_tool_use, uses_tools};
use crate::validation::{Validated, resolve_max_tokens, validate_common};

/// The handler.
pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    JsonBody(body): JsonBody,
) -> Response {
    // The router's clock: wall time, or the modeled clock of `--clock modeled`.
    let arrival = state.router.clock().now();
    state.answer(handle(&state, &body, arrival).await)
}

/// Renders a conversation to prompt text with the checkpoint's template (or harmony).
pub fn render_prompt(
    state: &AppState,
    messages: &[ChatMessage],
    options: &RenderOptions,
) -> Result<String, ApiError> {
    let mut messages: Vec<Value> = normalize_messages(messages)?;
    prepare_tool_turns(&mut messages)?;
    match &state.chat {
        // A GPT-OSS template that cannot render tool turns would drop them: harmony's own
        // layout, which the model was trained on, renders them instead.
        ChatFormat::Template(t)
            if state.family == Some(model::Family::GptOss)
                && !t.renders_tool_calls()
                && uses_tools(&messages, &options.extra) =>
        {
            render_harmony(&messages, options)
        }
        ChatFormat::Template(t) => t.render(&messages, options),
        ChatFormat::Harmony => render_harmony(&messages, options),
        ChatFormat::None => Err(ApiError::bad_param(
            "messages",
            "this model has no chat template (no chat_template.jinja or chat_template in \
             tokenizer_config.json); use /v1/completions with a prompt instead.",
        )),
    }
}

/// A chat request turned into a running generation: what an endpoint writes out.
pub(crate) struct ChatRun {
    /// Every choice's deltas.
    pub stream: generation::ChoiceStream,
    /// The prompt's token ids.
    pub prompt: Vec<u32>,
    /// One per choice, when the output is parsed for reasoning or tool calls.
    pub parsers: Option<Vec<ChoiceParser>>,
    /// The validated parameters.
    pub params: Validated,
    /// Whether each token's logprob was asked for.
    pub want_logprobs: bool,
}

/// Validates `req`, renders and encodes its prompt, and starts every choice.
pub(crate) async fn start_chat(
    state: &Arc<AppState>,
    req: ChatCompletionRequest,
    arrival: Instant,
) -> Result<ChatRun, ApiError> {
    state.check_model(req.common.model.as_deref())?;
    let mut params = validate_common(&req.common, &state.limits)?;
    let tool_use = resolve_tool_use(
        req.tools.as_ref(),
        req.tool_choice.as_ref(),
        req.parallel_tool_calls,
        &state.tool_parsing,
    )?;
    if tool_use.parsers.needs_special_tokens() {
        // The parser reads the format's markers, which are special tokens; none of them
        // reaches the response.
        params.skip_special_tokens = false;
    }
    // A required call is a grammar of the calls in the parser's format.
    let forced_calls = match (&tool_use.forced, tool_use.parsers.tools, &req.tools) {
        (Some(forced), Some(kind), Some(tools)) => Some(structured::forced_calls(
            tools,
            forced,
            kind,
            tool_use.parallel,
            &state.tokenizer,
        )),
        _ => None,
    };
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
    // The prompt's end says where the output starts (inside a message, inside `<think>`).
    let parsers: Option<Vec<ChoiceParser>> = (0..params.n)
        .map(|_| {
            tool_use
                .parsers
                .build(&text)
                .map(|parser| ChoiceParser::new(parser, tool_use.parallel))
        })
        .collect();
    // GPT-OSS writes its answer in harmony's final channel, after any analysis; Qwen3 after
    // its `<think>` (unless the template closed it: thinking off).
    let framing = if !state.harmony_stop_ids.is_empty() && text.ends_with("<|start|>assistant") {
        structured::Framing::Harmony
    } else if tool_use.parsers.reasoning == ReasoningParserKind::Qwen3
        && !text.trim_end().ends_with("</think>")
    {
        structured::Framing::Think {
            opened: text.trim_end().ends_with("<think>"),
        }
    } else {
        structured::Framing::Whole
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
    let output_format =
        structured::compile_requested(state, &req.common, framing, forced_calls).await?;
    let spec = GenerationSpec {
        params: params.clone(),
        top_logprobs,
        want_logprobs,
        extra_stop_ids: state.harmony_stop_ids.clone(),
        arrival,
        output_format,
        prompt_logprobs: params.prompt_logprobs,
    };
    let stream = generation::start(state, &spec, choices)?;
    Ok(ChatRun {
        stream,
        prompt,
        parsers,
        params,
        want_logprobs,
    })
}

async fn handle(
    state: &Arc<AppState>,
    body: &[u8],
    arrival: Instant,
) -> Result<Response, ApiError> {
    let req: ChatCompletionRequest = parse_body(body)?;
    let ChatRun {
        stream,
        prompt,
        parsers,
        params,
        want_logprobs,
    } = start_chat(state, req, arrival).await?;
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
        parsers,
        prompt_logprobs: params.prompt_logprobs.map(|_| PromptLogprobsState::Pending),
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
    /// One per choice, when the output is parsed for reasoning or tool calls.
    parsers: Option<Vec<ChoiceParser>>,
    /// vLLM's `prompt_logprobs`, when asked for: sent (or kept for the response) once.
    prompt_logprobs: Option<PromptLogprobsState>,
}

/// Where the request's prompt logprobs are.
enum PromptLogprobsState {
    /// Not arrived yet (they come with a choice's first token).
    Pending,
    /// Arrived, for the response (or already streamed).
    Done(Option<PromptLogprobsField>),
}

/// The streamed delta of one event.
fn event_delta(event: ParseEvent, parser: &mut ChoiceParser) -> ChatDelta {
    match event {
        ParseEvent::Content(t) => ChatDelta {
            content: Some(t),
            ..Default::default()
        },
        ParseEvent::Reasoning(t) => ChatDelta {
            reasoning_content: Some(t),
            ..Default::default()
        },
        ParseEvent::ToolCallStart { index, name } => ChatDelta {
            tool_calls: Some(vec![ToolCallDelta {
                index,
                id: Some(parser.call_id(index)),
                kind: Some("function"),
                function: FunctionCallDelta {
                    name: Some(name),
                    arguments: String::new(),
                },
            }]),
            ..Default::default()
        },
        ParseEvent::ToolCallArguments { index, text } => ChatDelta {
            tool_calls: Some(vec![ToolCallDelta {
                index,
                id: None,
                kind: None,
                function: FunctionCallDelta {
                    name: None,
                    arguments: text,
                },
            }]),
            ..Default::default()
        },
    }
}

impl Output {
    /// The prompt logprobs in vLLM's shape from the first delta that carries them, once.
    fn take_prompt_logprobs(
        &mut self,
        d: &ChoiceDelta,
    ) -> Result<Option<PromptLogprobsField>, ApiError> {
        let (Some(PromptLogprobsState::Pending), Some(scores)) =
            (&self.prompt_logprobs, &d.prompt_logprobs)
        else {
            return Ok(None);
        };
        let field =
            // Chat scores with exactly the alternatives it asked for: all of them go out.
            prompt_logprobs::vllm_field(&self.prompt, scores, usize::MAX, |t| {
                self.state.token_text(t)
            })?;
        self.prompt_logprobs = Some(PromptLogprobsState::Done(None));
        Ok(Some(field))
    }

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
            prompt_logprobs: None,
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
        let mut parsed = vec![ParsedOutput::default(); n];
        while let Some(event) = stream.next().await {
            let d = match event {
                ChoiceEvent::Delta(d) => d,
                ChoiceEvent::Error(e) => return Err(e),
            };
            let i = d.index;
            self.completion_tokens[i] = d.completion_tokens;
            if let Some(field) = self.take_prompt_logprobs(&d)? {
                self.prompt_logprobs = Some(PromptLogprobsState::Done(Some(field)));
            }
            if let Some(p) = self.parsers.as_mut().and_then(|p| p.get_mut(i)) {
                for e in p.events(&d.text, d.finish.is_some()) {
                    parsed[i].apply(&e);
                }
            }
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
            let (message, reason) = match self.parsers.as_mut().and_then(|p| p.get_mut(i)) {
                None => (
                    AssistantMessage {
                        role: "assistant",
                        content: Some(text),
                        reasoning_content: None,
                        tool_calls: Vec::new(),
                    },
                    finish.reason,
                ),
                Some(p) => {
                    let out = std::mem::take(&mut parsed[i]);
                    let tool_calls: Vec<ToolCall> = out
                        .tool_calls
                        .into_iter()
                        .enumerate()
                        .map(|(index, call)| ToolCall {
                            id: p.call_id(index),
                            kind: "function",
                            function: FunctionCall {
                                name: call.name,
                                arguments: call.arguments,
                            },
                        })
                        .collect();
                    let content =
                        (!out.content.is_empty() || tool_calls.is_empty()).then_some(out.content);
                    let message = AssistantMessage {
                        role: "assistant",
                        content,
                        reasoning_content: (!out.reasoning.is_empty()).then_some(out.reasoning),
                        tool_calls,
                    };
                    (message, p.finish_reason(finish.reason))
                }
            };
            choices.push(ChatChoice {
                index: i,
                message,
                logprobs: self.want_logprobs.then(|| self.logprobs(&logprobs[i])),
                finish_reason: Some(reason),
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
            prompt_logprobs: match self.prompt_logprobs.take() {
                Some(PromptLogprobsState::Done(field)) => field,
                Some(PromptLogprobsState::Pending) => {
                    return Err(ApiError::Internal("the prompt was not scored".into()));
                }
                None => None,
            },
        };
        Ok(axum::Json(response).into_response())
    }
}

impl ChunkWriter for Output {
    fn delta(&mut self, d: ChoiceDelta) -> Vec<Event> {
        self.completion_tokens[d.index] = d.completion_tokens;
        let mut events = Vec::with_capacity(2);
        let prompt_logprobs = match self.take_prompt_logprobs(&d) {
            Ok(field) => field,
            Err(e) => return vec![error_event(&e)],
        };
        if d.first {
            // The role chunk goes out with the first token, never before (client-side TTFT
            // must not count a chunk sent before prefill).
            let role = ChatChunkChoice {
                index: d.index,
                delta: ChatDelta {
                    role: Some("assistant"),
                    content: Some(String::new()),
                    ..Default::default()
                },
                logprobs: None,
                finish_reason: None,
                stop_reason: None,
                token_ids: None,
            };
            let mut chunk = self.chunk(vec![role], true);
            chunk.prompt_logprobs = prompt_logprobs;
            events.push(json_event(&chunk));
        }
        let last = d.finish.is_some();
        let (deltas, reason) = match self.parsers.as_mut().and_then(|p| p.get_mut(d.index)) {
            None => (
                vec![ChatDelta {
                    content: Some(d.text),
                    ..Default::default()
                }],
                d.finish.as_ref().map(|f| f.reason),
            ),
            Some(p) => {
                let deltas: Vec<ChatDelta> = p
                    .events(&d.text, last)
                    .into_iter()
                    .map(|e| event_delta(e, p))
                    .collect();
                (deltas, d.finish.as_ref().map(|f| p.finish_reason(f.reason)))
            }
        };
        let carries_tokens = self.want_logprobs || self.return_token_ids;
        if deltas.is_empty() && !last && !carries_tokens {
            // Everything is held back (a marker may be starting): nothing to send yet.
            return events;
        }
        let mut deltas = deltas;
        if deltas.is_empty() {
            deltas.push(ChatDelta {
                content: Some(String::new()),
                ..Default::default()
            });
        }
        // The tokens' logprobs and ids and the finish go with the last chunk of this delta.
        let count = deltas.len();
        let mut tail = Some((d.logprobs, d.token_ids, d.finish));
        for (k, delta) in deltas.into_iter().enumerate() {
            let (logprobs, token_ids, finish) = if k + 1 == count {
                tail.take().unwrap_or_default()
            } else {
                (Vec::new(), Vec::new(), None)
            };
            let choice = ChatChunkChoice {
                index: d.index,
                delta,
                logprobs: self.want_logprobs.then(|| self.logprobs(&logprobs)),
                finish_reason: finish.as_ref().and(reason),
                stop_reason: finish.and_then(|f| f.stop_reason),
                token_ids: self.return_token_ids.then_some(token_ids),
            };
            events.push(json_event(&self.chunk(vec![choice], false)));
        }
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
