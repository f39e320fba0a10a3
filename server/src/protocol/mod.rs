//! Wire types of the OpenAI-compatible API, as vLLM accepts and returns them.
//!
//! Requests keep every parameter as received (numbers as `f64`/`i64`) so that validation can
//! name the parameter and its bound instead of failing inside serde; unknown fields are
//! ignored, as vLLM does.

pub mod chat;
pub mod completions;
pub mod prompt_logprobs;
pub mod responses;

use serde::{Deserialize, Serialize};

/// `stop`: one string or a list.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum StopSpec {
    /// One stop string.
    One(String),
    /// Several.
    Many(Vec<String>),
}

impl StopSpec {
    /// The strings.
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StopSpec::One(s) => vec![s],
            StopSpec::Many(v) => v,
        }
    }
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct StreamOptions {
    /// Send a last chunk with `usage` (vLLM: true once the object is present).
    pub include_usage: Option<bool>,
    /// Put `usage` in every chunk.
    pub continuous_usage_stats: Option<bool>,
}

/// Sampling and output parameters shared by completions and chat.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct CommonParams {
    /// The served model's id (or root); checked when set.
    pub model: Option<String>,
    /// Tokens to generate (deprecated in chat in favour of `max_completion_tokens`).
    pub max_tokens: Option<i64>,
    /// Tokens to generate.
    pub max_completion_tokens: Option<i64>,
    /// Sampling temperature; 0 is greedy.
    pub temperature: Option<f64>,
    /// Nucleus mass in (0, 1].
    pub top_p: Option<f64>,
    /// Keep the k most likely tokens; 0 or -1 disables.
    pub top_k: Option<i64>,
    /// Relative probability floor in [0, 1].
    pub min_p: Option<f64>,
    /// Seed of the sampler.
    pub seed: Option<i64>,
    /// Stop strings.
    pub stop: Option<StopSpec>,
    /// Tokens that end generation.
    pub stop_token_ids: Option<Vec<i64>>,
    /// Put the matched stop string at the end of the output.
    pub include_stop_str_in_output: Option<bool>,
    /// Choices per prompt.
    pub n: Option<i64>,
    /// Keep generating after an end-of-sequence token.
    pub ignore_eos: Option<bool>,
    /// Penalty on tokens already generated, once.
    pub presence_penalty: Option<f64>,
    /// Penalty on tokens already generated, per occurrence.
    pub frequency_penalty: Option<f64>,
    /// Divides the logits of tokens already seen (vLLM/TGI extension).
    pub repetition_penalty: Option<f64>,
    /// Drop special tokens from the text (default true).
    pub skip_special_tokens: Option<bool>,
    /// Stream the answer as server-sent events.
    pub stream: Option<bool>,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Add `prompt_token_ids` and `choices[].token_ids` (vLLM).
    pub return_token_ids: Option<bool>,
    /// OpenAI's output format: `{"type": "text" | "json_object" | "json_schema", ...}`.
    pub response_format: Option<serde_json::Value>,
    /// vLLM's structured outputs: one of `json`, `regex`, `choice`, `grammar`.
    pub structured_outputs: Option<serde_json::Value>,
    /// Older vLLM's name for `structured_outputs.json`.
    pub guided_json: Option<serde_json::Value>,
    /// Older vLLM's name for `structured_outputs.regex`.
    pub guided_regex: Option<serde_json::Value>,
    /// Older vLLM's name for `structured_outputs.choice`.
    pub guided_choice: Option<serde_json::Value>,
    /// Older vLLM's name for `structured_outputs.grammar`.
    pub guided_grammar: Option<serde_json::Value>,
    /// vLLM's prompt logprobs: the logprob of every prompt token after the first, with this
    /// many most likely alternatives per position (0..=`max_logprobs`).
    pub prompt_logprobs: Option<i64>,
}

/// Token counts of a response.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Both.
    pub total_tokens: usize,
}

impl Usage {
    /// Usage of `prompt` prompt tokens and `completion` generated ones.
    pub fn new(prompt: usize, completion: usize) -> Self {
        Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
        }
    }
}

/// vLLM's `stop_reason`: the stop token id or stop string that ended a choice.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum StopReason {
    /// A token from `stop_token_ids`.
    Token(u32),
    /// A stop string.
    Text(String),
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A random id with a prefix, e.g. `cmpl-5f0c...`.
pub fn random_id(prefix: &str) -> String {
    format!("{prefix}-{:032x}", rand::random::<u128>())
}
