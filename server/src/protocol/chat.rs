//! `/v1/chat/completions` wire types.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::{CommonParams, StopReason, Usage};

/// One part of a message's content.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct ContentPart {
    /// `text` (other kinds are refused).
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    pub text: Option<String>,
}

/// A message's content: a string or a list of parts.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum MessageContent {
    /// Plain text.
    Text(String),
    /// Parts (text only here).
    Parts(Vec<ContentPart>),
}

/// A chat message; fields other than `role` and `content` go to the template as given.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct ChatMessage {
    /// `system`, `developer`, `user`, `assistant`, `tool`, ...
    pub role: String,
    /// The content.
    pub content: Option<MessageContent>,
    /// Everything else (name, tool_calls, ...).
    #[serde(flatten)]
    pub rest: Map<String, Value>,
}

/// A chat completions request.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct ChatCompletionRequest {
    /// The conversation.
    pub messages: Option<Vec<ChatMessage>>,
    /// Shared parameters.
    #[serde(flatten)]
    pub common: CommonParams,
    /// Return the logprob of each output token.
    pub logprobs: Option<bool>,
    /// And this many alternatives per position (0..=20; needs `logprobs`).
    pub top_logprobs: Option<i64>,
    /// End the prompt with the assistant's header (default true).
    pub add_generation_prompt: Option<bool>,
    /// Continue the last (assistant) message instead of starting a new one.
    pub continue_final_message: Option<bool>,
    /// Add the tokenizer's special tokens on top of the template (default false).
    pub add_special_tokens: Option<bool>,
    /// Extra variables for the template.
    pub chat_template_kwargs: Option<Map<String, Value>>,
    /// Tool definitions (`[{"type": "function", "function": {"name", ...}}]`), passed to
    /// the template.
    pub tools: Option<Value>,
    /// `"auto"` (the default with tools), `"none"` (the default without); `"required"` and a
    /// named function are refused for now.
    pub tool_choice: Option<Value>,
    /// Keep every tool call of the output (default true), or only the first.
    pub parallel_tool_calls: Option<bool>,
    /// GPT-OSS reasoning effort, passed to the template.
    pub reasoning_effort: Option<String>,
}

/// One alternative token with its logprob.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TopLogprob {
    /// The token's text.
    pub token: String,
    /// Its logprob.
    pub logprob: f32,
    /// Its UTF-8 bytes.
    pub bytes: Vec<u8>,
}

/// The logprob of one output token.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ChatLogprobEntry {
    /// The token's text.
    pub token: String,
    /// Its logprob.
    pub logprob: f32,
    /// Its UTF-8 bytes.
    pub bytes: Vec<u8>,
    /// The most likely alternatives.
    pub top_logprobs: Vec<TopLogprob>,
}

/// Logprobs of a chat choice.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct ChatLogprobs {
    /// One entry per output token.
    pub content: Vec<ChatLogprobEntry>,
}

/// The assistant's message.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct AssistantMessage {
    /// `assistant`.
    pub role: &'static str,
    /// The answer's text; null when the message is only tool calls.
    pub content: Option<String>,
    /// The model's reasoning, when a reasoning parser found some (vLLM's field).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// The functions the model calls.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
}

/// A function call of the assistant.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ToolCall {
    /// `call_...`, which the `tool` message answering it names.
    pub id: String,
    /// `function`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The function and its arguments.
    pub function: FunctionCall,
}

/// A function's name and arguments.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct FunctionCall {
    /// The function's name.
    pub name: String,
    /// Its arguments, JSON text as the model wrote it.
    pub arguments: String,
}

/// A piece of a streamed tool call: the first carries `id`, `type` and the name, the next
/// ones pieces of the arguments.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ToolCallDelta {
    /// Which call of the choice (0, 1, ...).
    pub index: usize,
    /// The call's id (first piece only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// `function` (first piece only).
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    /// The name and the next piece of the arguments.
    pub function: FunctionCallDelta,
}

/// A piece of a streamed function call.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct FunctionCallDelta {
    /// The name (first piece only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The next piece of the arguments' JSON text.
    pub arguments: String,
}

/// One choice of a chat completion.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ChatChoice {
    /// Its index.
    pub index: usize,
    /// The message.
    pub message: AssistantMessage,
    /// Logprobs, when asked for.
    pub logprobs: Option<ChatLogprobs>,
    /// `stop`, `length`, or `tool_calls` (stopped after calling tools).
    pub finish_reason: Option<&'static str>,
    /// The stop token or string that ended it (vLLM).
    pub stop_reason: Option<StopReason>,
    /// The generated token ids (`return_token_ids`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

/// A chat completion.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ChatCompletionResponse {
    /// `chatcmpl-...`.
    pub id: String,
    /// `chat.completion`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// The served model id.
    pub model: String,
    /// Choices.
    pub choices: Vec<ChatChoice>,
    /// Token counts.
    pub usage: Usage,
    /// The prompt's token ids (`return_token_ids`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
    /// vLLM's `prompt_logprobs` of the rendered prompt.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<super::prompt_logprobs::PromptLogprobsField>,
}

/// What changed in a streamed choice.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct ChatDelta {
    /// `assistant`, in the first chunk of a choice only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    /// New text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// New reasoning text (vLLM's field).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// New pieces of tool calls.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

/// One choice of a streamed chunk.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ChatChunkChoice {
    /// Its index.
    pub index: usize,
    /// The change.
    pub delta: ChatDelta,
    /// Logprobs of the new tokens.
    pub logprobs: Option<ChatLogprobs>,
    /// Set in the last chunk of the choice.
    pub finish_reason: Option<&'static str>,
    /// The stop token or string that ended it (vLLM).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<StopReason>,
    /// The new token ids (`return_token_ids`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

/// A streamed chat chunk.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ChatCompletionChunk {
    /// The same id in every chunk.
    pub id: String,
    /// `chat.completion.chunk`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// The served model id.
    pub model: String,
    /// Choices.
    pub choices: Vec<ChatChunkChoice>,
    /// Token counts (final chunk, or every chunk with `continuous_usage_stats`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// The prompt's token ids, in the first chunk (`return_token_ids`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
    /// vLLM's `prompt_logprobs`, in the first chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<super::prompt_logprobs::PromptLogprobsField>,
}
