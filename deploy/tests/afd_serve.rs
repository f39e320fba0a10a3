//! `afd serve` as a process: the whole system over 2 cards on loopback QUIC. Concurrent greedy
//! requests over HTTP get exactly the tokens `afd generate` gives each prompt alone, chat
//! works, and the cards' figures reach `/metrics`.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

mod common;

use common::{AFD, Proc, fixture, free_port, generate_alone};

/// A minimal HTTP/1.1 exchange (`Connection: close`): status and body.
fn http(port: u16, method: &str, path: &str, body: Option<&Value>) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(120))).ok()?;
    let payload = body.map(|b| b.to_string()).unwrap_or_default();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{payload}",
        payload.len()
    );
    s.write_all(req.as_bytes()).ok()?;
    let mut raw = String::new();
    s.read_to_string(&mut raw).ok()?;
    let (head, body) = raw.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((status, body.to_string()))
}

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
    let deadline = Instant::now() + Duration::from_secs(300);
    while http(port, "GET", "/health", None).map(|(s, _)| s) != Some(200) {
        assert!(
            Instant::now() < deadline,
            "afd serve did not become healthy"
        );
        std::thread::sleep(Duration::from_millis(100));
    }

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
            std::thread::spawn(move || http(port, "POST", "/v1/completions", Some(&body)))
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
    let (status, body) = http(port, "POST", "/v1/chat/completions", Some(&chat)).unwrap();
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert!(
        v["usage"]["completion_tokens"].as_u64().unwrap() <= 4,
        "{v}"
    );
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");

    let (_, metrics) = http(port, "GET", "/metrics", None).unwrap();
    for card in 0..2 {
        let line = format!("afd_card_modeled_seconds{{model_name=\"fixture\",card=\"{card}\"}}");
        assert!(metrics.contains(&line), "{line} missing");
    }
    assert!(metrics.contains("vllm:generation_tokens_total{model_name=\"fixture\"}"));
}
