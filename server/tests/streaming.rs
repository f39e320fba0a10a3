//! Server-sent events: chunk shapes, usage, the chat role chunk, UTF-8, errors mid-stream.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use router::fake::{FakeNode, FakeNodeConfig, StepGate};
use serde_json::{Value, json};
use step::{AttentionNode, KvCapacity, SeqId, StepBatch, StepError, StepOutput};

#[tokio::test]
async fn completion_stream_matches_the_full_response() {
    let s = start().await;
    let body = json!({"prompt": "Hi", "max_tokens": 7, "temperature": 0, "return_token_ids": true});
    let (_, full) = s.post("/v1/completions", body.clone()).await;
    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    stream_body["stream_options"] = json!({"include_usage": true});
    let c = chunks(&s.stream("/v1/completions", stream_body).await);
    let (usage, content) = c.split_last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 7);
    assert_eq!(usage["usage"]["prompt_tokens"], 2);
    // One chunk per token, or fewer when the client falls behind (tokens already waiting are
    // merged into one chunk, as vLLM's output collector does).
    assert!(!content.is_empty() && content.len() <= 7);
    let text: String = content
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap())
        .collect();
    assert_eq!(text, full["choices"][0]["text"].as_str().unwrap());
    let ids: Vec<Value> = content
        .iter()
        .flat_map(|c| c["choices"][0]["token_ids"].as_array().unwrap().clone())
        .collect();
    assert_eq!(json!(ids), full["choices"][0]["token_ids"]);
    assert_eq!(
        content[0]["choices"][0]["prompt_token_ids"],
        json!(s.encode("Hi"))
    );
    assert!(
        content[1..]
            .iter()
            .all(|c| c["choices"][0].get("prompt_token_ids").is_none())
    );
    let (last, rest) = content.split_last().unwrap();
    for c in rest {
        assert_eq!(c["choices"][0]["finish_reason"], Value::Null);
        assert_eq!(c["object"], "text_completion");
        assert_eq!(c["id"], content[0]["id"]);
    }
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    // No usage chunk unless asked.
    let c = chunks(
        &s.stream(
            "/v1/completions",
            json!({"prompt": "Hi", "max_tokens": 3, "stream": true}),
        )
        .await,
    );
    assert!(
        c.iter()
            .all(|c| !c["choices"].as_array().unwrap().is_empty())
    );
    assert!(c.iter().all(|c| c.get("usage").is_none_or(Value::is_null)));
}

#[tokio::test]
async fn continuous_usage_and_n_choices() {
    let s = start().await;
    let c = chunks(
        &s.stream(
            "/v1/completions",
            json!({"prompt": "Hi", "max_tokens": 3, "n": 2, "stream": true, "return_token_ids": true,
                   "stream_options": {"include_usage": true, "continuous_usage_stats": true}}),
        )
        .await,
    );
    assert!(
        c.iter().all(|c| c["usage"]["prompt_tokens"] == 2),
        "usage in every chunk"
    );
    for index in 0..2 {
        let mine: Vec<&Value> = c
            .iter()
            .filter(|c| {
                c["choices"]
                    .as_array()
                    .is_some_and(|a| a.len() == 1 && a[0]["index"] == index)
            })
            .collect();
        let tokens: usize = mine
            .iter()
            .map(|c| c["choices"][0]["token_ids"].as_array().unwrap().len())
            .sum();
        assert_eq!(tokens, 3);
        assert_eq!(
            mine.last().unwrap()["choices"][0]["finish_reason"],
            "length"
        );
    }
    assert_eq!(c.last().unwrap()["usage"]["completion_tokens"], 6);
}

#[tokio::test]
async fn chat_stream_sends_the_role_with_the_first_token() {
    let gate = StepGate::new();
    let node = FakeNodeConfig {
        gate: Some(Arc::clone(&gate)),
        ..Default::default()
    };
    let s = start_with(node, 1, router_config(8, 16)).await;
    gate.pause();
    let mut r = s
        .client
        .post(s.url("/v1/chat/completions"))
        .json(&json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0, "stream": true,
                      "stream_options": {"include_usage": true}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    // While the prefill is held, no chunk (and so no role chunk) may arrive.
    let early = tokio::time::timeout(Duration::from_millis(300), r.chunk()).await;
    assert!(
        early.is_err(),
        "a chunk arrived before the first token: {early:?}"
    );
    gate.resume();
    let mut body = String::new();
    while let Some(bytes) = r.chunk().await.unwrap() {
        body.push_str(std::str::from_utf8(&bytes).unwrap());
    }
    let c = chunks(&parse_sse(&body));
    assert_eq!(c[0]["object"], "chat.completion.chunk");
    assert_eq!(
        c[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    assert!(c[1]["choices"][0]["delta"].get("role").is_none());
    let content: String = c[1..c.len() - 1]
        .iter()
        .map(|c| c["choices"][0]["delta"]["content"].as_str().unwrap())
        .collect();
    let prompt = s
        .tokenizer
        .encode("<|start|>user<|message|>hi<|end|><|start|>assistant", false)
        .unwrap();
    assert_eq!(content, s.decode(&s.expected(&prompt, 4)));
    assert_eq!(c[c.len() - 2]["choices"][0]["finish_reason"], "length");
    assert_eq!(c.last().unwrap()["usage"]["completion_tokens"], 4);
}

#[tokio::test]
async fn streamed_text_never_splits_a_character() {
    let text = "héllo wörld 世界 🦀 ";
    let s = start_with(script_node(text, &[]), 1, router_config(8, 16)).await;
    let n = text.len();
    let c = chunks(
        &s.stream(
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": n, "stream": true}),
        )
        .await,
    );
    let pieces: Vec<&str> = c
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap())
        .collect();
    assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')), "{pieces:?}");
    assert_eq!(pieces.concat(), text);
}

/// A node that fails every step after the first `ok_steps`.
struct FailingNode {
    inner: FakeNode,
    ok_steps: usize,
}

impl AttentionNode for FailingNode {
    fn kv_capacity(&self) -> KvCapacity {
        self.inner.kv_capacity()
    }
    fn step(&mut self, batch: &StepBatch) -> Result<StepOutput, StepError> {
        if self.ok_steps == 0 {
            return Err(StepError::Card {
                card: 1,
                message: "simulated card failure".into(),
            });
        }
        self.ok_steps -= 1;
        self.inner.step(batch)
    }
    fn free(&mut self, seqs: &[SeqId]) -> Result<(), StepError> {
        self.inner.free(seqs)
    }
}

#[tokio::test]
async fn an_error_mid_stream_is_a_data_event_then_done() {
    let cfg = FakeNodeConfig::default();
    let node = FailingNode {
        inner: FakeNode::new(cfg.clone()),
        ok_steps: 3,
    };
    let s = start_nodes(cfg, vec![Box::new(node)], router_config(8, 16)).await;
    assert_eq!(s.get("/health").await.0, 200);
    let events = s
        .stream(
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 10, "stream": true, "return_token_ids": true}),
        )
        .await;
    assert_eq!(events.last().unwrap(), "[DONE]");
    let last: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    // A card that failed is the deployment's trouble, not the server's: 503, as for a card
    // that is down (issue 15), never 500.
    assert_eq!(last["error"]["code"], 503, "{last}");
    assert!(
        last["error"]["message"]
            .as_str()
            .unwrap()
            .contains("simulated card failure")
    );
    let tokens: usize = events[..events.len() - 2]
        .iter()
        .map(|e| {
            serde_json::from_str::<Value>(e).unwrap()["choices"][0]["token_ids"]
                .as_array()
                .unwrap()
                .len()
        })
        .sum();
    assert_eq!(tokens, 3, "three good steps, then the error");
    let (status, body) = s.get("/health").await;
    assert_eq!(status, 503, "{body}");
    let (status, v) = s
        .post("/v1/completions", json!({"prompt": "x", "max_tokens": 2}))
        .await;
    assert_eq!(status, 503, "{v}");
}
