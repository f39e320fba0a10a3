//! Errors over HTTP: OpenAI/vLLM envelope, status codes, the parameter named.

mod common;

use common::*;
use serde_json::{Value, json};

fn assert_error(status: u16, v: &Value, want_status: u16, want_param: Option<&str>) {
    assert_eq!(status, want_status, "{v}");
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert!(e["type"].is_string(), "{v}");
    assert_eq!(e["code"], want_status, "{v}");
    match want_param {
        Some(p) => assert_eq!(e["param"], p, "{v}"),
        None => assert!(e.get("param").is_some(), "param key present (null): {v}"),
    }
}

#[tokio::test]
async fn bad_parameters_are_400_and_name_the_parameter() {
    let s = start().await;
    for (body, param, bound) in [
        (
            json!({"prompt": "a", "temperature": -1}),
            "temperature",
            "non-negative",
        ),
        (json!({"prompt": "a", "top_p": 0}), "top_p", "(0, 1]"),
        (json!({"prompt": "a", "top_k": -5}), "top_k", "at least 1"),
        (json!({"prompt": "a", "min_p": 2}), "min_p", "[0, 1]"),
        (
            json!({"prompt": "a", "presence_penalty": 9}),
            "presence_penalty",
            "[-2, 2]",
        ),
        (
            json!({"prompt": "a", "frequency_penalty": -9}),
            "frequency_penalty",
            "[-2, 2]",
        ),
        (
            json!({"prompt": "a", "repetition_penalty": 0}),
            "repetition_penalty",
            "(0, 2]",
        ),
        (json!({"prompt": "a", "n": 0}), "n", "[1, 16]"),
        (
            json!({"prompt": "a", "max_tokens": 0}),
            "max_tokens",
            "at least 1",
        ),
        (
            json!({"prompt": "a", "logprobs": 21}),
            "logprobs",
            "[0, 20]",
        ),
        (json!({"prompt": [1, 2, 99999]}), "prompt", "vocabulary"),
        (
            json!({"prompt": "a", "stop_token_ids": [-1]}),
            "stop_token_ids",
            "vocabulary",
        ),
        (
            json!({"prompt": "a", "max_tokens": 300}),
            "max_tokens",
            "256",
        ),
        (json!({"max_tokens": 3}), "prompt", "required"),
        (
            json!({"prompt": "a", "stream_options": {"include_usage": true}}),
            "stream_options",
            "stream",
        ),
    ] {
        let (status, v) = s.post("/v1/completions", body.clone()).await;
        assert_error(status, &v, 400, Some(param));
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains(bound), "{body}: {message}");
        assert_eq!(v["error"]["type"], "BadRequestError");
    }
    let (status, v) = s
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "a"}], "top_logprobs": 3}),
        )
        .await;
    assert_error(status, &v, 400, Some("top_logprobs"));
    let (status, v) = s
        .post("/v1/chat/completions", json!({"messages": []}))
        .await;
    assert_error(status, &v, 400, Some("messages"));
    let (status, v) = s
        .post("/v1/chat/completions", json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}))
        .await;
    assert_error(status, &v, 400, Some("messages"));
}

#[tokio::test]
async fn a_prompt_longer_than_max_model_len_is_400() {
    let s = start().await;
    let long: Vec<u32> = vec![65; 300];
    let (status, v) = s.post("/v1/completions", json!({"prompt": long})).await;
    assert_error(status, &v, 400, Some("prompt"));
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("maximum context length is 256")
    );
    let (status, v) = s
        .post("/v1/completions", json!({"prompt": "a".repeat(400)}))
        .await;
    assert_error(status, &v, 400, Some("prompt"));
    let (status, v) = s
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "a".repeat(400)}]}),
        )
        .await;
    assert_error(status, &v, 400, Some("prompt"));
}

#[tokio::test]
async fn unknown_model_is_404_and_unknown_route_too() {
    let s = start().await;
    let (status, v) = s
        .post("/v1/completions", json!({"model": "gpt-9", "prompt": "a"}))
        .await;
    assert_error(status, &v, 404, Some("model"));
    assert_eq!(v["error"]["type"], "NotFoundError");
    let (status, v) = s
        .post(
            "/v1/chat/completions",
            json!({"model": "gpt-9", "messages": [{"role": "user", "content": "a"}]}),
        )
        .await;
    assert_error(status, &v, 404, Some("model"));
    let (status, body) = s.get("/v1/nothing").await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_error(status, &v, 404, None);
}

#[tokio::test]
async fn malformed_bodies_are_400() {
    let s = start().await;
    let r = s
        .client
        .post(s.url("/v1/completions"))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let v: Value = r.json().await.unwrap();
    assert_error(400, &v, 400, None);
    let (status, v) = s
        .post(
            "/v1/completions",
            json!({"prompt": "a", "temperature": "hot"}),
        )
        .await;
    assert_error(status, &v, 400, None);
    let (status, v) = s.post("/detokenize", json!({"tokens": [1, -3]})).await;
    assert_error(status, &v, 400, Some("tokens"));
    let (status, v) = s.post("/tokenize", json!({})).await;
    assert_error(status, &v, 400, None);
    assert!(
        s.get("/metrics")
            .await
            .1
            .contains("afd_request_errors_total{model_name=\"tiny\",type=\"BadRequestError\"}")
    );
}

#[tokio::test]
async fn with_an_api_key_v1_routes_need_the_bearer_token_and_health_stays_open() {
    let node = router::fake::FakeNodeConfig::default();
    let nodes: Vec<Box<dyn step::AttentionNode>> =
        vec![Box::new(router::fake::FakeNode::new(node.clone()))];
    let s = start_secured(node, nodes, router_config(8, 8), Some("sk-test")).await;
    let body = json!({"model": "tiny", "prompt": "a", "max_tokens": 2});
    let (status, v) = s.post("/v1/completions", body.clone()).await;
    assert_error(status, &v, 401, None);
    assert_eq!(v["error"]["type"], "AuthenticationError");
    let send = |key: &'static str| {
        s.client
            .post(s.url("/v1/completions"))
            .header("Authorization", format!("Bearer {key}"))
            .json(&body)
            .send()
    };
    assert_eq!(send("sk-wrong").await.unwrap().status().as_u16(), 401);
    let ok = send("sk-test").await.unwrap();
    assert_eq!(ok.status().as_u16(), 200);
    let v: Value = ok.json().await.unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 2, "{v}");
    assert_eq!(s.get("/health").await.0, 200);
    assert_eq!(s.get("/metrics").await.0, 200);
}
