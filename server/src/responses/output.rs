//! A response's output items, built from the one choice's deltas: the parser's reasoning,
//! content and tool-call events open, fill and close reasoning, message and function-call
//! items in the order the model wrote them. Streamed, each change is a typed event; whole,
//! the same items end up in `output`, so the two agree whatever the chunking.

use axum::response::sse::Event;
use futures::StreamExt;

use crate::error::ApiError;
use crate::generation::{ChoiceDelta, ChoiceEvent, ChoiceStream};
use crate::protocol::responses::{
    ContentPart, IncompleteDetails, OutputItem, OutputText, ReasoningText, ResponseObject,
    ResponseUsage, StreamEvent,
};
use crate::sse::{ChunkWriter, error_event};
use crate::tool_parsing::{ChoiceParser, ParseEvent};

/// One output item as it is built.
#[derive(Debug, Clone, PartialEq)]
enum Building {
    Reasoning { id: String, text: String },
    Message { id: String, text: String },
    Call(Call),
}

#[derive(Debug, Clone, PartialEq)]
struct Call {
    id: String,
    call_id: String,
    name: String,
    arguments: String,
    /// The call's index among the output's calls (the parser's numbering).
    index: usize,
}

/// Builds one response from its choice's deltas.
pub struct ResponseBuilder {
    response: ResponseObject,
    prompt_tokens: usize,
    completion_tokens: usize,
    /// Reasoning and tool calls are parsed when the chat path would parse them.
    parser: Option<ChoiceParser>,
    items: Vec<Building>,
    /// The item that takes the next text or arguments, until another kind of event comes.
    open: Option<usize>,
    /// How the generation ended (`stop`, `length`), once it has.
    finish: Option<&'static str>,
    /// Whether `response.created` has gone out.
    started: bool,
    sequence_number: u64,
}

impl ResponseBuilder {
    /// A builder for `response` (its skeleton: what the request set) over a prompt of
    /// `prompt_tokens` tokens.
    pub fn new(
        response: ResponseObject,
        prompt_tokens: usize,
        parser: Option<ChoiceParser>,
    ) -> Self {
        ResponseBuilder {
            response,
            prompt_tokens,
            completion_tokens: 0,
            parser,
            items: Vec::new(),
            open: None,
            finish: None,
            started: false,
            sequence_number: 0,
        }
    }

    /// The whole response, after every delta.
    pub async fn collect(mut self, mut stream: ChoiceStream) -> Result<ResponseObject, ApiError> {
        while let Some(event) = stream.next().await {
            match event {
                ChoiceEvent::Delta(d) => {
                    self.push(d);
                }
                ChoiceEvent::Error(e) => return Err(e),
            }
        }
        if self.finish.is_none() {
            return Err(ApiError::Internal(
                "the response ended without finishing".into(),
            ));
        }
        Ok(self.finished())
    }

    /// Applies one delta; returns the stream events it makes.
    pub fn push(&mut self, d: ChoiceDelta) -> Vec<StreamEvent> {
        let mut out = Vec::new();
        if !self.started {
            // Sent with the first token, never before (client-side TTFT must not count an
            // event sent before prefill), as chat's role chunk.
            self.started = true;
            out.push(StreamEvent::Created {
                response: Box::new(self.response.clone()),
            });
            out.push(StreamEvent::InProgress {
                response: Box::new(self.response.clone()),
            });
        }
        self.completion_tokens = d.completion_tokens;
        let last = d.finish.is_some();
        let events = match self.parser.as_mut() {
            Some(p) => p.events(&d.text, last),
            None if d.text.is_empty() => Vec::new(),
            None => vec![ParseEvent::Content(d.text)],
        };
        for event in events {
            self.apply(event, &mut out);
        }
        if let Some(finish) = d.finish {
            self.close(&mut out);
            self.finish = Some(finish.reason);
        }
        out
    }

    fn apply(&mut self, event: ParseEvent, out: &mut Vec<StreamEvent>) {
        match event {
            ParseEvent::Reasoning(text) => {
                let i = self.open_text(true, out);
                if let Building::Reasoning { id, text: all } = &mut self.items[i] {
                    all.push_str(&text);
                    out.push(StreamEvent::ReasoningTextDelta {
                        item_id: id.clone(),
                        output_index: i,
                        content_index: 0,
                        delta: text,
                    });
                }
            }
            ParseEvent::Content(text) => {
                let i = self.open_text(false, out);
                if let Building::Message { id, text: all } = &mut self.items[i] {
                    all.push_str(&text);
                    out.push(StreamEvent::OutputTextDelta {
                        item_id: id.clone(),
                        output_index: i,
                        content_index: 0,
                        delta: text,
                        logprobs: Vec::new(),
                    });
                }
            }
            ParseEvent::ToolCallStart { index, name } => {
                self.close(out);
                let call_id = self
                    .parser
                    .as_mut()
                    .map(|p| p.call_id(index))
                    .unwrap_or_else(|| new_id("call"));
                let call = Building::Call(Call {
                    id: new_id("fc"),
                    call_id,
                    name,
                    arguments: String::new(),
                    index,
                });
                self.items.push(call);
                let i = self.items.len() - 1;
                self.open = Some(i);
                out.push(StreamEvent::OutputItemAdded {
                    output_index: i,
                    item: self.item(i, "in_progress"),
                });
            }
            ParseEvent::ToolCallArguments { index, text } => {
                let found = self
                    .items
                    .iter_mut()
                    .enumerate()
                    .rev()
                    .find_map(|(i, b)| match b {
                        Building::Call(c) if c.index == index => Some((i, c)),
                        _ => None,
                    });
                if let Some((i, call)) = found {
                    call.arguments.push_str(&text);
                    out.push(StreamEvent::FunctionCallArgumentsDelta {
                        item_id: call.id.clone(),
                        output_index: i,
                        delta: text,
                    });
                }
            }
        }
    }

    /// The open reasoning (or message) item, opened after closing any other.
    fn open_text(&mut self, reasoning: bool, out: &mut Vec<StreamEvent>) -> usize {
        if let Some(i) = self.open {
            match self.items[i] {
                Building::Reasoning { .. } if reasoning => return i,
                Building::Message { .. } if !reasoning => return i,
                _ => self.close(out),
            }
        }
        let (item, item_id, part) = if reasoning {
            let id = new_id("rs");
            let item = Building::Reasoning {
                id: id.clone(),
                text: String::new(),
            };
            let part = ContentPart::Reasoning(ReasoningText::new(String::new()));
            (item, id, part)
        } else {
            let id = new_id("msg");
            let item = Building::Message {
                id: id.clone(),
                text: String::new(),
            };
            (item, id, ContentPart::Text(OutputText::new(String::new())))
        };
        self.items.push(item);
        let i = self.items.len() - 1;
        self.open = Some(i);
        out.push(StreamEvent::OutputItemAdded {
            output_index: i,
            item: self.item(i, "in_progress"),
        });
        out.push(StreamEvent::ContentPartAdded {
            item_id,
            output_index: i,
            content_index: 0,
            part,
        });
        i
    }

    /// Closes the open item, if any, with its `done` events.
    fn close(&mut self, out: &mut Vec<StreamEvent>) {
        let Some(i) = self.open.take() else {
            return;
        };
        match &self.items[i] {
            Building::Reasoning { id, text } => {
                out.push(StreamEvent::ReasoningTextDone {
                    item_id: id.clone(),
                    output_index: i,
                    content_index: 0,
                    text: text.clone(),
                });
                out.push(StreamEvent::ContentPartDone {
                    item_id: id.clone(),
                    output_index: i,
                    content_index: 0,
                    part: ContentPart::Reasoning(ReasoningText::new(text.clone())),
                });
            }
            Building::Message { id, text } => {
                out.push(StreamEvent::OutputTextDone {
                    item_id: id.clone(),
                    output_index: i,
                    content_index: 0,
                    text: text.clone(),
                    logprobs: Vec::new(),
                });
                out.push(StreamEvent::ContentPartDone {
                    item_id: id.clone(),
                    output_index: i,
                    content_index: 0,
                    part: ContentPart::Text(OutputText::new(text.clone())),
                });
            }
            Building::Call(c) => {
                out.push(StreamEvent::FunctionCallArgumentsDone {
                    item_id: c.id.clone(),
                    output_index: i,
                    name: c.name.clone(),
                    arguments: c.arguments.clone(),
                });
            }
        }
        out.push(StreamEvent::OutputItemDone {
            output_index: i,
            item: self.item(i, "completed"),
        });
    }

    /// Item `i` as it stands, with `status`.
    fn item(&self, i: usize, status: &'static str) -> OutputItem {
        match &self.items[i] {
            Building::Reasoning { id, text } => OutputItem::Reasoning {
                id: id.clone(),
                summary: Vec::new(),
                content: if text.is_empty() && status == "in_progress" {
                    Vec::new()
                } else {
                    vec![ReasoningText::new(text.clone())]
                },
                status,
            },
            Building::Message { id, text } => OutputItem::Message {
                id: id.clone(),
                status,
                role: "assistant",
                content: if text.is_empty() && status == "in_progress" {
                    Vec::new()
                } else {
                    vec![OutputText::new(text.clone())]
                },
            },
            Building::Call(c) => OutputItem::FunctionCall {
                id: c.id.clone(),
                call_id: c.call_id.clone(),
                name: c.name.clone(),
                arguments: c.arguments.clone(),
                status,
            },
        }
    }

    /// The response once the generation ended: every item, the status and the usage.
    pub(super) fn finished(&self) -> ResponseObject {
        let mut response = self.response.clone();
        let truncated = self.finish == Some("length");
        let status = if truncated { "incomplete" } else { "completed" };
        response.status = status;
        response.incomplete_details = truncated.then_some(IncompleteDetails {
            reason: "max_output_tokens",
        });
        response.output = (0..self.items.len())
            .map(|i| self.item(i, "completed"))
            .collect();
        if truncated {
            // The text cut short is incomplete; what closed before it is not.
            if let Some(OutputItem::Message { status, .. }) = response.output.last_mut() {
                *status = "incomplete";
            }
        }
        response.usage = Some(ResponseUsage {
            input_tokens: self.prompt_tokens,
            output_tokens: self.completion_tokens,
            total_tokens: self.prompt_tokens + self.completion_tokens,
        });
        response
    }

    /// `event: <type>` and the event's JSON with its sequence number.
    fn sse(&mut self, event: StreamEvent) -> Event {
        let name = event.name();
        let mut json = match serde_json::to_value(&event) {
            Ok(json) => json,
            Err(e) => {
                return error_event(&ApiError::Internal(format!("serializing an event: {e}")));
            }
        };
        if let Some(o) = json.as_object_mut() {
            o.insert("sequence_number".into(), self.sequence_number.into());
        }
        self.sequence_number += 1;
        Event::default().event(name).data(json.to_string())
    }
}

impl ChunkWriter for ResponseBuilder {
    fn delta(&mut self, delta: ChoiceDelta) -> Vec<Event> {
        let events = self.push(delta);
        events.into_iter().map(|e| self.sse(e)).collect()
    }

    fn usage(&mut self) -> Option<Event> {
        None
    }

    /// `response.completed` (or `response.incomplete`) with the whole response; no `[DONE]`,
    /// as OpenAI's Responses stream has none.
    fn end(&mut self) -> Vec<Event> {
        let response = Box::new(self.finished());
        let event = if response.status == "incomplete" {
            StreamEvent::Incomplete { response }
        } else {
            StreamEvent::Completed { response }
        };
        vec![self.sse(event)]
    }

    /// `response.failed`, the response carrying the error.
    fn failed(&mut self, error: &ApiError) -> Vec<Event> {
        let mut response = self.response.clone();
        response.status = "failed";
        response.error = Some(serde_json::json!({
            "code": error.error_type(),
            "message": error.to_string(),
        }));
        vec![self.sse(StreamEvent::Failed {
            response: Box::new(response),
        })]
    }
}

/// An item's id as OpenAI writes them: the kind (`resp`, `msg`, `rs`, `fc`), `_`, 32 hex digits.
pub fn new_id(kind: &str) -> String {
    format!("{kind}_{:032x}", rand::random::<u128>())
}
