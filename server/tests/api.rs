//! Every endpoint and parameter family over HTTP, against fake attention nodes.

mod common;

use std::sync::{Arc, Mutex};

use common::*;
use router::fake::FakeNodeConfig;
use serde_json::{Value, json};

#[tokio::test]
async fn models_health_version() {
    let s = start().await;
    let (status, body) = s.get("/v1/models").await;
    assert_eq!(status, 200);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "tiny");
    assert_eq!(v["data"][0]["object"], "model");
    assert_eq!(v["data"][0]["root"], s.dir.path().display().to_string());
    assert_eq!(v["data"][0]["max_model_len"], 256);
    assert_eq!(s.get("/health").await, (200, String::new()));
    assert_eq!(s.get("/ping").await.0, 200);
    let (status, body) = s.get("/version").await;
    assert_eq!(status, 200);
    assert!(body.contains("version"));
}

#[tokio::test]
async fn completion_of_text_prompt() {
    let s = start().await;
    let (status, v) = s
        .post(
            "/v1/completions",
            json!({"model": "tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 0}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let ids = s.expected(&s.encode("Hello"), 8);
    assert_eq!(v["object"], "text_completion");
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(v["model"], "tiny");
    assert_eq!(v["choices"][0]["text"], s.decode(&ids));
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["choices"][0]["index"], 0);
    assert_eq!(v["usage"]["prompt_tokens"], 5);
    assert_eq!(v["usage"]["completion_tokens"], 8);
    assert_eq!(v["usage"]["total_tokens"], 13);
    assert!(
        v["choices"][0].get("token_ids").is_none(),
        "only with return_token_ids"
    );
}

#[tokio::test]
async fn default_max_tokens_is_16_and_aliases_work() {
    let s = start().await;
    let (_, v) = s
        .post("/v1/completions", json!({"prompt": "a", "temperature": 0}))
        .await;
    assert_eq!(v["usage"]["completion_tokens"], 16);
    let (_, v) = s
        .post(
            "/v1/completions",
            json!({"prompt": "a", "max_completion_tokens": 3}),
        )
        .await;
    assert_eq!(v["usage"]["completion_tokens"], 3);
}

#[tokio::test]
async fn token_id_prompts_and_return_token_ids() {
    let s = start().await;
    let prompt = vec![72u32, 105, 33, 256];
    let (status, v) = s
        .post(
            "/v1/completions",
            json!({"prompt": prompt, "max_tokens": 5, "temperature": 0, "return_token_ids": true}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let ids = s.expected(&prompt, 5);
    assert_eq!(v["choices"][0]["prompt_token_ids"], json!(prompt));
    assert_eq!(v["choices"][0]["token_ids"], json!(ids));
    assert_eq!(v["usage"]["prompt_tokens"], 4);
}

#[tokio::test]
async fn lists_of_prompts_and_n() {
    let s = start().await;
    let (status, v) = s
        .post("/v1/completions", json!({"prompt": [[65, 66], [67, 68, 69]], "max_tokens": 4, "n": 2, "temperature": 0, "return_token_ids": true}))
        .await;
    assert_eq!(status, 200, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        let prompt: Vec<u32> = if i < 2 {
            vec![65, 66]
        } else {
            vec![67, 68, 69]
        };
        assert_eq!(
            c["token_ids"],
            json!(s.expected(&prompt, 4)),
            "greedy: every sample equal"
        );
    }
    assert_eq!(v["usage"]["prompt_tokens"], 5);
    assert_eq!(v["usage"]["completion_tokens"], 16);
    let (_, v) = s
        .post(
            "/v1/completions",
            json!({"prompt": ["ab", "cd"], "max_tokens": 2}),
        )
        .await;
    assert_eq!(v["choices"].as_array().unwrap().len(), 2);
}

#[tokio::test]
async fn seeded_sampling_is_reproducible_and_choices_use_different_seeds() {
    let s = start().await;
    let body = json!({"prompt": "x", "max_tokens": 12, "n": 3, "temperature": 1.0, "seed": 42, "return_token_ids": true});
    let (_, a) = s.post("/v1/completions", body.clone()).await;
    let (_, b) = s.post("/v1/completions", body).await;
    let ids = |v: &Value| -> Vec<Value> {
        v["choices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["token_ids"].clone())
            .collect()
    };
    assert_eq!(ids(&a), ids(&b), "same seed, same samples");
    let a = ids(&a);
    assert_ne!(a[0], a[1], "choices draw with seed + i");
    assert_ne!(a[1], a[2]);
}

#[tokio::test]
async fn sampling_parameters_reach_the_node() {
    let observed = Arc::new(Mutex::new(Vec::new()));
    let node = FakeNodeConfig {
        observed: Some(Arc::clone(&observed)),
        ..Default::default()
    };
    let s = start_with(node, 1, router_config(8, 16)).await;
    let (status, v) = s
        .post(
            "/v1/completions",
            json!({"prompt": "hi", "max_tokens": 1, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.05,
                   "seed": 7, "presence_penalty": 0.5, "frequency_penalty": -0.25, "repetition_penalty": 1.1,
                   "logprobs": 3, "unknown_field": {"ignored": true}}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let seen = observed.lock().unwrap().clone();
    let r = seen.last().unwrap();
    assert!((r.params.temperature - 0.7).abs() < 1e-6);
    assert!((r.params.top_p - 0.9).abs() < 1e-6);
    assert_eq!(r.params.top_k, 5);
    assert!((r.params.min_p - 0.05).abs() < 1e-6);
    assert_eq!(r.params.seed, 7);
    assert!((r.penalties.presence - 0.5).abs() < 1e-6);
    assert!((r.penalties.frequency + 0.25).abs() < 1e-6);
    assert!((r.penalties.repetition - 1.1).abs() < 1e-6);
    assert_eq!(r.top_logprobs, 3);
}

#[tokio::test]
async fn temperatures_too_small_to_divide_by_are_greedy() {
    let observed = Arc::new(Mutex::new(Vec::new()));
    let node = FakeNodeConfig {
        observed: Some(Arc::clone(&observed)),
        ..Default::default()
    };
    let s = start_with(node, 1, router_config(8, 16)).await;
    let prompt = s.encode("It is a truth");
    let greedy = s.expected(&prompt, 6);
    for temperature in [0.0, 1e-40, 1e-38, 1e-20, 9e-6] {
        let (status, v) = s
            .post(
                "/v1/completions",
                json!({"prompt": prompt, "max_tokens": 6, "temperature": temperature, "seed": 3,
                       "return_token_ids": true, "ignore_eos": true}),
            )
            .await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(
            v["choices"][0]["token_ids"],
            json!(greedy),
            "temperature {temperature}"
        );
        let seen = observed.lock().unwrap().clone();
        assert_eq!(
            seen.last().unwrap().params.temperature,
            0.0,
            "{temperature}"
        );
    }
    // From vLLM's 1e-5 on it samples.
    let (status, _) = s
        .post(
            "/v1/completions",
            json!({"prompt": prompt, "max_tokens": 1, "temperature": 1e-5}),
        )
        .await;
    assert_eq!(status, 200);
    let seen = observed.lock().unwrap().clone();
    assert!(!seen.last().unwrap().params.is_greedy());
}

#[tokio::test]
async fn completion_logprobs_and_echo() {
    let s = start().await;
    let (_, v) = s
        .post(
            "/v1/completions",
            json!({"prompt": "ab", "max_tokens": 3, "temperature": 0, "logprobs": 2}),
        )
        .await;
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 3);
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), 3);
    assert_eq!(
        lp["text_offset"],
        json!([0, 1, 2]),
        "one character per byte token"
    );
    let top = lp["top_logprobs"][0].as_object().unwrap();
    assert_eq!(top.len(), 2);
    assert!(lp["token_logprobs"][0].as_f64().unwrap() <= 0.0);
    let (_, v) = s
        .post(
            "/v1/completions",
            json!({"prompt": "ab", "max_tokens": 3, "temperature": 0, "echo": true}),
        )
        .await;
    let ids = s.expected(&s.encode("ab"), 3);
    assert_eq!(v["choices"][0]["text"], format!("ab{}", s.decode(&ids)));
}

#[tokio::test]
async fn chat_completion_with_template_and_parts() {
    let s = start().await;
    let messages = json!([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "2 + 2?"}]}
    ]);
    let (status, v) = s
        .post("/v1/chat/completions", json!({"model": "tiny", "messages": messages, "max_completion_tokens": 6, "temperature": 0, "return_token_ids": true}))
        .await;
    assert_eq!(status, 200, "{v}");
    let rendered = "<|start|>system<|message|>Be brief.<|end|><|start|>user<|message|>What is\n2 + 2?<|end|><|start|>assistant";
    let prompt = s.tokenizer.encode(rendered, false).unwrap();
    assert_eq!(v["prompt_token_ids"], json!(prompt));
    let ids = s.expected(&prompt, 6);
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["message"]["content"], s.decode(&ids));
    assert_eq!(v["choices"][0]["token_ids"], json!(ids));
    assert_eq!(v["usage"]["prompt_tokens"], prompt.len());
    let (_, v) = s
        .post("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": true, "top_logprobs": 2}))
        .await;
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 2);
    assert_eq!(content[0]["top_logprobs"].as_array().unwrap().len(), 2);
    assert!(content[0]["bytes"].is_array());
}

#[tokio::test]
async fn stop_strings_across_token_boundaries() {
    let s = start_with(
        script_node("Hello World STOP more", &[]),
        1,
        router_config(8, 16),
    )
    .await;
    let (_, v) = s
        .post(
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 40, "stop": "STOP"}),
        )
        .await;
    assert_eq!(v["choices"][0]["text"], "Hello World ");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["choices"][0]["stop_reason"], "STOP");
    assert_eq!(
        v["usage"]["completion_tokens"], 16,
        "tokens up to the end of the stop string"
    );
    let (_, v) = s
        .post("/v1/completions", json!({"prompt": "x", "max_tokens": 40, "stop": ["zz", "World"], "include_stop_str_in_output": true}))
        .await;
    assert_eq!(v["choices"][0]["text"], "Hello World");
    let events = s
        .stream(
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 40, "stop": ["STOP"], "stream": true}),
        )
        .await;
    let texts: Vec<String> = chunks(&events)
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(texts.concat(), "Hello World ");
    assert!(
        texts.iter().all(|t| !t.contains('S')),
        "no part of the stop string leaks: {texts:?}"
    );
}

#[tokio::test]
async fn stop_token_ids_eos_and_ignore_eos() {
    // 258 is <|return|>, an end-of-sequence token of the synthetic GPT-OSS checkpoint.
    let s = start_with(script_node("ab", &[258, 99, 100]), 1, router_config(8, 16)).await;
    let (_, v) = s
        .post(
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 10, "return_token_ids": true}),
        )
        .await;
    assert_eq!(v["choices"][0]["text"], "ab");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["choices"][0]["stop_reason"], Value::Null);
    assert_eq!(v["choices"][0]["token_ids"], json!([97, 98, 258]));
    let (_, v) = s
        .post(
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 5, "ignore_eos": true}),
        )
        .await;
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(
        v["choices"][0]["text"], "abcd",
        "the special token is skipped in text"
    );
    let (_, v) = s
        .post(
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 10, "stop_token_ids": [98]}),
        )
        .await;
    assert_eq!(v["choices"][0]["text"], "a");
    assert_eq!(v["choices"][0]["stop_reason"], 98);
    let (_, v) = s
        .post("/v1/completions", json!({"prompt": "x", "max_tokens": 10, "stop_token_ids": [98], "include_stop_str_in_output": true}))
        .await;
    assert_eq!(v["choices"][0]["text"], "ab");
}

#[tokio::test]
async fn tokenize_and_detokenize() {
    let s = start().await;
    let (status, v) = s
        .post(
            "/tokenize",
            json!({"model": "tiny", "prompt": "héllo", "return_token_strs": true}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let ids = s.encode("héllo");
    assert_eq!(v["tokens"], json!(ids));
    assert_eq!(v["count"], ids.len());
    assert_eq!(v["max_model_len"], 256);
    assert_eq!(v["token_strs"].as_array().unwrap().len(), ids.len());
    let (_, d) = s.post("/detokenize", json!({"tokens": ids})).await;
    assert_eq!(d["prompt"], "héllo");
    let (_, v) = s
        .post(
            "/tokenize",
            json!({"messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    let expected = s
        .tokenizer
        .encode("<|start|>user<|message|>hi<|end|><|start|>assistant", false)
        .unwrap();
    assert_eq!(v["tokens"], json!(expected));
}

#[tokio::test]
async fn metrics_count_prefix_cache_queries_and_hits_in_tokens() {
    let s = start().await;
    let prompt = "the same long system prompt, word after word, ".repeat(4);
    let n = s.tokenizer.encode(prompt.as_str(), false).unwrap().len();
    assert!(n > 32, "{n} tokens: at least two blocks of 16");
    for _ in 0..2 {
        let (status, _) = s
            .post(
                "/v1/completions",
                json!({"prompt": prompt, "max_tokens": 2}),
            )
            .await;
        assert_eq!(status, 200);
    }
    assert_eq!(
        s.metric("vllm:prefix_cache_queries_total").await,
        Some(2.0 * n as f64)
    );
    // The second request finds the first's full blocks, its last token excepted.
    let hit = (n - 1) / 16 * 16;
    assert_eq!(
        s.metric("vllm:prefix_cache_hits_total").await,
        Some(hit as f64)
    );
}

#[tokio::test]
async fn metrics_count_requests_and_tokens() {
    let s = start().await;
    for _ in 0..2 {
        s.post("/v1/completions", json!({"prompt": "abc", "max_tokens": 5}))
            .await;
    }
    let (status, text) = s.get("/metrics").await;
    assert_eq!(status, 200);
    for name in [
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:request_queue_time_seconds_bucket",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
        "vllm:cache_config_info",
        "afd_node_kv_cache_usage_perc{model_name=\"tiny\",node=\"0\"}",
    ] {
        assert!(text.contains(name), "{name} missing:\n{text}");
    }
    assert_eq!(s.metric("vllm:generation_tokens_total").await, Some(10.0));
    assert_eq!(s.metric("vllm:prompt_tokens_total").await, Some(6.0));
    assert_eq!(
        s.metric("vllm:time_to_first_token_seconds_count").await,
        Some(2.0)
    );
    assert_eq!(
        s.metric("vllm:inter_token_latency_seconds_count").await,
        Some(8.0)
    );
    assert_eq!(
        s.metric("vllm:request_success_total{model_name=\"tiny\",finished_reason=\"length\"}")
            .await,
        Some(2.0)
    );
}
