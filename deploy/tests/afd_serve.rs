//! `afd serve` as a process: the whole system over 2 cards on loopback QUIC. Concurrent greedy
//! requests over HTTP get exactly the tokens `afd generate` gives each prompt alone, chat
//! works, and the cards' figures reach `/metrics`.

use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};

mod common;

use common::{AFD, Proc, fixture, free_port, generate_alone, wait_healthy};

#[test]
fn afd_serve_matches_afd_generate_under_concurrency() {
    let model = fixture("gpt-oss-bf16");
    let port = free_port();
    let _serve = Proc(
        Command::new(AFD)
            .arg("serve")
            .arg("--model")
            .arg(&model)
            .args(["--cards", "2", "--port", &port.to_string()])
            .args(["--served-model-name", "fixture"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let address = format!("127.0.0.1:{port}");
    wait_healthy(&address, Duration::from_secs(300));
    let http =
        |method: &str, path: &str, body: Option<&Value>| common::http(&address, method, path, body);

    let prompts: Vec<Vec<u32>> = (0..6u32)
        .map(|i| {
            (0..3 + i * 3)
                .map(|t| 10 + (t * 17 + i * 5) % 290)
                .collect()
        })
        .collect();
    let max_tokens = 10;
    let handles: Vec<_> = prompts
        .iter()
        .map(|p| {
            let body = json!({"model": "fixture", "prompt": p, "max_tokens": max_tokens,
                              "temperature": 0, "ignore_eos": true, "return_token_ids": true});
            {
                let address = address.clone();
                std::thread::spawn(move || {
                    common::http(&address, "POST", "/v1/completions", Some(&body))
                })
            }
        })
        .collect();
    for (h, p) in handles.into_iter().zip(&prompts) {
        let (status, body) = h.join().unwrap().expect("no answer");
        assert_eq!(status, 200, "{body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        let got: Vec<u64> = v["choices"][0]["token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap())
            .collect();
        assert_eq!(
            got,
            generate_alone(&model, p, 2, max_tokens),
            "prompt {p:?}"
        );
    }

    let chat =
        json!({"messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 4});
    let (status, body) = http("POST", "/v1/chat/completions", Some(&chat)).unwrap();
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert!(
        v["usage"]["completion_tokens"].as_u64().unwrap() <= 4,
        "{v}"
    );
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");

    let (_, metrics) = http("GET", "/metrics", None).unwrap();
    for card in 0..2 {
        let line = format!("afd_card_modeled_seconds{{model_name=\"fixture\",card=\"{card}\"}}");
        assert!(metrics.contains(&line), "{line} missing");
    }
    assert!(metrics.contains("vllm:generation_tokens_total{model_name=\"fixture\"}"));
}
