//! Parse, don't validate: wire parameters become a [`Validated`] once, with errors that name the
//! parameter and its bound (vLLM's wording where it has one).

use model::sampling::{GREEDY_BELOW, SamplingParams};
use step::Penalties;

use crate::error::ApiError;
use crate::protocol::CommonParams;

/// Bounds the server enforces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Token ids must be below this.
    pub vocab_size: usize,
    /// Longest sequence, prompt plus output.
    pub max_model_len: usize,
    /// Largest `n`.
    pub max_n: usize,
    /// Largest `logprobs` / `top_logprobs`.
    pub max_logprobs: usize,
}

/// Parameters after validation.
#[derive(Debug, Clone, PartialEq)]
pub struct Validated {
    /// Temperature, top-p, top-k, min-p (the seed is set per choice).
    pub sampling: SamplingParams,
    /// The request's seed, if it gave one.
    pub seed: Option<u64>,
    /// Repetition penalties.
    pub penalties: Penalties,
    /// Stop strings.
    pub stops: Vec<String>,
    /// Extra stop tokens.
    pub stop_token_ids: Vec<u32>,
    /// Keep the stop string (or stop token's text) in the output.
    pub include_stop_str_in_output: bool,
    /// Choices per prompt.
    pub n: usize,
    /// Do not stop on the model's end-of-sequence tokens.
    pub ignore_eos: bool,
    /// Drop special tokens from the text.
    pub skip_special_tokens: bool,
    /// Stream as server-sent events.
    pub stream: bool,
    /// Final usage chunk.
    pub include_usage: bool,
    /// Usage in every chunk.
    pub continuous_usage: bool,
    /// Add token ids to the response.
    pub return_token_ids: bool,
    /// `max_tokens` / `max_completion_tokens` as requested.
    pub max_tokens: Option<usize>,
    /// vLLM's `prompt_logprobs`: alternatives per prompt position, if prompt logprobs are
    /// wanted.
    pub prompt_logprobs: Option<usize>,
}

fn bad(param: &str, message: String) -> ApiError {
    ApiError::bad_param(param, message)
}

fn finite(param: &str, v: f64) -> Result<f64, ApiError> {
    if v.is_finite() {
        Ok(v)
    } else {
        Err(bad(
            param,
            format!("{param} must be a finite number, got {v}."),
        ))
    }
}

/// Validates the parameters completions and chat share.
pub fn validate_common(p: &CommonParams, limits: &Limits) -> Result<Validated, ApiError> {
    // Checked in this order: the first bad parameter is the one the 400 names.
    let sampling = sampling(p, limits)?;
    let penalties = penalties(p)?;
    let n = p.n.unwrap_or(1);
    if n < 1 || n as u64 > limits.max_n as u64 {
        return Err(bad(
            "n",
            format!("n must be in [1, {}], got {n}.", limits.max_n),
        ));
    }
    let max_tokens = max_tokens(p)?;
    let stop_token_ids = stop_token_ids(p, limits)?;
    let stops: Vec<String> = p
        .stop
        .clone()
        .map(|s| s.into_vec())
        .unwrap_or_default()
        .into_iter()
        .filter(|s| !s.is_empty())
        .collect();
    let stream = streaming(p)?;
    let prompt_logprobs = match p.prompt_logprobs {
        None => None,
        Some(k) if (0..=limits.max_logprobs as i64).contains(&k) => Some(k as usize),
        Some(k) => {
            return Err(bad(
                "prompt_logprobs",
                format!(
                    "prompt_logprobs must be in [0, {}], got {k}.",
                    limits.max_logprobs
                ),
            ));
        }
    };
    Ok(Validated {
        sampling,
        seed: p.seed.map(|s| s as u64),
        penalties,
        stops,
        stop_token_ids,
        include_stop_str_in_output: p.include_stop_str_in_output.unwrap_or(false),
        n: n as usize,
        ignore_eos: p.ignore_eos.unwrap_or(false),
        skip_special_tokens: p.skip_special_tokens.unwrap_or(true),
        stream: stream.stream,
        include_usage: stream.include_usage,
        continuous_usage: stream.continuous_usage,
        return_token_ids: p.return_token_ids.unwrap_or(false),
        max_tokens,
        prompt_logprobs,
    })
}

/// Temperature, top-p, top-k and min-p (the seed is set per choice).
fn sampling(p: &CommonParams, limits: &Limits) -> Result<SamplingParams, ApiError> {
    let temperature = finite("temperature", p.temperature.unwrap_or(1.0))?;
    if temperature < 0.0 {
        return Err(bad(
            "temperature",
            format!("temperature must be non-negative, got {temperature}."),
        ));
    }
    if temperature > f32::MAX as f64 {
        return Err(bad(
            "temperature",
            format!(
                "temperature must be at most {}, got {temperature}.",
                f32::MAX
            ),
        ));
    }
    // Dividing logits by a temperature this small overflows them (a subnormal such as 1e-40
    // made every token tie): such requests decode greedily, as vLLM treats them.
    let temperature = if temperature < GREEDY_BELOW as f64 {
        0.0
    } else {
        temperature
    };
    let top_p = finite("top_p", p.top_p.unwrap_or(1.0))?;
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(bad(
            "top_p",
            format!("top_p must be in (0, 1], got {top_p}."),
        ));
    }
    let top_k = match p.top_k.unwrap_or(0) {
        -1 | 0 => 0,
        k if k >= 1 => usize::try_from(k)
            .unwrap_or(usize::MAX)
            .min(limits.vocab_size),
        k => {
            return Err(bad(
                "top_k",
                format!("top_k must be 0 or -1 (disable), or at least 1, got {k}."),
            ));
        }
    };
    let min_p = finite("min_p", p.min_p.unwrap_or(0.0))?;
    if !(0.0..=1.0).contains(&min_p) {
        return Err(bad(
            "min_p",
            format!("min_p must be in [0, 1], got {min_p}."),
        ));
    }
    Ok(SamplingParams {
        temperature: temperature as f32,
        top_p: top_p as f32,
        top_k,
        min_p: min_p as f32,
        seed: 0,
    })
}

/// Presence, frequency and repetition penalties.
fn penalties(p: &CommonParams) -> Result<Penalties, ApiError> {
    let presence = finite("presence_penalty", p.presence_penalty.unwrap_or(0.0))?;
    let frequency = finite("frequency_penalty", p.frequency_penalty.unwrap_or(0.0))?;
    for (name, v) in [
        ("presence_penalty", presence),
        ("frequency_penalty", frequency),
    ] {
        if !(-2.0..=2.0).contains(&v) {
            return Err(bad(name, format!("{name} must be in [-2, 2], got {v}.")));
        }
    }
    let repetition = finite("repetition_penalty", p.repetition_penalty.unwrap_or(1.0))?;
    if !(repetition > 0.0 && repetition <= 2.0) {
        return Err(bad(
            "repetition_penalty",
            format!("repetition_penalty must be in (0, 2], got {repetition}."),
        ));
    }
    Ok(Penalties {
        presence: presence as f32,
        frequency: frequency as f32,
        repetition: repetition as f32,
    })
}

/// `max_completion_tokens`, else `max_tokens` (at least 1), if either is given.
fn max_tokens(p: &CommonParams) -> Result<Option<usize>, ApiError> {
    let given = match (p.max_completion_tokens, p.max_tokens) {
        (Some(v), _) => Some(("max_completion_tokens", v)),
        (None, Some(v)) => Some(("max_tokens", v)),
        (None, None) => None,
    };
    match given {
        Some((name, v)) if v < 1 => Err(bad(name, format!("{name} must be at least 1, got {v}."))),
        Some((_, v)) => Ok(Some(usize::try_from(v).unwrap_or(usize::MAX))),
        None => Ok(None),
    }
}

/// `stop_token_ids`, each inside the vocabulary.
fn stop_token_ids(p: &CommonParams, limits: &Limits) -> Result<Vec<u32>, ApiError> {
    p.stop_token_ids
        .as_deref()
        .unwrap_or(&[])
        .iter()
        .map(|&id| {
            if id < 0 || id as u64 >= limits.vocab_size as u64 {
                return Err(bad(
                    "stop_token_ids",
                    format!(
                        "stop_token_ids contains {id}, outside the vocabulary [0, {}).",
                        limits.vocab_size
                    ),
                ));
            }
            Ok(id as u32)
        })
        .collect()
}

/// Whether to stream, and the usage a stream carries.
struct Streaming {
    stream: bool,
    include_usage: bool,
    continuous_usage: bool,
}

fn streaming(p: &CommonParams) -> Result<Streaming, ApiError> {
    let stream = p.stream.unwrap_or(false);
    let options = p.stream_options.as_ref();
    if options.is_some() && !stream {
        return Err(bad(
            "stream_options",
            "stream_options can only be set when stream is true.".into(),
        ));
    }
    Ok(Streaming {
        stream,
        include_usage: options.is_some_and(|o| o.include_usage.unwrap_or(true)),
        continuous_usage: options.is_some_and(|o| o.continuous_usage_stats.unwrap_or(false)),
    })
}

/// Checks token ids given by the client against the vocabulary.
pub fn check_token_ids(ids: &[i64], param: &str, vocab_size: usize) -> Result<Vec<u32>, ApiError> {
    ids.iter()
        .map(|&id| {
            if id < 0 || id as u64 >= vocab_size as u64 {
                Err(bad(
                    param,
                    format!(
                        "Token id {id} is out of vocabulary (valid ids are 0 to {}).",
                        vocab_size - 1
                    ),
                ))
            } else {
                Ok(id as u32)
            }
        })
        .collect()
}

/// The number of tokens to generate for a prompt of `prompt_len`: the request's value, else
/// `default` (16 for completions), else whatever fits; 400 when the prompt alone, or the
/// prompt plus an explicit `max_tokens`, exceeds `max_model_len`.
pub fn resolve_max_tokens(
    requested: Option<usize>,
    default: Option<usize>,
    prompt_len: usize,
    max_model_len: usize,
) -> Result<usize, ApiError> {
    if prompt_len == 0 {
        return Err(bad(
            "prompt",
            "The prompt is empty: give at least one token.".into(),
        ));
    }
    if prompt_len >= max_model_len {
        return Err(bad(
            "prompt",
            format!(
                "This model's maximum context length is {max_model_len} tokens. However, your \
                 request has {prompt_len} input tokens, which leaves no room for output. Please \
                 reduce the length of the input."
            ),
        ));
    }
    let room = max_model_len - prompt_len;
    match requested {
        Some(m) if m > room => Err(bad(
            "max_tokens",
            format!(
                "This model's maximum context length is {max_model_len} tokens. However, you \
                 requested {} tokens ({prompt_len} in the input, {m} in the completion). Please \
                 reduce the length of the input or of max_tokens (at most {room} here).",
                prompt_len.saturating_add(m)
            ),
        )),
        Some(m) => Ok(m),
        None => Ok(default.unwrap_or(room).min(room)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        vocab_size: 100,
        max_model_len: 50,
        max_n: 8,
        max_logprobs: 20,
    };

    fn check(json: serde_json::Value) -> Result<Validated, ApiError> {
        let p: CommonParams = serde_json::from_value(json).unwrap();
        validate_common(&p, &LIMITS)
    }

    fn param_of(e: ApiError) -> Option<String> {
        match e {
            ApiError::BadRequest { param, .. } => param,
            _ => None,
        }
    }

    #[test]
    fn each_bad_parameter_is_named() {
        for (json, param) in [
            (serde_json::json!({"temperature": -0.5}), "temperature"),
            (serde_json::json!({"temperature": 1e300}), "temperature"),
            (serde_json::json!({"top_p": 0.0}), "top_p"),
            (serde_json::json!({"top_p": 1.5}), "top_p"),
            (serde_json::json!({"top_k": -2}), "top_k"),
            (serde_json::json!({"min_p": 1.5}), "min_p"),
            (
                serde_json::json!({"presence_penalty": 3.0}),
                "presence_penalty",
            ),
            (
                serde_json::json!({"frequency_penalty": -2.5}),
                "frequency_penalty",
            ),
            (
                serde_json::json!({"repetition_penalty": 0.0}),
                "repetition_penalty",
            ),
            (serde_json::json!({"n": 0}), "n"),
            (serde_json::json!({"n": 9}), "n"),
            (serde_json::json!({"max_tokens": 0}), "max_tokens"),
            (
                serde_json::json!({"max_completion_tokens": -1}),
                "max_completion_tokens",
            ),
            (
                serde_json::json!({"stop_token_ids": [100]}),
                "stop_token_ids",
            ),
            (
                serde_json::json!({"stream_options": {"include_usage": true}}),
                "stream_options",
            ),
        ] {
            let err = check(json.clone()).unwrap_err();
            assert_eq!(
                param_of(err.clone()).as_deref(),
                Some(param),
                "{json}: {err}"
            );
        }
    }

    #[test]
    fn defaults_and_aliases() {
        let v = check(serde_json::json!({"max_completion_tokens": 7, "max_tokens": 3, "top_k": -1, "stop": "x"})).unwrap();
        assert_eq!(v.max_tokens, Some(7), "max_completion_tokens wins");
        assert_eq!(v.sampling.top_k, 0);
        assert_eq!(v.sampling.temperature, 1.0);
        assert_eq!(v.stops, vec!["x".to_string()]);
        assert!(v.skip_special_tokens);
        let v = check(serde_json::json!({"stream": true, "stream_options": {}})).unwrap();
        assert!(
            v.include_usage,
            "vLLM: include_usage defaults to true once stream_options is set"
        );
    }

    #[test]
    fn temperatures_too_small_to_divide_by_become_greedy() {
        for t in [1e-40, 1e-38, 1e-30, 9.99e-6] {
            let v = check(serde_json::json!({"temperature": t})).unwrap();
            assert_eq!(v.sampling.temperature, 0.0, "{t}");
            assert!(v.sampling.is_greedy());
        }
        let v = check(serde_json::json!({"temperature": 1e-5})).unwrap();
        assert!(!v.sampling.is_greedy());
        assert!(v.sampling.temperature > 0.0);
    }

    #[test]
    fn lengths() {
        assert_eq!(resolve_max_tokens(None, Some(16), 10, 50).unwrap(), 16);
        assert_eq!(
            resolve_max_tokens(None, Some(16), 40, 50).unwrap(),
            10,
            "clamped"
        );
        assert_eq!(resolve_max_tokens(None, None, 40, 50).unwrap(), 10);
        assert!(resolve_max_tokens(Some(11), None, 40, 50).is_err());
        assert!(resolve_max_tokens(None, None, 50, 50).is_err());
        assert!(check_token_ids(&[1, 99], "prompt", 100).is_ok());
        assert!(check_token_ids(&[100], "prompt", 100).is_err());
        assert!(check_token_ids(&[-1], "prompt", 100).is_err());
    }
}
