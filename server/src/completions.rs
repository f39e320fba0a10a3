//! `POST /v1/completions`.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use futures::StreamExt;

use crate::error::ApiError;
use crate::generation::{self, ChoiceDelta, ChoiceEvent, ChoiceSpec, GenerationSpec, TokenLogprob};
use crate::http::body::JsonBody;
use crate::prompt_logprobs;
use crate::protocol::completions::{
    CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, OrderedLogprobs,
    PromptItem,
};
use crate::protocol::{Usage, random_id, unix_now};
use crate::sse::{ChunkWriter, error_event, json_event, stream_response};
use crate::state::AppState;
use crate::structured;
use crate::validation::{check_token_ids, resolve_max_tokens, validate_common};

/// One tokenized prompt.
struct Prompt {
    ids: Vec<u32>,
    /// For `echo`.
    text: String,
}

/// The handler.
pub async fn completions(State(state): State<Arc<AppState>>, JsonBody(body): JsonBody) -> Response {
    // The router's clock: wall time, or the modeled clock of `--clock modeled`.
    let arrival = state.router.clock().now();
    state.answer(handle(&state, &body, arrival).await)
}

/// Parses a JSON body into `T`, as a 400 naming the problem.
pub fn parse_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("invalid request body: {e}")))
}

async fn handle(
    state: &Arc<AppState>,
    body: &[u8],
    arrival: Instant,
) -> Result<Response, ApiError> {
    let req: CompletionRequest = parse_body(body)?;
    state.check_model(req.common.model.as_deref())?;
    let params = validate_common(&req.common, &state.limits)?;
    let max_lp = state.limits.max_logprobs;
    let logprobs = match req.logprobs {
        None => None,
        Some(k) if (0..=max_lp as i64).contains(&k) => Some(k as usize),
        Some(k) => {
            return Err(ApiError::bad_param(
                "logprobs",
                format!("logprobs must be in [0, {max_lp}], got {k}."),
            ));
        }
    };
    let echo = req.echo.unwrap_or(false);
    // `echo` with `logprobs` reports the prompt's tokens too: the prompt is scored with as
    // many alternatives as either asks.
    let echo_logprobs = logprobs.filter(|_| echo);
    let prompt_scoring = match (echo_logprobs, params.prompt_logprobs) {
        (None, p) => p,
        (Some(k), p) => Some(k.max(p.unwrap_or(0))),
    };
    let items = req
        .prompt
        .ok_or_else(|| ApiError::bad_param("prompt", "prompt is required."))?
        .into_items();
    if items.is_empty() {
        return Err(ApiError::bad_param(
            "prompt",
            "prompt must not be an empty list.",
        ));
    }
    // Refuse a request that could never be admitted before tokenizing all its prompts.
    state
        .router
        .check_sequences(items.len().saturating_mul(params.n))?;
    let add_special = req.add_special_tokens.unwrap_or(true);
    let mut prompts = Vec::with_capacity(items.len());
    let mut choices = Vec::new();
    for (p, item) in items.into_iter().enumerate() {
        let prompt = match item {
            PromptItem::Text(text) => Prompt {
                ids: state.encode(text.clone(), add_special).await?,
                text,
            },
            PromptItem::Ids(ids) => {
                let ids = check_token_ids(&ids, "prompt", state.limits.vocab_size)?;
                let text = if echo {
                    state.tokenizer.decode(&ids, false).unwrap_or_default()
                } else {
                    String::new()
                };
                Prompt { ids, text }
            }
        };
        let max_tokens = resolve_max_tokens(
            params.max_tokens,
            Some(state.config.default_max_tokens),
            prompt.ids.len(),
            state.limits.max_model_len,
        )?;
        for i in 0..params.n {
            choices.push(ChoiceSpec {
                index: p * params.n + i,
                prompt: prompt.ids.clone(),
                max_tokens,
                sample_index: i,
            });
        }
        prompts.push(prompt);
    }
    let output_format =
        structured::compile_requested(state, &req.common, structured::Framing::Whole, None).await?;
    let spec = GenerationSpec {
        params: params.clone(),
        top_logprobs: logprobs.unwrap_or(0),
        want_logprobs: logprobs.is_some(),
        extra_stop_ids: Vec::new(),
        arrival,
        output_format,
        prompt_logprobs: prompt_scoring,
    };
    let stream = generation::start(state, &spec, choices)?;
    let out = Output {
        state: Arc::clone(state),
        id: random_id("cmpl"),
        created: unix_now(),
        n: params.n,
        echo,
        return_token_ids: params.return_token_ids,
        want_logprobs: logprobs.is_some(),
        echo_logprobs,
        vllm_prompt_logprobs: params.prompt_logprobs,
        include_usage: params.include_usage,
        continuous_usage: params.continuous_usage,
        offsets: vec![0; prompts.len() * params.n],
        completion_tokens: vec![0; prompts.len() * params.n],
        prompts,
    };
    if params.stream {
        let metrics_state = Arc::clone(state);
        return Ok(stream_response(stream, out, move |e| {
            metrics_state.metrics.error(e.error_type())
        }));
    }
    out.collect(stream).await
}

/// Builds chunks or the whole response.
struct Output {
    state: Arc<AppState>,
    id: String,
    created: u64,
    n: usize,
    echo: bool,
    return_token_ids: bool,
    want_logprobs: bool,
    /// `echo` with `logprobs`: the prompt's tokens lead the choice's logprobs, with this many
    /// alternatives each.
    echo_logprobs: Option<usize>,
    /// vLLM's `prompt_logprobs` field on each choice, with this many alternatives.
    vllm_prompt_logprobs: Option<usize>,
    include_usage: bool,
    continuous_usage: bool,
    prompts: Vec<Prompt>,
    /// Characters emitted so far per choice (for `text_offset`).
    offsets: Vec<usize>,
    completion_tokens: Vec<usize>,
}

impl Output {
    fn prompt_of(&self, index: usize) -> &Prompt {
        &self.prompts[index / self.n]
    }

    fn logprobs(&mut self, index: usize, entries: &[TokenLogprob]) -> CompletionLogprobs {
        let mut lp = CompletionLogprobs::default();
        for e in entries {
            let text = self.state.token_text(e.token);
            lp.text_offset.push(self.offsets[index]);
            self.offsets[index] += text.chars().count();
            lp.tokens.push(text);
            lp.token_logprobs.push(Some(e.logprob));
            let mut top: Vec<(String, f32)> = e
                .top
                .iter()
                .map(|&(t, l)| (self.state.token_text(t), l))
                .collect();
            if !e.top.iter().any(|&(t, _)| t == e.token) {
                top.push((self.state.token_text(e.token), e.logprob));
            }
            lp.top_logprobs.push(Some(OrderedLogprobs(top)));
        }
        lp
    }

    fn choice(&mut self, d: ChoiceDelta) -> Result<CompletionChoice, ApiError> {
        self.completion_tokens[d.index] = d.completion_tokens;
        let mut text = d.text;
        let mut prompt_part = None;
        let mut prompt_logprobs = None;
        if d.first {
            let token_text = |t| self.state.token_text(t);
            let ids = &self.prompt_of(d.index).ids;
            let scores = d.prompt_logprobs.as_deref();
            let scores =
                || scores.ok_or_else(|| ApiError::Internal("the prompt was not scored".into()));
            if let Some(top) = self.vllm_prompt_logprobs {
                prompt_logprobs = Some(prompt_logprobs::vllm_field(
                    ids,
                    scores()?,
                    top,
                    token_text,
                )?);
            }
            if let Some(top) = self.echo_logprobs {
                prompt_part = Some(prompt_logprobs::echo_logprobs(
                    ids,
                    scores()?,
                    top,
                    token_text,
                )?);
            }
        }
        if d.first && self.echo {
            let p = self.prompt_of(d.index).text.clone();
            self.offsets[d.index] = p.chars().count();
            text = format!("{p}{text}");
        }
        let logprobs = match prompt_part {
            // The generated tokens' offsets follow the prompt's tokens'.
            Some((mut lp, end)) => {
                self.offsets[d.index] = end;
                let generated = self.logprobs(d.index, &d.logprobs);
                lp.text_offset.extend(generated.text_offset);
                lp.token_logprobs.extend(generated.token_logprobs);
                lp.tokens.extend(generated.tokens);
                lp.top_logprobs.extend(generated.top_logprobs);
                Some(lp)
            }
            None => self
                .want_logprobs
                .then(|| self.logprobs(d.index, &d.logprobs)),
        };
        Ok(CompletionChoice {
            index: d.index,
            text,
            logprobs,
            prompt_logprobs,
            finish_reason: d.finish.as_ref().map(|f| f.reason),
            stop_reason: d.finish.and_then(|f| f.stop_reason),
            prompt_token_ids: (self.return_token_ids && d.first)
                .then(|| self.prompt_of(d.index).ids.clone()),
            token_ids: self.return_token_ids.then_some(d.token_ids),
        })
    }

    fn totals(&self) -> Usage {
        let prompt: usize = self.prompts.iter().map(|p| p.ids.len()).sum();
        Usage::new(prompt, self.completion_tokens.iter().sum())
    }

    fn response(&self, choices: Vec<CompletionChoice>, usage: Option<Usage>) -> CompletionResponse {
        CompletionResponse {
            id: self.id.clone(),
            object: "text_completion",
            created: self.created,
            model: self.state.model_id.clone(),
            choices,
            usage,
        }
    }

    async fn collect(mut self, mut stream: generation::ChoiceStream) -> Result<Response, ApiError> {
        let total = self.prompts.len() * self.n;
        let mut choices: Vec<Option<CompletionChoice>> = vec![None; total];
        while let Some(event) = stream.next().await {
            let d = match event {
                ChoiceEvent::Delta(d) => d,
                ChoiceEvent::Error(e) => return Err(e),
            };
            let index = d.index;
            let c = self.choice(d)?;
            match &mut choices[index] {
                None => choices[index] = Some(c),
                Some(acc) => {
                    acc.text.push_str(&c.text);
                    acc.finish_reason = c.finish_reason;
                    acc.stop_reason = c.stop_reason;
                    if let (Some(a), Some(b)) = (&mut acc.token_ids, c.token_ids) {
                        a.extend(b);
                    }
                    if let (Some(a), Some(b)) = (&mut acc.logprobs, c.logprobs) {
                        a.text_offset.extend(b.text_offset);
                        a.token_logprobs.extend(b.token_logprobs);
                        a.tokens.extend(b.tokens);
                        a.top_logprobs.extend(b.top_logprobs);
                    }
                }
            }
        }
        let choices: Vec<CompletionChoice> = choices.into_iter().flatten().collect();
        if choices.len() != total {
            return Err(ApiError::Internal("a choice ended without output".into()));
        }
        let usage = self.totals();
        Ok(axum::Json(self.response(choices, Some(usage))).into_response())
    }
}

impl ChunkWriter for Output {
    fn delta(&mut self, d: ChoiceDelta) -> Vec<Event> {
        let choice = match self.choice(d) {
            Ok(c) => c,
            Err(e) => return vec![error_event(&e)],
        };
        let usage = self.continuous_usage.then(|| self.totals());
        vec![json_event(&self.response(vec![choice], usage))]
    }

    fn usage(&mut self) -> Option<Event> {
        self.include_usage
            .then(|| json_event(&self.response(Vec::new(), Some(self.totals()))))
    }
}
