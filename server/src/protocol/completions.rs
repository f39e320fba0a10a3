//! `/v1/completions` wire types.

use serde::ser::SerializeMap;
use serde::{Deserialize, Serialize, Serializer};

use super::{CommonParams, StopReason, Usage};

/// `prompt`: text, token ids, or a list of either.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum PromptInput {
    /// One text prompt.
    Text(String),
    /// Several text prompts.
    Texts(Vec<String>),
    /// One prompt as token ids.
    Ids(Vec<i64>),
    /// Several prompts as token ids.
    IdLists(Vec<Vec<i64>>),
}

/// A prompt item before tokenization.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptItem {
    /// Text, to tokenize.
    Text(String),
    /// Token ids as given.
    Ids(Vec<i64>),
}

impl PromptInput {
    /// The prompts, one item each.
    pub fn into_items(self) -> Vec<PromptItem> {
        match self {
            PromptInput::Text(t) => vec![PromptItem::Text(t)],
            PromptInput::Texts(v) => v.into_iter().map(PromptItem::Text).collect(),
            PromptInput::Ids(v) => vec![PromptItem::Ids(v)],
            PromptInput::IdLists(v) => v.into_iter().map(PromptItem::Ids).collect(),
        }
    }
}

/// A completions request.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct CompletionRequest {
    /// The prompt(s).
    pub prompt: Option<PromptInput>,
    /// Shared parameters.
    #[serde(flatten)]
    pub common: CommonParams,
    /// Return this many most likely tokens per position, with their logprobs (0..=20).
    pub logprobs: Option<i64>,
    /// Put the prompt in front of the output.
    pub echo: Option<bool>,
    /// Add the tokenizer's special tokens (BOS) to text prompts (default true).
    pub add_special_tokens: Option<bool>,
}

/// Tokens mapped to logprobs, in order (serialized as a JSON object).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OrderedLogprobs(pub Vec<(String, f32)>);

impl Serialize for OrderedLogprobs {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            map.serialize_entry(k, v)?;
        }
        map.end()
    }
}

/// Logprobs of a completion choice (the legacy completions shape).
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct CompletionLogprobs {
    /// Character offset of each token in the choice's text.
    pub text_offset: Vec<usize>,
    /// Logprob of each token.
    pub token_logprobs: Vec<Option<f32>>,
    /// Each token as text.
    pub tokens: Vec<String>,
    /// The most likely tokens at each position.
    pub top_logprobs: Vec<Option<OrderedLogprobs>>,
}

/// One choice of a completion (or a chunk of one).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct CompletionChoice {
    /// Its index (prompt index times n plus the sample index).
    pub index: usize,
    /// Generated text (the delta, when streaming).
    pub text: String,
    /// Logprobs, when asked for.
    pub logprobs: Option<CompletionLogprobs>,
    /// `stop`, `length`, or null while streaming.
    pub finish_reason: Option<&'static str>,
    /// The stop token or string that ended it (vLLM).
    pub stop_reason: Option<StopReason>,
    /// vLLM's `prompt_logprobs`, on the choice's first chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<super::prompt_logprobs::PromptLogprobsField>,
    /// The prompt's token ids (`return_token_ids`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
    /// The generated token ids (`return_token_ids`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

/// A completions response, or one streamed chunk.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct CompletionResponse {
    /// `cmpl-...`.
    pub id: String,
    /// `text_completion`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// The served model id.
    pub model: String,
    /// Choices.
    pub choices: Vec<CompletionChoice>,
    /// Token counts (in a stream: only in the final chunk, or every chunk with
    /// `continuous_usage_stats`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}
