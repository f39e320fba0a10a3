use serde_json::{Value, json};

use super::output::ResponseBuilder;
use super::*;
use crate::generation::{ChoiceDelta, Finish};
use crate::protocol::responses::{OutputItem, StreamEvent};
use crate::tool_parsing::{ChoiceParser, ParserChoice, ReasoningParserKind, ToolCallParserKind};

fn request(body: Value) -> ResponsesRequest {
    serde_json::from_value(body).unwrap()
}

fn chat(body: Value) -> Result<ChatCompletionRequest, ApiError> {
    to_chat_request(&request(body), true)
}

fn rendered(m: &ChatMessage) -> Value {
    let mut v = Value::Object(m.rest.clone());
    v["role"] = json!(m.role);
    v["content"] = match &m.content {
        Some(MessageContent::Text(t)) => json!(t),
        None => Value::Null,
        Some(MessageContent::Parts(_)) => json!("parts"),
    };
    v
}

#[test]
fn text_input_is_one_user_message_after_the_instructions() {
    let req = chat(
        json!({"input": "Hi", "instructions": "Be brief.", "max_output_tokens": 7,
                          "temperature": 0, "reasoning": {"effort": "low"}}),
    )
    .unwrap();
    let messages: Vec<Value> = req.messages.unwrap().iter().map(rendered).collect();
    assert_eq!(
        messages,
        vec![
            json!({"role": "developer", "content": "Be brief."}),
            json!({"role": "user", "content": "Hi"})
        ]
    );
    assert_eq!(req.common.max_completion_tokens, Some(7));
    assert_eq!(req.common.temperature, Some(0.0));
    assert_eq!(req.reasoning_effort.as_deref(), Some("low"));
    let other = to_chat_request(&request(json!({"input": "Hi", "instructions": "x"})), false);
    assert_eq!(other.unwrap().messages.unwrap()[0].role, "system");
}

#[test]
fn calls_and_their_outputs_become_tool_turns_with_the_reasoning_before_them() {
    let req = chat(json!({"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Look it up."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": "{\"city\":\"Rome\"}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": "rain"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny and rain."}]},
    ]}))
    .unwrap();
    let messages: Vec<Value> = req.messages.unwrap().iter().map(rendered).collect();
    assert_eq!(messages.len(), 5, "{messages:?}");
    assert_eq!(messages[0], json!({"role": "user", "content": "Weather?"}));
    assert_eq!(messages[1]["role"], "assistant");
    assert_eq!(messages[1]["content"], Value::Null);
    assert_eq!(messages[1]["reasoning_content"], "Look it up.");
    let calls = messages[1]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 2, "calls in a row are one turn");
    assert_eq!(calls[1]["id"], "call_2");
    assert_eq!(calls[1]["function"]["arguments"], "{\"city\":\"Rome\"}");
    assert_eq!(
        messages[2],
        json!({"role": "tool", "tool_call_id": "call_1", "content": "sunny"})
    );
    assert_eq!(messages[3]["tool_call_id"], "call_2");
    assert_eq!(
        messages[4],
        json!({"role": "assistant", "content": "Sunny and rain."})
    );
}

#[test]
fn function_tools_and_a_named_choice_take_chats_shape() {
    let req = chat(json!({"input": "x",
        "tools": [{"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"}}))
    .unwrap();
    assert_eq!(
        req.tools.unwrap(),
        json!([{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}])
    );
    assert_eq!(
        req.tool_choice.unwrap(),
        json!({"type": "function", "function": {"name": "f"}})
    );
}

/// The 400's parameter and a piece of its message.
fn refused(body: Value) -> (String, String) {
    match chat(body) {
        Err(ApiError::BadRequest { message, param }) => (param.unwrap_or_default(), message),
        other => panic!("expected a 400, got {other:?}"),
    }
}

#[test]
fn what_needs_storage_or_is_not_built_is_refused_naming_it() {
    let cases = [
        (
            json!({"input": "x", "previous_response_id": "resp_1"}),
            "previous_response_id",
            "stores none",
        ),
        (
            json!({"input": "x", "conversation": "conv_1"}),
            "conversation",
            "stores none",
        ),
        (
            json!({"input": "x", "background": true}),
            "background",
            "stores none",
        ),
        (
            json!({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}}),
            "text.format.schema",
            "schema object",
        ),
        (
            json!({"input": "x", "top_logprobs": 2}),
            "top_logprobs",
            "chat/completions",
        ),
        (json!({}), "input", "required"),
        (json!({"input": []}), "input", "empty"),
        (json!({"input": 3}), "input", "text or a list"),
        (
            json!({"input": [{"type": "item_reference", "id": "msg_1"}]}),
            "input",
            "input[0]",
        ),
        (
            json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
            "input",
            "input_image",
        ),
        (
            json!({"input": [{"role": "tool", "content": "x"}]}),
            "input",
            "role",
        ),
        (
            json!({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}),
            "input",
            "call_id",
        ),
        (
            json!({"input": "x", "tools": [{"type": "web_search"}]}),
            "tools",
            "web_search",
        ),
    ];
    for (body, param, says) in cases {
        let (p, message) = refused(body.clone());
        assert_eq!(p, param, "{body}: {message}");
        assert!(message.contains(says), "{body}: {message}");
    }
    // Plain text format and store are fine (store is answered false).
    assert!(
        chat(json!({"input": "x", "text": {"format": {"type": "text"}}, "store": true})).is_ok()
    );
}

fn harmony_parser() -> ChoiceParser {
    let choice = ParserChoice {
        reasoning: ReasoningParserKind::OpenaiGptoss,
        tools: Some(ToolCallParserKind::Openai),
    };
    let parser = choice.build("<|start|>assistant").unwrap();
    ChoiceParser::new(parser, true)
}

fn builder(parser: Option<ChoiceParser>) -> ResponseBuilder {
    let req = request(json!({"input": "x"}));
    ResponseBuilder::new(super::skeleton(&req, "m"), 5, parser)
}

fn delta(text: &str, n: usize, finish: Option<&'static str>) -> ChoiceDelta {
    ChoiceDelta {
        index: 0,
        text: text.to_string(),
        token_ids: Vec::new(),
        logprobs: Vec::new(),
        finish: finish.map(|reason| Finish {
            reason,
            stop_reason: None,
        }),
        first: n == 1,
        completion_tokens: n,
        prompt_logprobs: None,
    }
}

const TOOL_TURN: &str = "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Paris\"}<|call|>";

/// Feeds `text` in pieces of `size` characters; returns the stream events and the response.
fn run(text: &str, size: usize, finish: &'static str) -> (Vec<StreamEvent>, ResponseObject) {
    let mut b = builder(Some(harmony_parser()));
    let chars: Vec<char> = text.chars().collect();
    let pieces: Vec<String> = chars.chunks(size).map(|c| c.iter().collect()).collect();
    let mut events = Vec::new();
    for (k, piece) in pieces.iter().enumerate() {
        let last = k + 1 == pieces.len();
        events.extend(b.push(delta(piece, k + 1, last.then_some(finish))));
    }
    (events, b.finished())
}

#[test]
fn a_tool_turn_is_a_reasoning_item_then_a_function_call_whatever_the_chunking() {
    let mut whole = None;
    for size in [1, 3, 7, 1000] {
        let (events, response) = run(TOOL_TURN, size, "stop");
        assert_eq!(response.status, "completed");
        let usage = response.usage.unwrap();
        assert_eq!(
            (usage.input_tokens, usage.total_tokens),
            (5, 5 + usage.output_tokens)
        );
        match &response.output[..] {
            [
                OutputItem::Reasoning { content, .. },
                OutputItem::FunctionCall {
                    name,
                    arguments,
                    call_id,
                    ..
                },
            ] => {
                assert_eq!(content[0].text, "Need the weather.");
                assert_eq!(name, "get_weather");
                assert_eq!(arguments, "{\"city\":\"Paris\"}");
                assert!(call_id.starts_with("call_"), "{call_id}");
            }
            other => panic!("size {size}: {other:?}"),
        }
        // The streamed deltas add up to the items, and every item opened is closed.
        let (mut reasoning, mut args) = (String::new(), String::new());
        let (mut added, mut done) = (0, 0);
        for e in &events {
            match e {
                StreamEvent::ReasoningTextDelta { delta, .. } => reasoning.push_str(delta),
                StreamEvent::FunctionCallArgumentsDelta { delta, .. } => args.push_str(delta),
                StreamEvent::OutputItemAdded { .. } => added += 1,
                StreamEvent::OutputItemDone { .. } => done += 1,
                StreamEvent::OutputTextDelta { delta, .. } => {
                    panic!("size {size}: content {delta:?} in a tool turn")
                }
                _ => {}
            }
        }
        assert_eq!(reasoning, "Need the weather.");
        assert_eq!(args, "{\"city\":\"Paris\"}");
        assert_eq!((added, done), (2, 2), "size {size}");
        assert!(matches!(events[0], StreamEvent::Created { .. }));
        // Ids differ per run; the shape does not.
        let shape: Vec<&str> = events.iter().map(StreamEvent::name).collect();
        let kinds: Vec<&str> = shape
            .into_iter()
            .filter(|n| !n.ends_with(".delta"))
            .collect();
        match &whole {
            None => whole = Some(kinds),
            Some(first) => assert_eq!(first, &kinds, "size {size}"),
        }
    }
}

#[test]
fn an_answer_cut_by_max_output_tokens_is_incomplete() {
    let (events, response) = run(
        "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Fo",
        4,
        "length",
    );
    assert_eq!(response.status, "incomplete");
    assert_eq!(
        response.incomplete_details.map(|d| d.reason),
        Some("max_output_tokens")
    );
    match &response.output[..] {
        [
            OutputItem::Reasoning {
                status: "completed",
                ..
            },
            OutputItem::Message {
                status: "incomplete",
                content,
                ..
            },
        ] => assert_eq!(content[0].text, "Fo"),
        other => panic!("{other:?}"),
    }
    let text: String = events
        .iter()
        .filter_map(|e| match e {
            StreamEvent::OutputTextDelta { delta, .. } => Some(delta.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(text, "Fo");
}

#[test]
fn without_a_parser_the_text_is_one_message() {
    let mut b = builder(None);
    b.push(delta("Hello", 1, None));
    b.push(delta(" there", 2, Some("stop")));
    let response = b.finished();
    match &response.output[..] {
        [OutputItem::Message { content, role, .. }] => {
            assert_eq!(*role, "assistant");
            assert_eq!(content[0].text, "Hello there");
        }
        other => panic!("{other:?}"),
    }
}
