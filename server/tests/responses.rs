//! `/v1/responses` over fake nodes that write scripted harmony (GPT-OSS) and Qwen3 outputs: the
//! items a client gets whole, the typed events of a stream (each `event:` line naming its
//! JSON's type, sequence numbers in order, the deltas adding up to the items), the tool turn
//! sent back, and what is refused because nothing is stored.

mod common;

use common::*;
use model::Family;
use serde_json::{Value, json};

const TOOL_TURN: &str = "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Paris\"}<|call|>";
const ANSWER_TURN: &str = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Four.<|return|>";

fn weather(extra: Value) -> Value {
    let mut body = json!({
        "input": "Weather in Paris?",
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}],
        "max_output_tokens": 300,
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

/// The (event name, JSON) pairs of a streamed response; checks each `event:` line names the
/// type its JSON carries and the sequence numbers count from 0.
async fn events(s: &TestServer, body: Value) -> Vec<(String, Value)> {
    let r = reqwest::Client::new()
        .post(s.url("/v1/responses"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let text = r.text().await.unwrap();
    let mut out = Vec::new();
    for block in text.split("\n\n").filter(|b| !b.trim().is_empty()) {
        let mut name = None;
        let mut data = String::new();
        for line in block.lines() {
            if let Some(n) = line.strip_prefix("event:") {
                name = Some(n.trim().to_string());
            } else if let Some(d) = line.strip_prefix("data:") {
                data.push_str(d.trim_start());
            }
        }
        if data.is_empty() {
            continue; // a keep-alive comment
        }
        let json: Value = serde_json::from_str(&data).unwrap_or_else(|e| panic!("{e}: {data}"));
        let name = name.unwrap_or_else(|| panic!("no event line: {block}"));
        assert_eq!(json["type"], name.as_str(), "{block}");
        assert_eq!(json["sequence_number"], out.len(), "{block}");
        out.push((name, json));
    }
    out
}

/// The text of the deltas of events named `name`, concatenated.
fn deltas(events: &[(String, Value)], name: &str) -> String {
    events
        .iter()
        .filter(|(n, _)| n == name)
        .map(|(_, e)| e["delta"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test]
async fn a_harmony_tool_call_is_a_function_call_item_whole_and_streamed() {
    let s = scripted(Family::GptOss, TOOL_TURN, true).await;
    let (status, v) = s.post("/v1/responses", weather(json!({}))).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "response");
    assert_eq!(v["status"], "completed");
    assert_eq!(v["store"], false);
    assert!(v["id"].as_str().unwrap().starts_with("resp_"), "{v}");
    let output = v["output"].as_array().unwrap();
    assert_eq!(output.len(), 2, "{v}");
    assert_eq!(output[0]["type"], "reasoning");
    assert_eq!(output[0]["content"][0]["text"], "Need the weather.");
    assert_eq!(output[1]["type"], "function_call");
    assert_eq!(output[1]["name"], "get_weather");
    assert_eq!(output[1]["arguments"], "{\"city\":\"Paris\"}");
    assert!(output[1]["call_id"].as_str().unwrap().starts_with("call_"));
    let usage = &v["usage"];
    assert_eq!(
        usage["total_tokens"].as_u64().unwrap(),
        usage["input_tokens"].as_u64().unwrap() + usage["output_tokens"].as_u64().unwrap()
    );
    assert!(usage["output_tokens"].as_u64().unwrap() > 0, "{v}");

    let ev = events(&s, weather(json!({"stream": true}))).await;
    let names: Vec<&str> = ev.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names[..2], ["response.created", "response.in_progress"]);
    assert_eq!(names.last(), Some(&"response.completed"));
    assert_eq!(
        deltas(&ev, "response.reasoning_text.delta"),
        "Need the weather."
    );
    assert_eq!(
        deltas(&ev, "response.function_call_arguments.delta"),
        "{\"city\":\"Paris\"}"
    );
    assert_eq!(deltas(&ev, "response.output_text.delta"), "");
    let done = &ev.last().unwrap().1["response"];
    assert_eq!(done["output"][1]["arguments"], "{\"city\":\"Paris\"}");
    let added = names
        .iter()
        .filter(|n| **n == "response.output_item.added")
        .count();
    let finished = names
        .iter()
        .filter(|n| **n == "response.output_item.done")
        .count();
    assert_eq!((added, finished), (2, 2), "{names:?}");
}

#[tokio::test]
async fn reasoning_then_the_answer_and_the_tool_turn_sent_back() {
    let s = scripted(Family::GptOss, ANSWER_TURN, true).await;
    // The conversation so far: the call and its output, as a client sends them back.
    let body = weather(json!({"input": [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ], "instructions": "Answer in one word."}));
    let (status, v) = s.post("/v1/responses", body.clone()).await;
    assert_eq!(status, 200, "{v}");
    let output = v["output"].as_array().unwrap();
    assert_eq!(output.len(), 2, "{v}");
    assert_eq!(output[0]["content"][0]["text"], "Easy.");
    assert_eq!(output[1]["type"], "message");
    assert_eq!(output[1]["role"], "assistant");
    assert_eq!(output[1]["content"][0]["type"], "output_text");
    assert_eq!(output[1]["content"][0]["text"], "Four.");
    assert_eq!(v["instructions"], "Answer in one word.");
    let mut streamed = body;
    streamed["stream"] = json!(true);
    let ev = events(&s, streamed).await;
    assert_eq!(deltas(&ev, "response.reasoning_text.delta"), "Easy.");
    assert_eq!(deltas(&ev, "response.output_text.delta"), "Four.");
    let text_done: Vec<&Value> = ev
        .iter()
        .filter(|(n, _)| n == "response.output_text.done")
        .map(|(_, e)| e)
        .collect();
    assert_eq!(text_done.len(), 1);
    assert_eq!(text_done[0]["text"], "Four.");
}

#[tokio::test]
async fn max_output_tokens_makes_an_incomplete_response() {
    let s = scripted(Family::GptOss, ANSWER_TURN, false).await;
    let body = json!({"input": "2 + 2?", "max_output_tokens": 3});
    let (status, v) = s.post("/v1/responses", body.clone()).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["status"], "incomplete");
    assert_eq!(v["incomplete_details"]["reason"], "max_output_tokens");
    assert_eq!(v["usage"]["output_tokens"], 3);
    let mut streamed = body;
    streamed["stream"] = json!(true);
    let ev = events(&s, streamed).await;
    assert_eq!(ev.last().unwrap().0, "response.incomplete");
}

#[tokio::test]
async fn qwen3_thinking_and_hermes_calls_become_items() {
    let s = scripted(
        Family::Qwen3Moe,
        "<think>Check it.</think><tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}</tool_call><|im_end|>",
        true,
    )
    .await;
    let (status, v) = s.post("/v1/responses", weather(json!({}))).await;
    assert_eq!(status, 200, "{v}");
    let output = v["output"].as_array().unwrap();
    let kinds: Vec<&str> = output.iter().map(|o| o["type"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["reasoning", "function_call"], "{v}");
    assert_eq!(output[0]["content"][0]["text"], "Check it.");
    let args: Value = serde_json::from_str(output[1]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "Paris"}));
}

#[tokio::test]
async fn what_needs_stored_responses_is_refused_and_nothing_can_be_fetched() {
    let s = scripted(Family::GptOss, ANSWER_TURN, false).await;
    let (status, v) = s
        .post(
            "/v1/responses",
            json!({"input": "x", "previous_response_id": "resp_123"}),
        )
        .await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "previous_response_id");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("whole conversation"),
        "{v}"
    );
    let (status, body) = s.get("/v1/responses/resp_123").await;
    assert_eq!(status, 404, "{body}");
    assert!(body.contains("stores no responses"), "{body}");
    // A tool call without the server's --enable-auto-tool-choice is refused as in chat.
    let (status, v) = s.post("/v1/responses", weather(json!({}))).await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "tool_choice");
}
