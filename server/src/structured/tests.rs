use std::path::Path;

use serde_json::json;

use super::*;

fn tokenizer(fixture: &str) -> ModelTokenizer {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures")
        .join(fixture);
    ModelTokenizer::load(&dir).unwrap()
}

/// Decodes under `constraint` as a model would, picking pseudo-random allowed tokens (a stop
/// token as soon as one is allowed), until a stop token; returns the tokens.
fn walk(constraint: &Constraint, stop_ids: &[u32], seed: u64) -> Vec<u32> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut tokens = Vec::new();
    for _ in 0..2000 {
        let mask = constraint.0.next_mask().unwrap();
        let allowed: Vec<u32> = mask.iter().collect();
        assert!(
            !allowed.is_empty(),
            "the grammar allows nothing after {tokens:?}"
        );
        let token = match allowed.iter().find(|t| stop_ids.contains(t)) {
            Some(&stop) if tokens.len() > 3 || allowed.len() == 1 => stop,
            _ => {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                allowed[(state >> 33) as usize % allowed.len()]
            }
        };
        if let Err(e) = constraint.0.accept(token) {
            panic!(
                "token {token} (allowed {}) refused after {tokens:?}: {e}",
                allowed.len()
            );
        }
        tokens.push(token);
        if stop_ids.contains(&token) {
            return tokens;
        }
    }
    panic!("no stop token within 2000 tokens: {tokens:?}");
}

fn compile(
    fixture: &str,
    format: &OutputFormat,
    framing: Framing,
) -> (ModelTokenizer, Vec<u32>, CompiledFormat) {
    let t = tokenizer(fixture);
    let stops = t.eos_token_ids.clone();
    let grammars = OutputGrammars::new(t.vocab_size() + 5, &stops);
    let compiled = grammars.compile(&t, format, framing).unwrap();
    (t, stops, compiled)
}

fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "city": {"enum": ["Paris", "Tokyo"]},
            "sunny": {"type": "boolean"},
            "degrees": {"type": "integer", "minimum": -9, "maximum": 9}
        },
        "required": ["city", "sunny", "degrees"],
        "additionalProperties": false
    })
}

#[test]
fn every_output_under_a_schema_parses_and_matches_it_for_every_tokenizer() {
    for fixture in ["gpt-oss-bf16", "mixtral", "qwen3-moe"] {
        let (t, stops, compiled) =
            compile(fixture, &OutputFormat::JsonSchema(schema()), Framing::Whole);
        for seed in 0..8 {
            let tokens = walk(&compiled.constraint(), &stops, seed);
            let text = t.decode(&tokens, true).unwrap();
            let v: Value = serde_json::from_str(text.trim())
                .unwrap_or_else(|e| panic!("{fixture}: {text:?} is not JSON: {e}"));
            let obj = v.as_object().unwrap();
            assert_eq!(obj.len(), 3, "{fixture}: {text}");
            assert!(
                ["Paris", "Tokyo"].contains(&obj["city"].as_str().unwrap()),
                "{text}"
            );
            assert!(obj["sunny"].is_boolean(), "{text}");
            assert!(
                (-9..=9).contains(&obj["degrees"].as_i64().unwrap()),
                "{text}"
            );
        }
    }
}

#[test]
fn regexes_choices_grammars_and_json_objects_hold() {
    type Holds = Box<dyn Fn(&str) -> bool>;
    let cases: Vec<(OutputFormat, Holds)> = vec![
        (
            OutputFormat::Regex("[a-c]{3}-[0-9]{2}".into()),
            Box::new(|s: &str| {
                let b = s.as_bytes();
                s.len() == 6
                    && b[..3].iter().all(|c| (b'a'..=b'c').contains(c))
                    && b[3] == b'-'
                    && b[4..].iter().all(u8::is_ascii_digit)
            }),
        ),
        (
            OutputFormat::Choice(vec!["yes".into(), "no".into(), "a \"quoted\" maybe".into()]),
            Box::new(|s: &str| ["yes", "no", "a \"quoted\" maybe"].contains(&s)),
        ),
        (
            OutputFormat::Grammar("start: \"x\" (\"+\" \"x\")* \"=\" NUM\nNUM: /[0-9]/\n".into()),
            Box::new(|s: &str| s.starts_with('x') && s.contains('=') && s.len() >= 3),
        ),
        (
            OutputFormat::JsonObject,
            Box::new(|s: &str| serde_json::from_str::<Value>(s).is_ok_and(|v| v.is_object())),
        ),
    ];
    for (format, holds) in cases {
        let (t, stops, compiled) = compile("qwen3-moe", &format, Framing::Whole);
        for seed in 0..6 {
            let tokens = walk(&compiled.constraint(), &stops, seed);
            let text = t.decode(&tokens, true).unwrap();
            assert!(holds(&text), "{format:?}: {text:?}");
        }
    }
}

#[test]
fn harmony_framing_puts_the_constrained_text_in_the_final_channel() {
    let t = tokenizer("gpt-oss-bf16");
    let ret = t.token_to_id("<|return|>").unwrap();
    let stops = vec![ret];
    let grammars = OutputGrammars::new(t.vocab_size(), &stops);
    let compiled = grammars
        .compile(&t, &OutputFormat::JsonSchema(schema()), Framing::Harmony)
        .unwrap();
    let mut saw_analysis = false;
    for seed in 0..8 {
        let tokens = walk(&compiled.constraint(), &stops, seed);
        let text = t.decode(&tokens, false).unwrap();
        let (head, body) = text
            .rsplit_once("<|channel|>final<|message|>")
            .unwrap_or_else(|| panic!("no final channel in {text:?}"));
        assert!(
            head.is_empty() || head.starts_with("<|channel|>analysis<|message|>"),
            "{text:?}"
        );
        saw_analysis |= !head.is_empty();
        let json = body.strip_suffix("<|return|>").unwrap();
        let v: Value = serde_json::from_str(json).unwrap_or_else(|e| panic!("{json:?}: {e}"));
        assert_eq!(v.as_object().unwrap().len(), 3, "{text}");
    }
    assert!(saw_analysis, "no walk took the analysis channel first");
}

#[test]
fn bad_formats_are_400s_that_name_the_parameter() {
    let t = tokenizer("qwen3-moe");
    let grammars = OutputGrammars::new(t.vocab_size(), &t.eos_token_ids);
    let err = grammars
        .compile(&t, &OutputFormat::Regex("(unclosed".into()), Framing::Whole)
        .unwrap_err();
    assert!(
        matches!(&err, ApiError::BadRequest { param: Some(p), .. } if p == "structured_outputs.regex"),
        "{err:?}"
    );
    let err = grammars
        .compile(
            &t,
            &OutputFormat::JsonSchema(
                json!({"type": "object", "unevaluatedProperties": {"type": "string"}}),
            ),
            Framing::Whole,
        )
        .unwrap_err();
    let text = err.to_string();
    assert!(text.contains("unevaluatedProperties"), "{text}");

    let err = output_format(Some(&json!({"type": "xml"})), None).unwrap_err();
    assert!(err.to_string().contains("json_schema"), "{err}");
    let err = output_format(Some(&json!({"type": "json_schema"})), None).unwrap_err();
    assert!(
        matches!(&err, ApiError::BadRequest { param: Some(p), .. } if p == "response_format.json_schema.schema")
    );
    let err = output_format(None, Some(&json!({"regex": "a", "choice": ["b"]}))).unwrap_err();
    assert!(err.to_string().contains("exactly one"), "{err}");
    let err = output_format(None, Some(&json!({"xml": "a"}))).unwrap_err();
    assert!(err.to_string().contains("structured_outputs.xml"), "{err}");
    let err = output_format(
        Some(&json!({"type": "json_object"})),
        Some(&json!({"regex": "a"})),
    )
    .unwrap_err();
    assert!(err.to_string().contains("not both"), "{err}");
    assert_eq!(
        output_format(Some(&json!({"type": "text"})), None).unwrap(),
        None
    );
    assert_eq!(
        output_format(None, Some(&json!({"json": "{\"type\": \"integer\"}"}))).unwrap(),
        Some(OutputFormat::JsonSchema(json!({"type": "integer"})))
    );
}

/// Qwen3's forced tool calls may follow a thought, as its answers do: after a thought (opened
/// by the output, or by the prompt and closed by the output) or none, the output is Hermes
/// calls of the named function whose arguments hold to its parameters; text that is neither a
/// thought nor a call is refused. (The thought is fed as text: a random walk would not close it.)
#[test]
fn forced_qwen3_calls_may_think_first() {
    let t = tokenizer("qwen3-moe");
    let stops = t.eos_token_ids.clone();
    let grammars = OutputGrammars::new(t.vocab_size(), &stops);
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
                       "required": ["city"], "additionalProperties": false}}}]);
    let format = forced_calls(
        &tools,
        &crate::tools::ForcedCalls::Named("get_weather".into()),
        crate::tool_parsing::ToolCallParserKind::Hermes,
        false,
        &t,
    );
    let cases = [
        (false, "<think>Call it.</think>\n\n"),
        // No thought: the walk starts at the call's marker (a random one could open a thought).
        (false, "<tool_call>"),
        (true, "Call it.</think>\n"),
    ];
    for (opened, thought) in cases {
        let compiled = grammars
            .compile(&t, &format, Framing::Think { opened })
            .unwrap();
        for seed in 0..4 {
            let constraint = compiled.constraint();
            let mut tokens = t.encode(thought, false).unwrap();
            for &token in &tokens {
                constraint
                    .0
                    .accept(token)
                    .unwrap_or_else(|e| panic!("{thought:?}: {e}"));
            }
            tokens.extend(walk(&constraint, &stops, seed));
            let text = t.decode(&tokens[..tokens.len() - 1], false).unwrap();
            let after = text
                .split_once("</think>")
                .map_or(text.as_str(), |(_, rest)| rest);
            let call = after
                .trim_start_matches('\n')
                .strip_prefix("<tool_call>\n")
                .and_then(|c| c.strip_suffix("\n</tool_call>"))
                .unwrap_or_else(|| panic!("not one Hermes call after {thought:?}: {text:?}"));
            let v: Value = serde_json::from_str(call).unwrap_or_else(|e| panic!("{call:?}: {e}"));
            assert_eq!(v["name"], "get_weather");
            assert!(
                v["arguments"]["city"].as_str().unwrap().chars().count() <= 6,
                "{v}"
            );
        }
    }
    let compiled = grammars
        .compile(&t, &format, Framing::Think { opened: false })
        .unwrap();
    let plain = t.encode("Sure", false).unwrap();
    assert!(
        compiled.constraint().0.accept(plain[0]).is_err(),
        "text before the call that is not a thought"
    );
}
