//! `tool_choice` `"required"` and a named function as grammars: the calls written in the
//! model's own format (harmony's `commentary to=functions.NAME`, Hermes' `<tool_call>`,
//! Mistral's `[TOOL_CALLS]`), each call's arguments held to its function's `parameters`, so
//! the usual tool-call parser reads them, streamed as any other call.

use model::ModelTokenizer;
use serde_json::{Value, json};

use super::{HARMONY_ANALYSIS, OutputFormat, compact};
use crate::tool_parsing::ToolCallParserKind;
use crate::tools::ForcedCalls;

/// The grammar of the calls `forced` asks for among `tools` (a checked chat `tools` list), in
/// `kind`'s format; several calls only where the format and `parallel` allow.
pub fn forced_calls(
    tools: &Value,
    forced: &ForcedCalls,
    kind: ToolCallParserKind,
    parallel: bool,
    tokenizer: &ModelTokenizer,
) -> OutputFormat {
    let functions: Vec<(String, Value)> = tools
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| {
            let f = t.get("function")?;
            let name = f.get("name")?.as_str()?.to_string();
            let params = f
                .get("parameters")
                .filter(|p| p.is_object() && p.as_object().is_some_and(|o| !o.is_empty()))
                .cloned()
                .unwrap_or_else(|| json!({"type": "object"}));
            Some((name, params))
        })
        .filter(|(name, _)| match forced {
            ForcedCalls::Any => true,
            ForcedCalls::Named(n) => n == name,
        })
        .collect();
    let call_object = |(name, params): &(String, Value)| {
        compact(&json!({
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": params},
            "required": ["name", "arguments"],
            "additionalProperties": false,
        }))
    };
    let lark = match kind {
        ToolCallParserKind::Openai => {
            let calls: Vec<String> = functions
                .iter()
                .map(|(name, params)| {
                    format!(
                        "{} \" \" <|constrain|> \"json\" <|message|> %json {}",
                        Value::String(name.clone()),
                        compact(params)
                    )
                })
                .collect();
            // One call a turn: `<|call|>` ends the output.
            format!(
                "start: analysis? <|channel|> \"commentary to=functions.\" call <|call|>\n\
                 call: {}\n{HARMONY_ANALYSIS}",
                calls.join(" | ")
            )
        }
        ToolCallParserKind::Hermes => {
            let calls: Vec<String> = functions
                .iter()
                .map(|f| format!("%json {}", call_object(f)))
                .collect();
            let open = marker(tokenizer, "<tool_call>");
            let close = marker(tokenizer, "</tool_call>");
            let more = if parallel { " (\"\\n\" block)*" } else { "" };
            format!(
                "start: block{more}\nblock: {open} \"\\n\" call \"\\n\" {close}\ncall: {}\n",
                calls.join(" | ")
            )
        }
        ToolCallParserKind::Mistral => {
            let mut array = json!({
                "type": "array",
                "items": {"anyOf": functions.iter().map(call_object).collect::<Vec<_>>()},
                "minItems": 1,
            });
            if !parallel {
                array["maxItems"] = json!(1);
            }
            format!(
                "start: {} %json {}\n",
                marker(tokenizer, "[TOOL_CALLS]"),
                compact(&array)
            )
        }
    };
    OutputFormat::ToolCalls(lark)
}

/// A format marker in Lark: its special token by id where the vocabulary has it as one (so the
/// parser sees the token it looks for), else the text.
fn marker(tokenizer: &ModelTokenizer, text: &str) -> String {
    let special = tokenizer.token_to_id(text).filter(|id| {
        tokenizer
            .inner()
            .get_added_tokens_decoder()
            .get(id)
            .is_some_and(|t| t.special)
    });
    match special {
        Some(id) => format!("<[{id}]>"),
        None => Value::String(text.to_string()).to_string(),
    }
}
