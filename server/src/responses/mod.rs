//! `POST /v1/responses`: OpenAI's Responses API, the one GPT-OSS was released with, over the
//! chat path. The request's `input` items become chat messages (function calls and their
//! outputs become tool turns, reasoning goes back to the assistant turn it preceded), its
//! function tools become chat tools, and the chat path renders, generates and parses the
//! output; [`output`] turns the parsed output into reasoning, message and function-call items,
//! whole or as typed stream events.
//!
//! Stateless: nothing is stored (`store` is false in every response), so
//! `previous_response_id`, `conversation` and `background` are refused with a 400 that says to
//! send the whole conversation instead, and `GET /v1/responses/{id}` answers 404 saying so.

pub mod output;

use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};

use crate::chat::{ChatRun, start_chat};
use crate::completions::parse_body;
use crate::error::ApiError;
use crate::http::body::JsonBody;
use crate::protocol::CommonParams;
use crate::protocol::chat::{ChatCompletionRequest, ChatMessage, MessageContent};
use crate::protocol::responses::{ResponseObject, ResponsesRequest};
use crate::protocol::unix_now;
use crate::sse::stream_response;
use crate::state::AppState;

use output::ResponseBuilder;

/// The handler.
pub async fn responses(State(state): State<Arc<AppState>>, JsonBody(body): JsonBody) -> Response {
    let arrival = state.router.clock().now();
    state.answer(handle(&state, &body, arrival).await)
}

/// `GET /v1/responses/{id}`: nothing is stored to fetch.
pub async fn retrieve() -> Response {
    ApiError::NotFound {
        message: "this server stores no responses (every response has store: false), so none \
                  can be fetched; keep the response you were sent."
            .into(),
        param: None,
    }
    .into_response()
}

async fn handle(
    state: &Arc<AppState>,
    body: &[u8],
    arrival: Instant,
) -> Result<Response, ApiError> {
    let req: ResponsesRequest = parse_body(body)?;
    let gpt_oss = state.family == Some(model::Family::GptOss);
    let chat = to_chat_request(&req, gpt_oss)?;
    let ChatRun {
        stream,
        prompt,
        mut parsers,
        params,
        ..
    } = start_chat(state, chat, arrival).await?;
    let skeleton = skeleton(&req, &state.model_id);
    let parser = parsers.as_mut().and_then(|p| p.pop());
    let builder = ResponseBuilder::new(skeleton, prompt.len(), parser);
    if params.stream {
        let metrics_state = Arc::clone(state);
        return Ok(stream_response(stream, builder, move |e| {
            metrics_state.metrics.error(e.error_type())
        }));
    }
    let response = builder.collect(stream).await?;
    Ok(axum::Json(response).into_response())
}

/// The response object before any output: what the request set, echoed.
fn skeleton(req: &ResponsesRequest, model: &str) -> ResponseObject {
    ResponseObject {
        id: output::new_id("resp"),
        object: "response",
        created_at: unix_now(),
        status: "in_progress",
        incomplete_details: None,
        error: None,
        instructions: req.instructions.clone(),
        max_output_tokens: req.max_output_tokens,
        model: model.to_string(),
        output: Vec::new(),
        parallel_tool_calls: req.parallel_tool_calls.unwrap_or(true),
        previous_response_id: None,
        reasoning: req.reasoning.clone().unwrap_or_default(),
        store: false,
        temperature: req.temperature,
        text: json!({"format": {"type": "text"}}),
        tool_choice: req.tool_choice.clone().unwrap_or_else(|| json!("auto")),
        tools: req.tools.clone().unwrap_or_else(|| json!([])),
        top_p: req.top_p,
        truncation: "disabled",
        usage: None,
        user: req.user.clone(),
        metadata: req.metadata.clone().unwrap_or_else(|| json!({})),
    }
}

/// The chat request a Responses request stands for, or the 400 for what this server cannot
/// do. `gpt_oss`: instructions are a developer message (harmony's place for them), else a
/// system message.
pub fn to_chat_request(
    req: &ResponsesRequest,
    gpt_oss: bool,
) -> Result<ChatCompletionRequest, ApiError> {
    refuse_stateful(req)?;
    let response_format = text_format(req.text.as_ref())?;
    if req.top_logprobs.is_some_and(|k| k != 0) {
        return Err(ApiError::bad_param(
            "top_logprobs",
            "top_logprobs is not supported on /v1/responses yet; /v1/chat/completions returns \
             logprobs and top_logprobs.",
        ));
    }
    let input = req.input.as_ref().ok_or_else(|| {
        ApiError::bad_param("input", "input is required: text or a list of items.")
    })?;
    let mut messages = Vec::new();
    if let Some(instructions) = &req.instructions {
        let role = if gpt_oss { "developer" } else { "system" };
        messages.push(message(role, Some(instructions.clone())));
    }
    messages.extend(input_messages(input)?);
    Ok(ChatCompletionRequest {
        messages: Some(messages),
        common: CommonParams {
            model: req.model.clone(),
            max_completion_tokens: req.max_output_tokens,
            temperature: req.temperature,
            top_p: req.top_p,
            top_k: req.top_k,
            seed: req.seed,
            stream: req.stream,
            response_format,
            ..Default::default()
        },
        tools: req.tools.as_ref().map(chat_tools).transpose()?,
        tool_choice: req.tool_choice.as_ref().map(chat_tool_choice).transpose()?,
        parallel_tool_calls: req.parallel_tool_calls,
        reasoning_effort: req.reasoning.as_ref().and_then(|r| r.effort.clone()),
        ..Default::default()
    })
}

fn refuse_stateful(req: &ResponsesRequest) -> Result<(), ApiError> {
    let stateful = |param: &str, what: &str| {
        ApiError::bad_param(
            param,
            format!(
                "{what} needs stored responses, and this server stores none (store is false): \
                 send the whole conversation in `input` instead."
            ),
        )
    };
    if req.previous_response_id.is_some() {
        return Err(stateful(
            "previous_response_id",
            "continuing from previous_response_id",
        ));
    }
    if req.conversation.as_ref().is_some_and(|c| !c.is_null()) {
        return Err(stateful("conversation", "a conversation"));
    }
    if req.background == Some(true) {
        return Err(stateful("background", "background: true"));
    }
    Ok(())
}

/// `text.format` as chat's `response_format`: Responses writes a JSON schema's `name`,
/// `schema` and `strict` beside `type`, chat nests them under `json_schema`.
fn text_format(text: Option<&Value>) -> Result<Option<Value>, ApiError> {
    let Some(format) = text.and_then(|t| t.get("format")).filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"type": "json_object"}))),
        Some("json_schema") => {
            let schema = format
                .get("schema")
                .filter(|s| s.is_object())
                .ok_or_else(|| {
                    ApiError::bad_param(
                        "text.format.schema",
                        "text.format of type json_schema needs a schema object: {\"type\": \
                     \"json_schema\", \"name\": ..., \"schema\": {...}}.",
                    )
                })?;
            Ok(Some(json!({
                "type": "json_schema",
                "json_schema": {"name": format.get("name"), "schema": schema, "strict": format.get("strict")},
            })))
        }
        _ => Err(ApiError::bad_param(
            "text.format",
            format!("text.format type must be text, json_object or json_schema; got {format}."),
        )),
    }
}

fn message(role: &str, content: Option<String>) -> ChatMessage {
    ChatMessage {
        role: role.to_string(),
        content: content.map(MessageContent::Text),
        rest: Map::new(),
    }
}

/// `input` as chat messages.
fn input_messages(input: &Value) -> Result<Vec<ChatMessage>, ApiError> {
    let items = match input {
        Value::String(text) => return Ok(vec![message("user", Some(text.clone()))]),
        Value::Array(items) if !items.is_empty() => items,
        Value::Array(_) => {
            return Err(ApiError::bad_param("input", "input must not be empty."));
        }
        _ => {
            return Err(ApiError::bad_param(
                "input",
                "input must be text or a list of items (messages, function_call, \
                 function_call_output, reasoning).",
            ));
        }
    };
    let mut messages: Vec<ChatMessage> = Vec::new();
    // Reasoning goes back on the assistant turn that follows it (harmony renders it in the
    // analysis channel); reasoning no assistant turn follows is dropped, as chat drops it.
    let mut reasoning: Option<String> = None;
    for (i, item) in items.iter().enumerate() {
        let bad = |what: String| ApiError::bad_param("input", format!("input[{i}]: {what}"));
        let kind = match item.get("type").and_then(Value::as_str) {
            Some(kind) => kind,
            None if item.get("role").is_some() => "message",
            None => {
                return Err(bad(
                    "an item needs a `type` (or a `role`, for a message).".into()
                ));
            }
        };
        match kind {
            "message" => {
                let role = item.get("role").and_then(Value::as_str).unwrap_or("");
                if !matches!(role, "user" | "system" | "developer" | "assistant") {
                    return Err(bad(format!(
                        "role must be user, system, developer or assistant; got `{role}`."
                    )));
                }
                let text = message_text(item.get("content")).map_err(bad)?;
                let mut m = message(role, Some(text));
                if role == "assistant"
                    && let Some(r) = reasoning.take()
                {
                    m.rest.insert("reasoning_content".into(), Value::String(r));
                }
                messages.push(m);
            }
            "function_call" => {
                let field = |name: &str| {
                    item.get(name)
                        .and_then(Value::as_str)
                        .map(str::to_string)
                        .ok_or_else(|| bad(format!("a function_call needs `{name}` (a string).")))
                };
                let call = json!({
                    "id": field("call_id")?,
                    "type": "function",
                    "function": {"name": field("name")?, "arguments": field("arguments")?},
                });
                // Calls in a row are one assistant turn.
                let open_turn = messages
                    .last_mut()
                    .filter(|m| m.role == "assistant" && m.rest.get("tool_calls").is_some());
                match open_turn {
                    Some(turn) => {
                        if let Some(Value::Array(calls)) = turn.rest.get_mut("tool_calls") {
                            calls.push(call);
                        }
                    }
                    None => {
                        let mut m = message("assistant", None);
                        m.rest.insert("tool_calls".into(), Value::Array(vec![call]));
                        if let Some(r) = reasoning.take() {
                            m.rest.insert("reasoning_content".into(), Value::String(r));
                        }
                        messages.push(m);
                    }
                }
            }
            "function_call_output" => {
                let call_id =
                    item.get("call_id").and_then(Value::as_str).ok_or_else(|| {
                        bad("a function_call_output needs `call_id`, the id of the call it answers."
                        .into())
                    })?;
                let output = message_text(item.get("output")).map_err(bad)?;
                let mut m = message("tool", Some(output));
                m.rest
                    .insert("tool_call_id".into(), Value::String(call_id.to_string()));
                messages.push(m);
            }
            "reasoning" => {
                let text = reasoning_text(item);
                if !text.is_empty() {
                    reasoning = Some(text);
                }
            }
            "item_reference" => {
                return Err(bad(
                    "item_reference names a stored item, and this server stores \
                                none: send the item itself."
                        .into(),
                ));
            }
            other => {
                return Err(bad(format!(
                    "items of type `{other}` are not supported; send messages, function_call, \
                     function_call_output or reasoning items."
                )));
            }
        }
    }
    Ok(messages)
}

/// A message's content (or a function call's output): text, or text parts joined.
fn message_text(content: Option<&Value>) -> Result<String, String> {
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(text)) => Ok(text.clone()),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, part) in parts.iter().enumerate() {
                match part.get("type").and_then(Value::as_str) {
                    Some("input_text" | "output_text" | "text") => texts.push(
                        part.get("text")
                            .and_then(Value::as_str)
                            .unwrap_or_default()
                            .to_string(),
                    ),
                    kind => {
                        return Err(format!(
                            "content[{j}] is of type `{}`; this text-only model takes \
                             input_text and output_text parts.",
                            kind.unwrap_or("(none)")
                        ));
                    }
                }
            }
            Ok(texts.join("\n"))
        }
        Some(other) => Err(format!(
            "content must be text or a list of parts; got {other}."
        )),
    }
}

/// A reasoning item's text: its content parts, else its summary parts.
fn reasoning_text(item: &Value) -> String {
    let texts = |key: &str| -> Vec<String> {
        item.get(key)
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|p| p.get("text").and_then(Value::as_str).map(str::to_string))
            .collect()
    };
    let content = texts("content");
    if content.is_empty() {
        texts("summary").join("\n")
    } else {
        content.join("\n")
    }
}

/// Responses' flat function tools (`{"type": "function", "name", ...}`) as chat's nested
/// ones (`{"type": "function", "function": {"name", ...}}`).
fn chat_tools(tools: &Value) -> Result<Value, ApiError> {
    let Value::Array(list) = tools else {
        return Err(ApiError::bad_param("tools", "tools must be a list."));
    };
    list.iter()
        .enumerate()
        .map(|(i, tool)| {
            let kind = tool.get("type").and_then(Value::as_str).unwrap_or("(none)");
            if kind != "function" {
                return Err(ApiError::bad_param(
                    "tools",
                    format!(
                        "tools[{i}] is of type `{kind}`; only function tools are supported \
                         (this server runs no built-in tools)."
                    ),
                ));
            }
            let mut function = tool.as_object().cloned().unwrap_or_default();
            function.remove("type");
            Ok(json!({"type": "function", "function": function}))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Value::Array)
}

/// Responses' `{"type": "function", "name"}` tool choice as chat's; strings as they are.
fn chat_tool_choice(choice: &Value) -> Result<Value, ApiError> {
    match choice {
        Value::Object(o) if o.get("type").and_then(Value::as_str) == Some("function") => {
            let name = o.get("name").cloned().unwrap_or(Value::Null);
            Ok(json!({"type": "function", "function": {"name": name}}))
        }
        Value::Object(_) => Err(ApiError::bad_param(
            "tool_choice",
            format!(
                "tool_choice must be \"none\", \"auto\", \"required\" or {{\"type\": \
                 \"function\", \"name\": ...}}; got {choice}."
            ),
        )),
        other => Ok(other.clone()),
    }
}

#[cfg(test)]
mod tests;
