//! Prompt logprobs over HTTP against fake nodes: `echo` with `logprobs` on completions (the
//! shape lm-evaluation-harness scores), vLLM's `prompt_logprobs` on completions and chat,
//! streamed and whole, and `/tokenizer_info` for clients that tokenize through the server.
//! The fake node scores each prompt token by a hash of the tokens before it, so a score at the
//! wrong position or from the wrong prefix fails here.

mod common;

use common::*;
use router::fake::FakeNode;
use serde_json::{Value, json};

fn close(v: &Value, want: f32) -> bool {
    v.as_f64().is_some_and(|x| (x - want as f64).abs() < 1e-6)
}

#[tokio::test]
async fn echo_with_logprobs_scores_every_prompt_token_then_the_generated_ones() {
    let s = start().await;
    let prompt = vec![72u32, 101, 108, 108, 111];
    let (status, v) = s
        .post(
            "/v1/completions",
            json!({"prompt": prompt, "max_tokens": 2, "temperature": 0, "echo": true, "logprobs": 1}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let lp = &v["choices"][0]["logprobs"];
    let tokens = lp["tokens"].as_array().unwrap();
    assert_eq!(
        tokens.len(),
        5 + 2,
        "the prompt's tokens, then the generated ones"
    );
    assert_eq!(
        lp["token_logprobs"][0],
        Value::Null,
        "nothing before the first token"
    );
    assert_eq!(lp["top_logprobs"][0], Value::Null);
    for p in 1..5 {
        let want = FakeNode::prompt_score(&prompt[..p], prompt[p], 1);
        assert!(
            close(&lp["token_logprobs"][p], want.logprob),
            "position {p}: {} vs {}",
            lp["token_logprobs"][p],
            want.logprob
        );
        let top = lp["top_logprobs"][p].as_object().unwrap();
        assert_eq!(
            top.len(),
            1,
            "the fake's best alternative is the prompt token itself"
        );
    }
    let offsets: Vec<u64> = lp["text_offset"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o.as_u64().unwrap())
        .collect();
    assert_eq!(
        offsets,
        vec![0, 1, 2, 3, 4, 5, 6],
        "one character per byte token"
    );
    let generated = s.expected(&prompt, 2);
    assert_eq!(
        v["choices"][0]["text"],
        format!("{}{}", s.decode(&prompt), s.decode(&generated))
    );
    assert!(
        lp["token_logprobs"][5].as_f64().is_some(),
        "generated tokens keep theirs"
    );
}

#[tokio::test]
async fn vllm_prompt_logprobs_on_completions_and_chat() {
    let s = start().await;
    let prompt = vec![65u32, 66, 67];
    let (status, v) = s
        .post(
            "/v1/completions",
            json!({"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let field = v["choices"][0]["prompt_logprobs"].as_array().unwrap();
    assert_eq!(field.len(), 3);
    assert_eq!(field[0], Value::Null);
    for p in 1..3 {
        let want = FakeNode::prompt_score(&prompt[..p], prompt[p], 2);
        let position = field[p].as_object().unwrap();
        let entry = &position[&prompt[p].to_string()];
        assert!(close(&entry["logprob"], want.logprob));
        assert_eq!(entry["rank"], 1);
        assert_eq!(entry["decoded_token"], s.decode(&[prompt[p]]));
        assert_eq!(position.len(), 2, "the token and one more alternative");
    }
    assert!(
        v["choices"][0]["logprobs"].is_null(),
        "prompt logprobs alone ask for no generated logprobs"
    );
    let (status, v) = s
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "prompt_logprobs": 0}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let field = v["prompt_logprobs"].as_array().unwrap();
    assert_eq!(
        field.len() as u64,
        v["usage"]["prompt_tokens"].as_u64().unwrap()
    );
    assert_eq!(field[0], Value::Null);
    assert!(field[1..].iter().all(|p| p.as_object().unwrap().len() == 1));
}

#[tokio::test]
async fn streamed_prompt_logprobs_come_once_in_the_first_chunk() {
    let s = start().await;
    let events = s
        .stream(
            "/v1/completions",
            json!({"prompt": [65, 66, 67, 68], "max_tokens": 3, "stream": true, "echo": true, "logprobs": 0}),
        )
        .await;
    let chunks: Vec<Value> = events
        .iter()
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let logprobs: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"].get(0).map(|c| &c["logprobs"]))
        .collect();
    assert_eq!(
        logprobs[0]["token_logprobs"][0],
        Value::Null,
        "the prompt leads"
    );
    let all: Vec<&Value> = logprobs
        .iter()
        .flat_map(|l| l["token_logprobs"].as_array().unwrap())
        .collect();
    assert_eq!(all.len(), 4 + 3, "every prompt and generated token once");
    assert_eq!(
        all.iter().filter(|l| l.is_null()).count(),
        1,
        "one null: the first"
    );
    assert!(
        logprobs[0]["tokens"].as_array().unwrap().len() > 4,
        "the prompt comes with the first token"
    );
    let events = s
        .stream(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": true, "prompt_logprobs": 1}),
        )
        .await;
    let with_field = events
        .iter()
        .filter(|e| *e != "[DONE]")
        .filter(|e| {
            serde_json::from_str::<Value>(e)
                .unwrap()
                .get("prompt_logprobs")
                .is_some()
        })
        .count();
    assert_eq!(with_field, 1, "the prompt's scores go out once");
}

#[tokio::test]
async fn bad_prompt_logprobs_are_refused_and_tokenizer_info_answers() {
    let s = start().await;
    for bad in [json!(-1), json!(21), json!("x")] {
        let (status, v) = s
            .post(
                "/v1/completions",
                json!({"prompt": "a", "prompt_logprobs": bad}),
            )
            .await;
        assert_eq!(status, 400, "{bad}: {v}");
    }
    let (status, body) = s.get("/tokenizer_info").await;
    assert_eq!(status, 200);
    let info: Value = serde_json::from_str(&body).unwrap();
    assert!(info.get("eos_token").is_some(), "{info}");
    assert_eq!(info["model_max_length"], 256);
}

/// `echo` with `logprobs: 3` and `prompt_logprobs: 1` together: the prompt is scored once with
/// the wider count, and each field shows what it asked for.
#[tokio::test]
async fn echo_and_prompt_logprobs_together_each_get_their_own_width() {
    let s = start().await;
    let (status, v) = s
        .post(
            "/v1/completions",
            json!({"prompt": [65, 66, 67], "max_tokens": 1, "echo": true, "logprobs": 3,
                   "prompt_logprobs": 1}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let echo_top = v["choices"][0]["logprobs"]["top_logprobs"][1]
        .as_object()
        .unwrap();
    assert_eq!(
        echo_top.len(),
        3,
        "three alternatives (the token is the fake's first)"
    );
    let field = v["choices"][0]["prompt_logprobs"][1].as_object().unwrap();
    assert_eq!(
        field.len(),
        1,
        "the token, which is also the one alternative asked for"
    );
}
