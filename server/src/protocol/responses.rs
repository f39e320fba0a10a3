//! `/v1/responses` wire types: the request as OpenAI's Responses API defines it, the response
//! object, its output items, and the typed events of a streamed response.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// `reasoning`: how hard a reasoning model thinks.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
pub struct ReasoningParams {
    /// `low`, `medium` or `high` (GPT-OSS's reasoning effort).
    pub effort: Option<String>,
    /// A summary of the reasoning (not produced here; echoed back as given).
    pub summary: Option<String>,
}

/// A Responses API request. `input` stays JSON until it is turned into messages, so that
/// an error can name the item that was wrong.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct ResponsesRequest {
    /// The served model's id (or root); checked when set.
    pub model: Option<String>,
    /// Text (one user message) or a list of items: messages, function calls and their outputs,
    /// reasoning.
    pub input: Option<Value>,
    /// A system (developer, for GPT-OSS) message put first.
    pub instructions: Option<String>,
    /// Tokens to generate, reasoning included.
    pub max_output_tokens: Option<i64>,
    /// Sampling temperature; 0 is greedy.
    pub temperature: Option<f64>,
    /// Nucleus mass in (0, 1].
    pub top_p: Option<f64>,
    /// Keep the k most likely tokens (vLLM's extension).
    pub top_k: Option<i64>,
    /// Seed of the sampler (vLLM's extension).
    pub seed: Option<i64>,
    /// Stream typed events.
    pub stream: Option<bool>,
    /// Function tools: `[{"type": "function", "name", "description", "parameters"}]`.
    pub tools: Option<Value>,
    /// `"auto"`, `"none"`, `"required"` or `{"type": "function", "name"}`.
    pub tool_choice: Option<Value>,
    /// Keep every tool call of the output (default true), or only the first.
    pub parallel_tool_calls: Option<bool>,
    /// Reasoning effort.
    pub reasoning: Option<ReasoningParams>,
    /// `{"format": {"type": "text" | "json_object" | "json_schema", ...}}`: chat's
    /// `response_format`.
    pub text: Option<Value>,
    /// Whether to store the response; this server stores nothing (the response says so).
    pub store: Option<bool>,
    /// Continue a stored response: refused, nothing is stored.
    pub previous_response_id: Option<String>,
    /// A stored conversation: refused, nothing is stored.
    pub conversation: Option<Value>,
    /// Run in the background: refused (it needs storage to fetch the result).
    pub background: Option<bool>,
    /// Alternatives per output token: refused here (chat completions has them).
    pub top_logprobs: Option<i64>,
    /// `disabled` (the default) or `auto`; a prompt too long is an error either way.
    pub truncation: Option<String>,
    /// Echoed back.
    pub metadata: Option<Value>,
    /// Echoed back.
    pub user: Option<String>,
}

/// One part of an output message.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct OutputText {
    /// `output_text`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The text.
    pub text: String,
    /// Always empty (no citations).
    pub annotations: Vec<Value>,
}

impl OutputText {
    /// A part holding `text`.
    pub fn new(text: String) -> Self {
        OutputText {
            kind: "output_text",
            text,
            annotations: Vec::new(),
        }
    }
}

/// One part of a reasoning item.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ReasoningText {
    /// `reasoning_text`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The reasoning.
    pub text: String,
}

impl ReasoningText {
    /// A part holding `text`.
    pub fn new(text: String) -> Self {
        ReasoningText {
            kind: "reasoning_text",
            text,
        }
    }
}

/// A part of an output item, as the `content_part` events carry it.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(untagged)]
pub enum ContentPart {
    /// Of a message.
    Text(OutputText),
    /// Of a reasoning item.
    Reasoning(ReasoningText),
}

/// One item of a response's output.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum OutputItem {
    /// The model's reasoning (GPT-OSS's analysis channel, Qwen3's `<think>`).
    Reasoning {
        /// `rs_...`.
        id: String,
        /// Always empty (no summaries are made).
        summary: Vec<Value>,
        /// The reasoning text.
        content: Vec<ReasoningText>,
        /// `in_progress` while streamed, then `completed`.
        status: &'static str,
    },
    /// The answer.
    Message {
        /// `msg_...`.
        id: String,
        /// `in_progress` while streamed, then `completed` (or `incomplete`).
        status: &'static str,
        /// `assistant`.
        role: &'static str,
        /// The text.
        content: Vec<OutputText>,
    },
    /// A call of one of the request's function tools.
    FunctionCall {
        /// `fc_...`.
        id: String,
        /// `call_...`, which the `function_call_output` answering it names.
        call_id: String,
        /// The function.
        name: String,
        /// Its arguments, JSON text as the model wrote it.
        arguments: String,
        /// `in_progress` while streamed, then `completed`.
        status: &'static str,
    },
}

/// Why a response is incomplete.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct IncompleteDetails {
    /// `max_output_tokens`.
    pub reason: &'static str,
}

/// Token counts of a response.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct ResponseUsage {
    /// Prompt tokens.
    pub input_tokens: usize,
    /// Generated tokens, reasoning included.
    pub output_tokens: usize,
    /// Both.
    pub total_tokens: usize,
}

/// A response object.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ResponseObject {
    /// `resp_...`.
    pub id: String,
    /// `response`.
    pub object: &'static str,
    /// Unix seconds.
    pub created_at: u64,
    /// `in_progress`, `completed`, `incomplete` or `failed`.
    pub status: &'static str,
    /// Why it is incomplete.
    pub incomplete_details: Option<IncompleteDetails>,
    /// The error of a failed response (streamed only).
    pub error: Option<Value>,
    /// As sent.
    pub instructions: Option<String>,
    /// As sent.
    pub max_output_tokens: Option<i64>,
    /// The served model id.
    pub model: String,
    /// Reasoning, message and function-call items, in the order the model wrote them.
    pub output: Vec<OutputItem>,
    /// Whether every call was kept.
    pub parallel_tool_calls: bool,
    /// Always null: nothing is stored to continue from.
    pub previous_response_id: Option<String>,
    /// As sent.
    pub reasoning: ReasoningParams,
    /// Always false: this server stores no response.
    pub store: bool,
    /// As sent.
    pub temperature: Option<f64>,
    /// `{"format": {"type": "text"}}`.
    pub text: Value,
    /// As sent (`auto` by default).
    pub tool_choice: Value,
    /// As sent.
    pub tools: Value,
    /// As sent.
    pub top_p: Option<f64>,
    /// `disabled`.
    pub truncation: &'static str,
    /// Token counts (null until the response ends).
    pub usage: Option<ResponseUsage>,
    /// As sent.
    pub user: Option<String>,
    /// As sent (`{}` by default).
    pub metadata: Value,
}

/// An event of a streamed response; each goes out as `event: <type>` with the JSON, which
/// carries the type too, and a `sequence_number` counting from 0.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(tag = "type")]
pub enum StreamEvent {
    /// The response exists (status `in_progress`).
    #[serde(rename = "response.created")]
    Created {
        /// The response so far.
        response: Box<ResponseObject>,
    },
    /// The model is generating.
    #[serde(rename = "response.in_progress")]
    InProgress {
        /// The response so far.
        response: Box<ResponseObject>,
    },
    /// An output item begins.
    #[serde(rename = "response.output_item.added")]
    OutputItemAdded {
        /// Its index in `output`.
        output_index: usize,
        /// The item, empty.
        item: OutputItem,
    },
    /// A part of an item begins.
    #[serde(rename = "response.content_part.added")]
    ContentPartAdded {
        /// The item's id.
        item_id: String,
        /// The item's index in `output`.
        output_index: usize,
        /// The part's index in the item (always 0 here).
        content_index: usize,
        /// The part, empty.
        part: ContentPart,
    },
    /// More of a message's text.
    #[serde(rename = "response.output_text.delta")]
    OutputTextDelta {
        /// The item's id.
        item_id: String,
        /// The item's index in `output`.
        output_index: usize,
        /// The part's index in the item.
        content_index: usize,
        /// The new text.
        delta: String,
        /// Always empty (logprobs are not returned here).
        logprobs: Vec<Value>,
    },
    /// A message's text is complete.
    #[serde(rename = "response.output_text.done")]
    OutputTextDone {
        /// The item's id.
        item_id: String,
        /// The item's index in `output`.
        output_index: usize,
        /// The part's index in the item.
        content_index: usize,
        /// The whole text.
        text: String,
        /// Always empty.
        logprobs: Vec<Value>,
    },
    /// More of the reasoning.
    #[serde(rename = "response.reasoning_text.delta")]
    ReasoningTextDelta {
        /// The item's id.
        item_id: String,
        /// The item's index in `output`.
        output_index: usize,
        /// The part's index in the item.
        content_index: usize,
        /// The new text.
        delta: String,
    },
    /// The reasoning is complete.
    #[serde(rename = "response.reasoning_text.done")]
    ReasoningTextDone {
        /// The item's id.
        item_id: String,
        /// The item's index in `output`.
        output_index: usize,
        /// The part's index in the item.
        content_index: usize,
        /// The whole reasoning.
        text: String,
    },
    /// A part of an item is complete.
    #[serde(rename = "response.content_part.done")]
    ContentPartDone {
        /// The item's id.
        item_id: String,
        /// The item's index in `output`.
        output_index: usize,
        /// The part's index in the item.
        content_index: usize,
        /// The whole part.
        part: ContentPart,
    },
    /// More of a function call's arguments.
    #[serde(rename = "response.function_call_arguments.delta")]
    FunctionCallArgumentsDelta {
        /// The item's id.
        item_id: String,
        /// The item's index in `output`.
        output_index: usize,
        /// The next piece of the arguments' JSON text.
        delta: String,
    },
    /// A function call's arguments are complete.
    #[serde(rename = "response.function_call_arguments.done")]
    FunctionCallArgumentsDone {
        /// The item's id.
        item_id: String,
        /// The item's index in `output`.
        output_index: usize,
        /// The function.
        name: String,
        /// The whole arguments' JSON text.
        arguments: String,
    },
    /// An output item is complete.
    #[serde(rename = "response.output_item.done")]
    OutputItemDone {
        /// Its index in `output`.
        output_index: usize,
        /// The whole item.
        item: OutputItem,
    },
    /// The response ended by itself.
    #[serde(rename = "response.completed")]
    Completed {
        /// The whole response.
        response: Box<ResponseObject>,
    },
    /// The response reached `max_output_tokens`.
    #[serde(rename = "response.incomplete")]
    Incomplete {
        /// The whole response.
        response: Box<ResponseObject>,
    },
    /// The response failed while it was generated.
    #[serde(rename = "response.failed")]
    Failed {
        /// The response, with its `error`.
        response: Box<ResponseObject>,
    },
}

impl StreamEvent {
    /// The event's type, as its SSE `event:` line names it.
    pub fn name(&self) -> &'static str {
        match self {
            StreamEvent::Created { .. } => "response.created",
            StreamEvent::InProgress { .. } => "response.in_progress",
            StreamEvent::OutputItemAdded { .. } => "response.output_item.added",
            StreamEvent::ContentPartAdded { .. } => "response.content_part.added",
            StreamEvent::OutputTextDelta { .. } => "response.output_text.delta",
            StreamEvent::OutputTextDone { .. } => "response.output_text.done",
            StreamEvent::ReasoningTextDelta { .. } => "response.reasoning_text.delta",
            StreamEvent::ReasoningTextDone { .. } => "response.reasoning_text.done",
            StreamEvent::ContentPartDone { .. } => "response.content_part.done",
            StreamEvent::FunctionCallArgumentsDelta { .. } => {
                "response.function_call_arguments.delta"
            }
            StreamEvent::FunctionCallArgumentsDone { .. } => {
                "response.function_call_arguments.done"
            }
            StreamEvent::OutputItemDone { .. } => "response.output_item.done",
            StreamEvent::Completed { .. } => "response.completed",
            StreamEvent::Incomplete { .. } => "response.incomplete",
            StreamEvent::Failed { .. } => "response.failed",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_event_names_the_type_its_json_carries() {
        let item = OutputItem::Message {
            id: "msg_1".into(),
            status: "in_progress",
            role: "assistant",
            content: Vec::new(),
        };
        let text = || ContentPart::Text(OutputText::new(String::new()));
        let id = || "msg_1".to_string();
        let events = vec![
            StreamEvent::OutputItemAdded {
                output_index: 0,
                item: item.clone(),
            },
            StreamEvent::ContentPartAdded {
                item_id: id(),
                output_index: 0,
                content_index: 0,
                part: text(),
            },
            StreamEvent::OutputTextDelta {
                item_id: id(),
                output_index: 0,
                content_index: 0,
                delta: "a".into(),
                logprobs: Vec::new(),
            },
            StreamEvent::OutputTextDone {
                item_id: id(),
                output_index: 0,
                content_index: 0,
                text: "a".into(),
                logprobs: Vec::new(),
            },
            StreamEvent::ReasoningTextDelta {
                item_id: id(),
                output_index: 0,
                content_index: 0,
                delta: "r".into(),
            },
            StreamEvent::ReasoningTextDone {
                item_id: id(),
                output_index: 0,
                content_index: 0,
                text: "r".into(),
            },
            StreamEvent::ContentPartDone {
                item_id: id(),
                output_index: 0,
                content_index: 0,
                part: text(),
            },
            StreamEvent::FunctionCallArgumentsDelta {
                item_id: id(),
                output_index: 0,
                delta: "{".into(),
            },
            StreamEvent::FunctionCallArgumentsDone {
                item_id: id(),
                output_index: 0,
                name: "f".into(),
                arguments: "{}".into(),
            },
            StreamEvent::OutputItemDone {
                output_index: 0,
                item,
            },
        ];
        for e in events {
            let json = serde_json::to_value(&e).unwrap();
            assert_eq!(json["type"], e.name(), "{json}");
        }
    }
}
