//! A hostile client against the real HTTP server on loopback TCP: random requests that are
//! each wrong in at least one way (a field of the wrong type or out of range, extreme numbers,
//! huge arrays, truncated JSON, invalid UTF-8, a body that is not a JSON object, a wrong
//! content type). Every answer must be a 4xx carrying the OpenAI error envelope, never a 5xx,
//! and the server must still answer a normal request correctly afterwards.

mod common;

use common::*;
use proptest::prelude::*;
use serde_json::{Map, Value, json};

/// Values `field` never accepts: wrong types, numbers out of its range or of every integer
/// type, arrays longer than any limit.
fn wrong_for(field: &str) -> Vec<Value> {
    let huge = json!(1e300);
    let not_i64 = json!(10_000_000_000_000_000_000u64);
    let object = json!({"nested": [1, {"deeper": null}]});
    let text = json!("not a value of this field");
    match field {
        "max_tokens" | "max_completion_tokens" => vec![
            text,
            json!(true),
            json!(1.5),
            json!(0),
            json!(-7),
            huge,
            not_i64,
            json!(1_000_000_000),
            object,
        ],
        "top_k" => vec![text, json!(1.5), json!(-2), huge, not_i64, json!([3])],
        "seed" => vec![text, json!(1.5), json!(true), huge, not_i64, object],
        "n" => vec![
            text,
            json!(0),
            json!(17),
            json!(-1),
            huge,
            not_i64,
            json!(2.5),
        ],
        "temperature" => vec![text, json!(-0.5), json!(-1e308), json!(1e308), json!([0.5])],
        "top_p" => vec![text, json!(0), json!(1.5), json!(-1e308), object],
        "min_p" => vec![text, json!(-0.1), json!(1.5), json!(1e308)],
        "presence_penalty" | "frequency_penalty" => {
            vec![text, json!(2.5), json!(-1e308), json!(1e308)]
        }
        "repetition_penalty" => vec![text, json!(0), json!(-1), json!(2.5), json!(1e308)],
        "stop" => vec![json!(5), json!(true), json!([1, 2]), object],
        "stop_token_ids" => vec![
            text,
            json!([-1]),
            json!(["a"]),
            json!([1.5]),
            json!([10_000_000_000_000_000_000u64]),
            json!([1_000_000]),
        ],
        "include_stop_str_in_output"
        | "ignore_eos"
        | "skip_special_tokens"
        | "stream"
        | "return_token_ids"
        | "echo"
        | "add_special_tokens"
        | "add_generation_prompt"
        | "continue_final_message" => vec![text, json!(1), json!([true]), object],
        "stream_options" => vec![json!(5), json!({"include_usage": "yes"}), text],
        "model" => vec![json!(5), json!(["tiny"]), object, json!("no-such-model")],
        "logprobs" | "prompt_logprobs" => vec![json!(true), json!(-1), json!(21), huge, text],
        "chat_logprobs" => vec![json!(5), text, object],
        "top_logprobs" => vec![json!(-1), json!(21), text, json!(1.5)],
        "chat_template_kwargs" => vec![json!(5), text, json!([1])],
        "prompt" => vec![
            json!(5),
            json!(true),
            object,
            json!([true, false]),
            json!([["a"]]),
            json!([[1, 2], "a"]),
            json!([-1, 2]),
            json!([10_000_000_000_000_000_000u64]),
            json!([]),
            // Huge arrays: more token ids than the context holds, and more prompts than
            // admission could ever take.
            json!(vec![65; 20_000]),
            json!(vec!["a"; 5_000]),
        ],
        "messages" => vec![
            json!(5),
            text,
            json!([]),
            json!([1, 2]),
            json!([{"role": 5, "content": "a"}]),
            json!([{"content": "a"}]),
            json!([{"role": "user", "content": 5}]),
            json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
            json!(vec![json!({"role": "user", "content": "a"}); 30_000]),
        ],
        "tokens" => vec![
            text,
            json!([1.5]),
            json!([-1]),
            json!(["a"]),
            json!([1_000_000]),
        ],
        other => panic!("no wrong values for {other}"),
    }
}

/// An endpoint, a valid body for it, and the fields it reads.
struct Endpoint {
    path: &'static str,
    valid: Value,
    fields: &'static [&'static str],
}

const COMMON: &[&str] = &[
    "max_tokens",
    "max_completion_tokens",
    "top_k",
    "seed",
    "n",
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "skip_special_tokens",
    "stream",
    "return_token_ids",
    "stream_options",
    "model",
    "prompt_logprobs",
];

fn endpoints() -> Vec<Endpoint> {
    let completion: Vec<&'static str> = COMMON
        .iter()
        .copied()
        .chain(["prompt", "logprobs", "echo", "add_special_tokens"])
        .collect();
    let chat: Vec<&'static str> = COMMON
        .iter()
        .copied()
        .chain([
            "messages",
            "chat_logprobs",
            "top_logprobs",
            "add_generation_prompt",
            "continue_final_message",
            "add_special_tokens",
            "chat_template_kwargs",
        ])
        .collect();
    vec![
        Endpoint {
            path: "/v1/completions",
            valid: json!({"model": "tiny", "prompt": "a", "max_tokens": 2}),
            fields: completion.leak(),
        },
        Endpoint {
            path: "/v1/chat/completions",
            valid: json!({"messages": [{"role": "user", "content": "a"}], "max_tokens": 2}),
            fields: chat.leak(),
        },
        Endpoint {
            path: "/tokenize",
            valid: json!({"prompt": "a"}),
            fields: &["prompt", "model", "add_special_tokens"],
        },
        Endpoint {
            path: "/detokenize",
            valid: json!({"tokens": [65, 66]}),
            fields: &["tokens", "model"],
        },
    ]
}

/// How a request is spoiled.
#[derive(Debug, Clone)]
enum Spoil {
    /// These fields get these wrong values (indices into the field list and value lists).
    Fields(Vec<(usize, usize)>),
    /// The valid body, cut short after this fraction of its bytes.
    Truncated(f64),
    /// The valid body with invalid UTF-8 (0xC0, then these bytes) inside its first string.
    InvalidUtf8(Vec<u8>),
    /// Random bytes.
    Bytes(Vec<u8>),
    /// JSON, but not an object.
    NotAnObject(usize),
    /// A valid body sent as another content type.
    ContentType(usize),
}

fn spoil() -> impl Strategy<Value = Spoil> {
    prop_oneof![
        4 => prop::collection::vec((any::<usize>(), any::<usize>()), 1..4).prop_map(Spoil::Fields),
        1 => (0.0f64..0.999).prop_map(Spoil::Truncated),
        1 => prop::collection::vec(0x80u8..=0xff, 1..6).prop_map(Spoil::InvalidUtf8),
        1 => prop::collection::vec(any::<u8>(), 0..64).prop_map(Spoil::Bytes),
        1 => (0usize..5).prop_map(Spoil::NotAnObject),
        1 => (0usize..3).prop_map(Spoil::ContentType),
    ]
}

/// The request `spoil` makes of `endpoint`'s valid body: content type and bytes.
fn spoiled(endpoint: &Endpoint, spoil: &Spoil) -> (&'static str, Vec<u8>) {
    let json = "application/json";
    let valid = endpoint.valid.to_string().into_bytes();
    match spoil {
        Spoil::Fields(picks) => {
            let mut body: Map<String, Value> = endpoint.valid.as_object().unwrap().clone();
            for &(f, v) in picks {
                let field = endpoint.fields[f % endpoint.fields.len()];
                let values = wrong_for(field);
                let key = if field == "chat_logprobs" {
                    "logprobs"
                } else {
                    field
                };
                body.insert(key.to_string(), values[v % values.len()].clone());
            }
            (json, Value::Object(body).to_string().into_bytes())
        }
        Spoil::Truncated(fraction) => {
            let keep = ((valid.len() as f64) * fraction) as usize;
            (json, valid[..keep.min(valid.len() - 1)].to_vec())
        }
        Spoil::InvalidUtf8(bytes) => {
            let quote = valid.iter().position(|&b| b == b'"').unwrap() + 1;
            let mut body = valid[..quote].to_vec();
            // 0xC0 never appears in UTF-8: the bytes after it cannot make it valid.
            body.push(0xc0);
            body.extend_from_slice(bytes);
            body.extend_from_slice(&valid[quote..]);
            (json, body)
        }
        Spoil::Bytes(bytes) => {
            // A random byte string that happens to be a valid request is spoiled anyway.
            let mut body = bytes.clone();
            body.insert(0, b'\xff');
            (json, body)
        }
        Spoil::NotAnObject(i) => {
            let values = ["[1, 2]", "42", "\"text\"", "null", "true"];
            (json, values[*i].as_bytes().to_vec())
        }
        Spoil::ContentType(i) => {
            let types = [
                "text/plain",
                "application/x-www-form-urlencoded",
                "multipart/form-data; boundary=x",
            ];
            (types[*i], valid)
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 300,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn every_spoiled_request_is_a_4xx_with_the_envelope(
        which in 0usize..4,
        spoil in spoil(),
    ) {
        let (runtime, server) = &*SERVER;
        let endpoint = &endpoints()[which];
        let (content_type, body) = spoiled(endpoint, &spoil);
        let (status, text, header) = runtime.block_on(async {
            let r = server
                .client
                .post(server.url(endpoint.path))
                .header("content-type", content_type)
                .body(body.clone())
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            let header = r
                .headers()
                .get("content-type")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string();
            (status, r.text().await.unwrap(), header)
        });
        let shown = String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned();
        prop_assert!((400..500).contains(&status), "{} {shown}: {status} {text}", endpoint.path);
        prop_assert!(header.starts_with("application/json"), "{header}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        let e = &v["error"];
        prop_assert_eq!(e["code"].as_u64(), Some(status as u64), "{}", text);
        prop_assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{}", text);
        prop_assert!(e["type"].as_str().is_some_and(|t| t.ends_with("Error")), "{}", text);
        prop_assert!(e.get("param").is_some(), "{}", text);
    }
}

/// One server for every case (the cases only read from it).
static SERVER: std::sync::LazyLock<(tokio::runtime::Runtime, TestServer)> =
    std::sync::LazyLock::new(|| {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let server = runtime.block_on(start());
        (runtime, server)
    });

#[test]
fn after_the_hostile_client_a_normal_request_is_served_correctly() {
    // Some hostile traffic first (this test may run before the proptest).
    let (runtime, s) = &*SERVER;
    runtime.block_on(async {
        for endpoint in endpoints() {
            for spoil in [Spoil::Truncated(0.5), Spoil::Fields(vec![(0, 0), (3, 4)])] {
                let (content_type, body) = spoiled(&endpoint, &spoil);
                let r = s
                    .client
                    .post(s.url(endpoint.path))
                    .header("content-type", content_type)
                    .body(body)
                    .send()
                    .await
                    .unwrap();
                assert!(r.status().is_client_error(), "{}", r.status());
            }
        }
        let prompt = s.encode("Hello");
        let (status, v) = s
            .post(
                "/v1/completions",
                json!({"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": true,
                       "return_token_ids": true}),
            )
            .await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["choices"][0]["token_ids"], json!(s.expected(&prompt, 6)));
        let (status, v) = s
            .post(
                "/v1/chat/completions",
                json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
            )
            .await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(s.get("/health").await.0, 200);
    });
}
