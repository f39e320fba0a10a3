//! From validated requests to a stream of per-choice text deltas: submits every choice to the
//! router, and turns each choice's tokens into text with the incremental detokenizer and the
//! stop-string matcher, recording the per-request metrics on the way.
//!
//! Dropping the stream (the client went away) drops every choice's [`RequestStream`], which
//! aborts the requests and frees their KV blocks at once. A server that shuts down ends the
//! stream with an error at the end of its drain ([`crate::lifecycle`]).

use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use futures::{Stream, StreamExt};
use router::{
    FinishReason, GenerationRequest, RequestEvent, RequestStream, SequenceParams, TokenOutput,
};
use step::{SampleRequest, ScoredToken};

use crate::detokenize::IncrementalDetokenizer;
use crate::error::ApiError;
use crate::lifecycle::Lifecycle;
use crate::metrics::{FinishedReason, SequenceTiming};
use crate::protocol::StopReason;
use crate::state::AppState;
use crate::stop::{StopCheck, StopMatcher};
use crate::structured::CompiledFormat;
use crate::validation::Validated;

/// One choice to generate.
#[derive(Debug, Clone, PartialEq)]
pub struct ChoiceSpec {
    /// Its index in the response.
    pub index: usize,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Tokens to generate.
    pub max_tokens: usize,
    /// Sample index within its prompt (offsets the seed).
    pub sample_index: usize,
}

/// What every choice of a request shares.
#[derive(Debug, Clone)]
pub struct GenerationSpec {
    /// Validated parameters.
    pub params: Validated,
    /// Alternatives per token to return (0: none).
    pub top_logprobs: usize,
    /// Return each token's logprob.
    pub want_logprobs: bool,
    /// Extra stop tokens of the endpoint (GPT-OSS chat: `<|return|>`, `<|call|>`).
    pub extra_stop_ids: Vec<u32>,
    /// When the request arrived.
    pub arrival: Instant,
    /// The grammar every choice's output follows (structured outputs), if any.
    pub output_format: Option<Arc<CompiledFormat>>,
    /// Score every prompt token with this many alternatives (prompt logprobs), if wanted.
    pub prompt_logprobs: Option<usize>,
}

/// One token's logprob and its alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    /// The token.
    pub token: u32,
    /// Its logprob.
    pub logprob: f32,
    /// Alternatives, best first.
    pub top: Vec<(u32, f32)>,
}

/// How a choice ended.
#[derive(Debug, Clone, PartialEq)]
pub struct Finish {
    /// `stop` or `length`.
    pub reason: &'static str,
    /// The stop token or string, for vLLM's `stop_reason`.
    pub stop_reason: Option<StopReason>,
}

/// New output of one choice.
#[derive(Debug, Clone, PartialEq)]
pub struct ChoiceDelta {
    /// The choice.
    pub index: usize,
    /// New text.
    pub text: String,
    /// New tokens.
    pub token_ids: Vec<u32>,
    /// Their logprobs (when asked for).
    pub logprobs: Vec<TokenLogprob>,
    /// Set on the last delta.
    pub finish: Option<Finish>,
    /// The first delta of the choice.
    pub first: bool,
    /// Tokens generated so far by this choice.
    pub completion_tokens: usize,
    /// On the first delta of a choice that asked for prompt logprobs: every prompt token's
    /// after the first.
    pub prompt_logprobs: Option<Vec<ScoredToken>>,
}

/// What the merged stream yields.
#[derive(Debug, Clone, PartialEq)]
pub enum ChoiceEvent {
    /// New output.
    Delta(ChoiceDelta),
    /// The request failed.
    Error(ApiError),
}

/// The merged stream of every choice.
pub type ChoiceStream = Pin<Box<dyn Stream<Item = ChoiceEvent> + Send>>;

/// Submits every choice, all or none: fails, with nothing queued, if the router refuses them.
pub fn start(
    state: &Arc<AppState>,
    spec: &GenerationSpec,
    choices: Vec<ChoiceSpec>,
) -> Result<ChoiceStream, ApiError> {
    let p = &spec.params;
    let mut stop_token_ids: Vec<u32> = p.stop_token_ids.clone();
    stop_token_ids.extend(&spec.extra_stop_ids);
    if !p.ignore_eos {
        stop_token_ids.extend(&state.eos_token_ids);
    }
    stop_token_ids.sort_unstable();
    stop_token_ids.dedup();
    let base_seed = p.seed.unwrap_or_else(rand::random);
    let requests = choices
        .iter()
        .map(|c| {
            let mut sampling = p.sampling;
            sampling.seed = base_seed.wrapping_add(c.sample_index as u64);
            GenerationRequest {
                prompt: c.prompt.clone(),
                params: SequenceParams {
                    max_tokens: c.max_tokens,
                    sample: SampleRequest {
                        params: sampling,
                        penalties: p.penalties,
                        logprobs: spec.want_logprobs,
                        top_logprobs: spec.top_logprobs,
                        allowed: None,
                    },
                    stop_token_ids: stop_token_ids.clone(),
                    // Each choice walks its own copy of the grammar.
                    constraint: spec.output_format.as_ref().map(|f| f.constraint()),
                    prompt_logprobs: spec.prompt_logprobs,
                },
                arrival: spec.arrival,
            }
        })
        .collect();
    // Every choice is admitted, or none: a refusal leaves no queued choice behind.
    let admitted = state.router.submit_all(requests)?;
    let mut streams = Vec::with_capacity(admitted.len());
    for (c, stream) in choices.into_iter().zip(admitted) {
        state.metrics.request_params(p.n, c.max_tokens);
        let tracker = ChoiceTracker {
            state: Arc::clone(state),
            index: c.index,
            detok: IncrementalDetokenizer::new(&c.prompt, p.skip_special_tokens),
            stop: StopMatcher::new(&p.stops, p.include_stop_str_in_output),
            include_stop: p.include_stop_str_in_output,
            user_stop_ids: p.stop_token_ids.clone(),
            want_logprobs: spec.want_logprobs,
            timing: SequenceTiming {
                arrival: spec.arrival,
                first_scheduled: None,
                first_token: None,
                last_token: None,
                generated: 0,
                prompt_tokens: c.prompt.len(),
                max_tokens: c.max_tokens,
            },
            finished: false,
        };
        streams.push(choice_stream(stream, tracker));
    }
    let merged: ChoiceStream = Box::pin(futures::stream::select_all(streams));
    Ok(until_cut_off(merged, state.lifecycle.cut_signal()))
}

/// `choices` until the server cuts off what still runs at the end of a drain: then one
/// error, and the end (dropping the choices aborts their requests).
fn until_cut_off(
    choices: ChoiceStream,
    cut: impl std::future::Future<Output = ()> + Send + 'static,
) -> ChoiceStream {
    let cut: Pin<Box<dyn std::future::Future<Output = ()> + Send>> = Box::pin(cut);
    Box::pin(futures::stream::unfold(
        Some((choices, cut)),
        |running| async move {
            let (mut choices, mut cut) = running?;
            tokio::select! {
                biased;
                () = &mut cut => Some((ChoiceEvent::Error(Lifecycle::cut_off_error()), None)),
                event = choices.next() => event.map(|e| (e, Some((choices, cut)))),
            }
        },
    ))
}

struct ChoiceTracker {
    state: Arc<AppState>,
    index: usize,
    detok: IncrementalDetokenizer,
    stop: StopMatcher,
    include_stop: bool,
    user_stop_ids: Vec<u32>,
    want_logprobs: bool,
    timing: SequenceTiming,
    finished: bool,
}

impl ChoiceTracker {
    fn push_text(&mut self, piece: &str, delta: &mut ChoiceDelta) {
        if delta.finish.is_some() || piece.is_empty() {
            return;
        }
        match self.stop.push(piece) {
            StopCheck::Continue(t) => delta.text.push_str(&t),
            StopCheck::Stopped { text, stop } => {
                delta.text.push_str(&text);
                delta.finish = Some(Finish {
                    reason: "stop",
                    stop_reason: Some(StopReason::Text(stop)),
                });
            }
        }
    }

    fn decode(&mut self, token: u32) -> Result<String, ApiError> {
        self.detok
            .push(&self.state.tokenizer, token)
            .map_err(|e| ApiError::Internal(format!("detokenizing: {e}")))
    }

    fn flush(&mut self, delta: &mut ChoiceDelta) -> Result<(), ApiError> {
        let tail = self
            .detok
            .flush(&self.state.tokenizer)
            .map_err(|e| ApiError::Internal(format!("detokenizing: {e}")))?;
        self.push_text(&tail, delta);
        if delta.finish.is_none() {
            delta.text.push_str(&self.stop.flush());
        }
        Ok(())
    }

    /// Turns tokens (several when the client fell behind) into one delta.
    fn on_tokens(&mut self, tokens: Vec<TokenOutput>) -> Result<ChoiceDelta, ApiError> {
        let mut delta = ChoiceDelta {
            index: self.index,
            text: String::new(),
            token_ids: Vec::with_capacity(tokens.len()),
            logprobs: Vec::new(),
            finish: None,
            first: self.timing.generated == 0,
            completion_tokens: 0,
            prompt_logprobs: None,
        };
        for t in tokens {
            if delta.finish.is_some() {
                break;
            }
            self.note_timing(&t);
            if t.prompt_logprobs.is_some() {
                delta.prompt_logprobs = t.prompt_logprobs.clone();
            }
            delta.token_ids.push(t.token);
            if self.want_logprobs {
                delta.logprobs.push(TokenLogprob {
                    token: t.token,
                    logprob: t.logprob,
                    top: t.top_logprobs.clone(),
                });
            }
            match t.finish {
                Some(FinishReason::StopToken(tok)) => {
                    if self.include_stop {
                        let piece = self.decode(tok)?;
                        self.push_text(&piece, &mut delta);
                    }
                    self.flush(&mut delta)?;
                    if delta.finish.is_none() {
                        delta.finish = Some(Finish {
                            reason: "stop",
                            stop_reason: self
                                .user_stop_ids
                                .contains(&tok)
                                .then_some(StopReason::Token(tok)),
                        });
                    }
                }
                Some(FinishReason::Length) => {
                    let piece = self.decode(t.token)?;
                    self.push_text(&piece, &mut delta);
                    self.flush(&mut delta)?;
                    if delta.finish.is_none() {
                        delta.finish = Some(Finish {
                            reason: "length",
                            stop_reason: None,
                        });
                    }
                }
                None => {
                    let piece = self.decode(t.token)?;
                    self.push_text(&piece, &mut delta);
                }
            }
        }
        delta.completion_tokens = self.timing.generated;
        if let Some(f) = &delta.finish {
            self.finished = true;
            let reason = if f.reason == "length" {
                FinishedReason::Length
            } else {
                FinishedReason::Stop
            };
            self.state
                .metrics
                .finished(&self.timing, reason, self.state.router.clock().now());
        }
        Ok(delta)
    }

    fn note_timing(&mut self, t: &TokenOutput) {
        let timing = &mut self.timing;
        timing.generated += 1;
        match timing.last_token {
            None => {
                timing.first_scheduled = Some(t.first_scheduled);
                timing.first_token = Some(t.produced_at);
                self.state.metrics.first_token(timing);
            }
            Some(last) => self
                .state
                .metrics
                .inter_token(t.produced_at.saturating_duration_since(last)),
        }
        timing.last_token = Some(t.produced_at);
    }
}

impl Drop for ChoiceTracker {
    fn drop(&mut self) {
        if !self.finished {
            self.state.metrics.finished(
                &self.timing,
                FinishedReason::Abort,
                self.state.router.clock().now(),
            );
        }
    }
}

struct ChoiceState {
    stream: Option<RequestStream>,
    tracker: ChoiceTracker,
    pending: Option<RequestEvent>,
}

fn choice_stream(stream: RequestStream, tracker: ChoiceTracker) -> ChoiceStream {
    let state = ChoiceState {
        stream: Some(stream),
        tracker,
        pending: None,
    };
    Box::pin(futures::stream::unfold(state, |mut st| async move {
        let stream = st.stream.as_mut()?;
        let event = match st.pending.take() {
            Some(e) => Some(e),
            None => stream.next().await,
        };
        let first = match event {
            None => {
                st.stream = None;
                let e = ApiError::Internal("the engine dropped the request".into());
                return Some((ChoiceEvent::Error(e), st));
            }
            Some(Err(e)) => {
                st.stream = None;
                return Some((ChoiceEvent::Error(e.into()), st));
            }
            Some(Ok(t)) => t,
        };
        // Take every token already waiting, so a client that fell behind catches up in one
        // chunk (as vLLM's output collector merges deltas).
        let mut tokens = vec![first];
        while tokens.last().is_some_and(|t| t.finish.is_none()) {
            match stream.try_next() {
                Some(Ok(t)) => tokens.push(t),
                Some(Err(e)) => {
                    st.pending = Some(Err(e));
                    break;
                }
                None => break,
            }
        }
        match st.tracker.on_tokens(tokens) {
            Ok(delta) => {
                if delta.finish.is_some() {
                    // Finished here (stop string) or in the engine: either way release it now.
                    if let Some(s) = st.stream.take() {
                        s.abort();
                    }
                }
                Some((ChoiceEvent::Delta(delta), st))
            }
            Err(e) => {
                st.stream = None;
                Some((ChoiceEvent::Error(e), st))
            }
        }
    }))
}
