//! Reasoning and tool calls on /v1/chat/completions, over fake nodes that write scripted
//! outputs (harmony for GPT-OSS, `<think>`/`<tool_call>` for Qwen3): the JSON a client gets,
//! whole and streamed, and the refusals.

mod common;

use common::*;
use model::Family;
use serde_json::{Value, json};

const TOOL_TURN: &str = "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Paris\"}<|call|>";
const ANSWER_TURN: &str = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Four.<|return|>";

fn weather_request(extra: Value) -> Value {
    let mut body = json!({
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
        "max_tokens": 300,
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

/// The streamed choice's fields, concatenated: reasoning, content, and each call as
/// (id, name, arguments); checks each call's id, type and name come once, in its first piece.
fn fold_stream(chunks: &[Value]) -> (String, String, Vec<(String, String, String)>, String) {
    let (mut reasoning, mut content, mut calls, mut finish) = (
        String::new(),
        String::new(),
        Vec::<(String, String, String)>::new(),
        String::new(),
    );
    for c in chunks {
        let Some(choice) = c["choices"].get(0) else {
            continue;
        };
        let delta = &choice["delta"];
        reasoning.push_str(delta["reasoning_content"].as_str().unwrap_or(""));
        let text = delta["content"].as_str().unwrap_or("");
        assert!(!text.contains("<|"), "a marker leaked into content: {c}");
        content.push_str(text);
        for call in delta["tool_calls"].as_array().into_iter().flatten() {
            let index = call["index"].as_u64().unwrap() as usize;
            if index == calls.len() {
                assert_eq!(call["type"], "function", "{c}");
                calls.push((
                    call["id"].as_str().unwrap().to_string(),
                    call["function"]["name"].as_str().unwrap().to_string(),
                    String::new(),
                ));
            } else {
                assert!(
                    call.get("id").is_none() && call["function"].get("name").is_none(),
                    "{c}"
                );
            }
            calls[index]
                .2
                .push_str(call["function"]["arguments"].as_str().unwrap());
        }
        if let Some(f) = choice["finish_reason"].as_str() {
            finish = f.to_string();
        }
    }
    (reasoning, content, calls, finish)
}

#[tokio::test]
async fn a_harmony_tool_call_is_returned_as_tool_calls() {
    let s = scripted(Family::GptOss, TOOL_TURN, true).await;
    let (status, v) = s
        .post("/v1/chat/completions", weather_request(json!({})))
        .await;
    assert_eq!(status, 200, "{v}");
    let choice = &v["choices"][0];
    let message = &choice["message"];
    assert_eq!(choice["finish_reason"], "tool_calls");
    assert_eq!(message["content"], Value::Null);
    assert_eq!(message["reasoning_content"], "Need the weather.");
    let calls = message["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1);
    assert!(calls[0]["id"].as_str().unwrap().starts_with("call_"), "{v}");
    assert_eq!(calls[0]["type"], "function");
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    assert_eq!(calls[0]["function"]["arguments"], "{\"city\":\"Paris\"}");

    let events = s
        .stream(
            "/v1/chat/completions",
            weather_request(json!({"stream": true})),
        )
        .await;
    let (reasoning, content, calls, finish) = fold_stream(&chunks(&events));
    assert_eq!(reasoning, "Need the weather.");
    assert_eq!(content, "");
    assert_eq!(calls.len(), 1);
    assert!(calls[0].0.starts_with("call_"));
    assert_eq!(
        (calls[0].1.as_str(), calls[0].2.as_str()),
        ("get_weather", "{\"city\":\"Paris\"}")
    );
    assert_eq!(finish, "tool_calls");
}

#[tokio::test]
async fn harmony_reasoning_and_answer_whole_and_streamed() {
    let s = scripted(Family::GptOss, ANSWER_TURN, false).await;
    let body = json!({"messages": [{"role": "user", "content": "2 + 2?"}], "max_tokens": 300});
    let (status, v) = s.post("/v1/chat/completions", body.clone()).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["reasoning_content"], "Easy.");
    assert_eq!(v["choices"][0]["message"]["content"], "Four.");
    assert!(
        v["choices"][0]["message"].get("tool_calls").is_none(),
        "{v}"
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let mut streamed = body;
    streamed["stream"] = json!(true);
    let (reasoning, content, calls, finish) =
        fold_stream(&chunks(&s.stream("/v1/chat/completions", streamed).await));
    assert_eq!((reasoning.as_str(), content.as_str()), ("Easy.", "Four."));
    assert!(calls.is_empty());
    assert_eq!(finish, "stop");
}

#[tokio::test]
async fn tool_choice_none_returns_the_call_as_text_and_parallel_false_keeps_one() {
    let s = scripted(Family::GptOss, TOOL_TURN, true).await;
    let (_, v) = s
        .post(
            "/v1/chat/completions",
            weather_request(json!({"tool_choice": "none"})),
        )
        .await;
    let message = &v["choices"][0]["message"];
    assert!(message.get("tool_calls").is_none(), "{v}");
    assert_eq!(message["content"], "{\"city\":\"Paris\"}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");

    let two = "<|channel|>commentary to=functions.a<|message|>{}<|end|><|start|>assistant<|channel|>commentary to=functions.b<|message|>{\"x\":1}<|return|>";
    let s = scripted(Family::GptOss, two, true).await;
    let (_, v) = s
        .post("/v1/chat/completions", weather_request(json!({})))
        .await;
    assert_eq!(
        v["choices"][0]["message"]["tool_calls"]
            .as_array()
            .unwrap()
            .len(),
        2,
        "{v}"
    );
    let (_, v) = s
        .post(
            "/v1/chat/completions",
            weather_request(json!({"parallel_tool_calls": false})),
        )
        .await;
    let calls = v["choices"][0]["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1, "{v}");
    assert_eq!(calls[0]["function"]["name"], "a");
}

#[tokio::test]
async fn unknown_named_tool_choices_and_bad_tool_turns_are_400s() {
    let s = scripted(Family::GptOss, TOOL_TURN, true).await;
    for (choice, says) in [
        (
            json!({"type": "function", "function": {"name": "get_time"}}),
            "not among the tools",
        ),
        (json!({"type": "function"}), "\"name\""),
    ] {
        let (status, v) = s
            .post(
                "/v1/chat/completions",
                weather_request(json!({"tool_choice": choice})),
            )
            .await;
        assert_eq!(status, 400, "{v}");
        assert_eq!(v["error"]["param"], "tool_choice");
        assert!(
            v["error"]["message"].as_str().unwrap().contains(says),
            "{v}"
        );
    }
    let (status, v) = s
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "tool", "content": "sunny"}]}),
        )
        .await;
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("tool_call_id"),
        "{v}"
    );

    let off = scripted(Family::GptOss, TOOL_TURN, false).await;
    let (status, v) = off
        .post("/v1/chat/completions", weather_request(json!({})))
        .await;
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--enable-auto-tool-choice"),
        "{v}"
    );
}

#[tokio::test]
async fn a_tool_result_is_rendered_into_the_next_prompt() {
    let s = scripted(Family::GptOss, ANSWER_TURN, true).await;
    let body = weather_request(json!({
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_7", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_7", "content": "sunny"}
        ],
        "return_token_ids": true
    }));
    let (status, v) = s.post("/v1/chat/completions", body).await;
    assert_eq!(status, 200, "{v}");
    let ids: Vec<u32> = serde_json::from_value(v["prompt_token_ids"].clone()).unwrap();
    let prompt = s.tokenizer.decode(&ids, false).unwrap();
    assert!(
        prompt.ends_with("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Paris\"}<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny<|end|><|start|>assistant"),
        "{prompt}"
    );
    assert!(
        prompt.contains("type get_weather = (_: "),
        "the tools are offered: {prompt}"
    );
    assert_eq!(v["choices"][0]["message"]["content"], "Four.");
}

#[tokio::test]
async fn qwen3_think_and_tool_call_whole_and_streamed() {
    let output = "<think>Paris, so the tool.</think>\n\nChecking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>";
    let s = scripted(Family::Qwen3Moe, output, true).await;
    let (status, v) = s
        .post("/v1/chat/completions", weather_request(json!({})))
        .await;
    assert_eq!(status, 200, "{v}");
    let message = &v["choices"][0]["message"];
    assert_eq!(message["reasoning_content"], "Paris, so the tool.");
    assert_eq!(message["content"], "\n\nChecking.\n");
    assert_eq!(message["tool_calls"][0]["function"]["name"], "get_weather");
    assert_eq!(
        message["tool_calls"][0]["function"]["arguments"],
        "{\"city\": \"Paris\"}"
    );
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
    let events = s
        .stream(
            "/v1/chat/completions",
            weather_request(json!({"stream": true})),
        )
        .await;
    let (reasoning, content, calls, finish) = fold_stream(&chunks(&events));
    assert_eq!(reasoning, "Paris, so the tool.");
    assert_eq!(content, "\n\nChecking.\n");
    assert!(!content.contains("<tool_call>"));
    assert_eq!(calls[0].2, "{\"city\": \"Paris\"}");
    assert_eq!(finish, "tool_calls");
}
