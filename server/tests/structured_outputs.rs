//! Structured outputs through the HTTP API, over fake nodes whose scripted text breaks the
//! requested format: the masks the router computes must bend every choice into it
//! (`response_format` on chat, GPT-OSS harmony included; `structured_outputs` on
//! completions; `text.format` on responses; streamed and with several choices), and the
//! formats that cannot be served are 400s naming what is wrong.

mod common;

use common::*;
use model::Family;
use serde_json::{Value, json};

/// A model that thinks, then answers in prose where JSON was asked for.
const HARMONY_PROSE: &str = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>It is sunny in Paris.<|return|>";

fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "city": {"enum": ["Paris", "Tokyo"]},
            "sunny": {"type": "boolean"},
            "degrees": {"type": "integer", "minimum": 0, "maximum": 40}
        },
        "required": ["city", "sunny", "degrees"],
        "additionalProperties": false
    })
}

fn response_format() -> Value {
    json!({"type": "json_schema", "json_schema": {"name": "weather", "schema": schema(), "strict": true}})
}

/// `text` is JSON matching [`schema`].
fn assert_weather(text: &str) {
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    let o = v.as_object().unwrap_or_else(|| panic!("{text}"));
    assert_eq!(o.len(), 3, "{text}");
    assert!(
        ["Paris", "Tokyo"].contains(&o["city"].as_str().unwrap()),
        "{text}"
    );
    assert!(o["sunny"].is_boolean(), "{text}");
    assert!((0..=40).contains(&o["degrees"].as_i64().unwrap()), "{text}");
}

#[tokio::test]
async fn gpt_oss_chat_answers_json_in_the_final_channel_after_its_reasoning() {
    let s = scripted(Family::GptOss, HARMONY_PROSE, false).await;
    let (status, body) = s
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 200,
                   "n": 2, "response_format": response_format()}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    for choice in body["choices"].as_array().unwrap() {
        assert_eq!(choice["finish_reason"], "stop", "{body}");
        assert_eq!(choice["message"]["reasoning_content"], "Think.", "{body}");
        assert_weather(choice["message"]["content"].as_str().unwrap());
    }
    // Without the format the same node writes its prose.
    let (_, plain) = s
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 200}),
        )
        .await;
    assert_eq!(
        plain["choices"][0]["message"]["content"],
        "It is sunny in Paris."
    );
}

#[tokio::test]
async fn qwen3_thinks_first_then_answers_json() {
    let s = scripted(
        Family::Qwen3Moe,
        "<think>\nThe user wants JSON.\n</think>\n\nSure: it is sunny.",
        false,
    )
    .await;
    let (status, body) = s
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 200,
                   "response_format": response_format()}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let message = &body["choices"][0]["message"];
    assert_eq!(
        message["reasoning_content"].as_str().map(str::trim),
        Some("The user wants JSON."),
        "{body}"
    );
    assert_weather(message["content"].as_str().unwrap().trim());
}

#[tokio::test]
async fn a_streamed_json_object_adds_up_to_json() {
    let s = scripted(Family::Qwen3Moe, "Sure! Here you go: nothing.", false).await;
    let events = s
        .stream(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "JSON please"}], "max_tokens": 120,
                   "stream": true, "response_format": {"type": "json_object"}}),
        )
        .await;
    let text: String = chunks(&events)
        .iter()
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect();
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    assert!(v.is_object(), "{text}");
}

#[tokio::test]
async fn completions_follow_regexes_choices_and_grammars() {
    let s = scripted(Family::Mixtral, "Well, let me think about that.", false).await;
    // Older vLLM's guided_* parameters are the same formats.
    let (status, body) = s
        .post(
            "/v1/completions",
            json!({"prompt": "Answer:", "max_tokens": 60, "guided_choice": ["yes", "no"]}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert!(
        ["yes", "no"].contains(&body["choices"][0]["text"].as_str().unwrap()),
        "{body}"
    );
    let cases = [
        (json!({"regex": "[a-c]{2}-[0-9]{3}"}), "regex"),
        (json!({"choice": ["red", "green", "blue"]}), "choice"),
        (
            json!({"grammar": "start: \"(\" NUM (\"+\" NUM)* \")\"\nNUM: /[1-9]/\n"}),
            "grammar",
        ),
        (json!({"json": schema()}), "json"),
    ];
    for (format, kind) in cases {
        let (status, body) = s
            .post(
                "/v1/completions",
                json!({"prompt": "Answer:", "max_tokens": 60, "structured_outputs": format}),
            )
            .await;
        assert_eq!(status, 200, "{kind}: {body}");
        let text = body["choices"][0]["text"].as_str().unwrap();
        assert_eq!(
            body["choices"][0]["finish_reason"], "stop",
            "{kind}: {body}"
        );
        match kind {
            "regex" => {
                let b = text.as_bytes();
                assert!(
                    b.len() == 6
                        && b[..2].iter().all(|c| (b'a'..=b'c').contains(c))
                        && b[2] == b'-'
                        && b[3..].iter().all(u8::is_ascii_digit),
                    "{text:?}"
                );
            }
            "choice" => assert!(["red", "green", "blue"].contains(&text), "{text:?}"),
            "grammar" => assert!(text.starts_with('(') && text.ends_with(')'), "{text:?}"),
            _ => assert_weather(text),
        }
    }
}

#[tokio::test]
async fn responses_text_format_is_a_json_schema_too() {
    let s = scripted(Family::GptOss, HARMONY_PROSE, false).await;
    let (status, body) = s
        .post(
            "/v1/responses",
            json!({"input": "Weather?", "max_output_tokens": 200,
                   "text": {"format": {"type": "json_schema", "name": "weather", "schema": schema(), "strict": true}}}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let message = body["output"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["type"] == "message")
        .unwrap_or_else(|| panic!("{body}"));
    assert_weather(message["content"][0]["text"].as_str().unwrap());
}

#[tokio::test]
async fn formats_that_cannot_be_served_are_400s_naming_the_problem() {
    let s = scripted(Family::Qwen3Moe, "x", false).await;
    let chat = |extra: Value| {
        let mut body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    };
    let cases = [
        (
            chat(
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object", "unevaluatedProperties": false}}}}),
            ),
            "unevaluatedProperties",
        ),
        (
            chat(json!({"structured_outputs": {"regex": "(open"}})),
            "regular expression",
        ),
        (
            chat(json!({"response_format": {"type": "xml"}})),
            "response_format.type",
        ),
        (
            chat(json!({"response_format": {"type": "json_object"}, "ignore_eos": true})),
            "ignore_eos",
        ),
        (
            chat(json!({"structured_outputs": {"choice": []}})),
            "non-empty",
        ),
    ];
    for (body, says) in cases {
        let (status, answer) = s.post("/v1/chat/completions", body.clone()).await;
        assert_eq!(status, 400, "{body}: {answer}");
        let message = answer["error"]["message"].as_str().unwrap();
        let param = answer["error"]["param"].as_str().unwrap_or("");
        assert!(
            message.contains(says) || param.contains(says),
            "{body}: {answer}"
        );
    }
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]}},
            "required": ["city"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "get_time", "parameters": {
            "type": "object", "properties": {"utc": {"type": "boolean"}},
            "required": ["utc"], "additionalProperties": false}}}
    ])
}

/// The (name, arguments) of a chat choice's tool calls, checking each call's arguments
/// against its function.
fn calls(choice: &Value) -> Vec<(String, Value)> {
    assert_eq!(choice["finish_reason"], "tool_calls", "{choice}");
    choice["message"]["tool_calls"]
        .as_array()
        .unwrap_or_else(|| panic!("no tool calls: {choice}"))
        .iter()
        .map(|c| {
            let name = c["function"]["name"].as_str().unwrap().to_string();
            let args: Value = serde_json::from_str(c["function"]["arguments"].as_str().unwrap())
                .unwrap_or_else(|e| panic!("{c}: {e}"));
            match name.as_str() {
                "get_weather" => {
                    assert!(
                        ["Paris", "Tokyo"].contains(&args["city"].as_str().unwrap()),
                        "{c}"
                    )
                }
                "get_time" => assert!(args["utc"].is_boolean(), "{c}"),
                other => panic!("unknown tool {other}"),
            }
            (name, args)
        })
        .collect()
}

#[tokio::test]
async fn required_and_named_tool_choices_make_the_model_call_in_its_own_format() {
    for family in [Family::GptOss, Family::Qwen3Moe, Family::Mixtral] {
        // Prose where a call is required; no --enable-auto-tool-choice either.
        let prose = if family == Family::GptOss {
            HARMONY_PROSE
        } else {
            "I would rather chat about the weather."
        };
        let s = scripted(family, prose, false).await;
        let ask = |tool_choice: Value| {
            json!({"messages": [{"role": "user", "content": "Weather in Paris?"}],
                   "max_tokens": 300, "tools": tools(), "tool_choice": tool_choice})
        };
        let (status, body) = s
            .post(
                "/v1/chat/completions",
                ask(json!({"type": "function", "function": {"name": "get_time"}})),
            )
            .await;
        assert_eq!(status, 200, "{family:?}: {body}");
        let named = calls(&body["choices"][0]);
        assert!(!named.is_empty(), "{family:?}: {body}");
        assert!(
            named.iter().all(|(n, _)| n == "get_time"),
            "{family:?}: {body}"
        );

        // One call only: the fake node would go on writing calls as long as it may.
        let mut one = ask(json!("required"));
        one["parallel_tool_calls"] = json!(false);
        let (status, body) = s.post("/v1/chat/completions", one.clone()).await;
        assert_eq!(status, 200, "{family:?}: {body}");
        assert_eq!(calls(&body["choices"][0]).len(), 1, "{family:?}: {body}");

        // Streamed, the call arrives as tool-call deltas.
        let mut streamed = one;
        streamed["stream"] = json!(true);
        let events = s.stream("/v1/chat/completions", streamed).await;
        let deltas = chunks(&events);
        assert!(
            deltas
                .iter()
                .any(|c| c["choices"][0]["delta"]["tool_calls"].is_array()),
            "{family:?}: {events:?}"
        );
        assert!(
            deltas
                .iter()
                .any(|c| c["choices"][0]["finish_reason"] == "tool_calls"),
            "{family:?}: {events:?}"
        );

        let (status, body) = s
            .post(
                "/v1/chat/completions",
                json!({"messages": [{"role": "user", "content": "x"}], "tools": tools(),
                       "tool_choice": "required", "response_format": {"type": "json_object"}}),
            )
            .await;
        assert_eq!(status, 400, "{body}");
        assert_eq!(body["error"]["param"], "tool_choice", "{body}");
    }
}
