//! `POST /tokenize` and `POST /detokenize`, in vLLM's shape (mounted at the root, not `/v1`).

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Map, Value, json};

use crate::chat::render_prompt;
use crate::chat_template::RenderOptions;
use crate::completions::parse_body;
use crate::error::ApiError;
use crate::http::body::JsonBody;
use crate::protocol::chat::ChatMessage;
use crate::state::AppState;
use crate::validation::check_token_ids;

/// A tokenize request: a prompt (completions style) or messages (chat style).
#[derive(Debug, Deserialize)]
struct TokenizeRequest {
    model: Option<String>,
    prompt: Option<String>,
    messages: Option<Vec<ChatMessage>>,
    add_special_tokens: Option<bool>,
    add_generation_prompt: Option<bool>,
    continue_final_message: Option<bool>,
    chat_template_kwargs: Option<Map<String, Value>>,
    return_token_strs: Option<bool>,
}

/// A detokenize request.
#[derive(Debug, Deserialize)]
struct DetokenizeRequest {
    model: Option<String>,
    tokens: Option<Vec<i64>>,
}

fn respond(state: &AppState, r: Result<Value, ApiError>) -> Response {
    state.answer(r.map(|v| Json(v).into_response()))
}

/// `POST /tokenize`: `{count, max_model_len, tokens, token_strs}`.
pub async fn tokenize(State(state): State<Arc<AppState>>, JsonBody(body): JsonBody) -> Response {
    let r = async {
        let req: TokenizeRequest = parse_body(&body)?;
        state.check_model(req.model.as_deref())?;
        let (text, default_special) = match (req.prompt, req.messages) {
            (Some(p), None) => (p, true),
            (None, Some(messages)) => {
                let continue_final_message = req.continue_final_message.unwrap_or(false);
                let options = RenderOptions {
                    add_generation_prompt: req
                        .add_generation_prompt
                        .unwrap_or(!continue_final_message),
                    continue_final_message,
                    extra: req.chat_template_kwargs.unwrap_or_default(),
                };
                (render_prompt(&state, &messages, &options)?, false)
            }
            _ => {
                return Err(ApiError::bad_request(
                    "give either `prompt` (text) or `messages` (a chat), not both or neither.",
                ));
            }
        };
        let tokens = state
            .encode(text, req.add_special_tokens.unwrap_or(default_special))
            .await?;
        let token_strs = req.return_token_strs.unwrap_or(false).then(|| {
            tokens
                .iter()
                .map(|&t| state.tokenizer.id_to_token(t).unwrap_or_default())
                .collect::<Vec<_>>()
        });
        Ok(json!({
            "count": tokens.len(),
            "max_model_len": state.limits.max_model_len,
            "tokens": tokens,
            "token_strs": token_strs,
        }))
    }
    .await;
    respond(&state, r)
}

/// `POST /detokenize`: `{prompt}`.
pub async fn detokenize(State(state): State<Arc<AppState>>, JsonBody(body): JsonBody) -> Response {
    let r = (|| {
        let req: DetokenizeRequest = parse_body(&body)?;
        state.check_model(req.model.as_deref())?;
        let tokens = req
            .tokens
            .ok_or_else(|| ApiError::bad_param("tokens", "tokens is required."))?;
        let ids = check_token_ids(&tokens, "tokens", state.limits.vocab_size)?;
        let prompt = state
            .tokenizer
            .decode(&ids, false)
            .map_err(|e| ApiError::Internal(format!("detokenizing: {e}")))?;
        Ok(json!({ "prompt": prompt }))
    })();
    respond(&state, r)
}

/// `GET /tokenizer_info`, as vLLM serves it: the tokenizer's special tokens, chat template and
/// context length, for clients that tokenize through the server (lm-evaluation-harness's
/// remote tokenizer reads `eos_token` and `bos_token` here, then calls `/tokenize`).
pub async fn tokenizer_info(State(state): State<Arc<AppState>>) -> Response {
    let tok = &state.tokenizer;
    Json(json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": tok.eos_token,
        "bos_token": tok.bos_token,
        "pad_token": Value::Null,
        "chat_template": tok.chat_template,
        "model_max_length": state.limits.max_model_len,
    }))
    .into_response()
}
