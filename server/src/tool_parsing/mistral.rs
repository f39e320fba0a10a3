//! Mistral-style tool calls (Mixtral): `[TOOL_CALLS] [{"name": NAME, "arguments": {...}}, ...]`.
//!
//! Text before `[TOOL_CALLS]` is content; after it comes one JSON array (or object) of calls
//! that runs to the end of the output, so the calls are read whole when the output ends (in a
//! stream, they come in its last chunk). An array that is not valid JSON is returned as
//! content.

use serde_json::Value;

use super::markers::{emittable_len, find_marker};
use super::{OutputParser, ParseEvent};

const MARKER: &str = "[TOOL_CALLS]";

/// The Mistral parser of one output.
#[derive(Debug, Clone, Default)]
pub struct MistralParser {
    buf: String,
    /// `[TOOL_CALLS]` came: the rest is the calls.
    in_calls: bool,
}

/// The calls in `text`, when it is a JSON array (or one object) of `{name, arguments}`.
fn read_calls(text: &str) -> Option<Vec<(String, String)>> {
    let v: Value = serde_json::from_str(text.trim()).ok()?;
    let items = match v {
        Value::Array(items) => items,
        object @ Value::Object(_) => vec![object],
        _ => return None,
    };
    items
        .iter()
        .map(|item| {
            let name = item.get("name")?.as_str()?.to_string();
            let arguments = match item.get("arguments") {
                Some(Value::String(s)) => s.clone(),
                Some(other) => other.to_string(),
                None => "{}".to_string(),
            };
            Some((name, arguments))
        })
        .collect()
}

impl OutputParser for MistralParser {
    fn push(&mut self, text: &str) -> Vec<ParseEvent> {
        self.buf.push_str(text);
        if self.in_calls {
            return Vec::new();
        }
        let mut out = Vec::new();
        let end = match find_marker(&self.buf, &[MARKER]) {
            Some((at, _)) => {
                self.in_calls = true;
                at
            }
            None => emittable_len(&self.buf, &[MARKER]),
        };
        if end > 0 {
            out.push(ParseEvent::Content(self.buf[..end].to_string()));
        }
        let consumed = if self.in_calls {
            end + MARKER.len()
        } else {
            end
        };
        self.buf.drain(..consumed);
        out
    }

    fn finish(&mut self) -> Vec<ParseEvent> {
        let rest = std::mem::take(&mut self.buf);
        if !self.in_calls {
            return if rest.is_empty() {
                Vec::new()
            } else {
                vec![ParseEvent::Content(rest)]
            };
        }
        match read_calls(&rest) {
            Some(calls) => calls
                .into_iter()
                .enumerate()
                .flat_map(|(index, (name, arguments))| {
                    [
                        ParseEvent::ToolCallStart { index, name },
                        ParseEvent::ToolCallArguments {
                            index,
                            text: arguments,
                        },
                    ]
                })
                .collect(),
            None => vec![ParseEvent::Content(rest)],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::ParsedToolCall;
    use super::super::test_support::{parse_pieces, parse_whole};
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_array_after_the_marker_is_the_calls() {
        let text = "Sure. [TOOL_CALLS] [{\"name\": \"a\", \"arguments\": {\"x\": 1}}, {\"name\": \"b\", \"arguments\": \"{}\"}]";
        let out = parse_whole(&mut MistralParser::default(), text);
        assert_eq!(out.content, "Sure. ");
        assert_eq!(
            out.tool_calls,
            vec![
                ParsedToolCall {
                    name: "a".into(),
                    arguments: "{\"x\":1}".into()
                },
                ParsedToolCall {
                    name: "b".into(),
                    arguments: "{}".into()
                }
            ]
        );
    }

    #[test]
    fn invalid_calls_are_content_and_plain_text_passes() {
        let out = parse_whole(&mut MistralParser::default(), "[TOOL_CALLS] [{\"nam");
        assert_eq!(out.content, " [{\"nam");
        assert!(out.tool_calls.is_empty());
        let out = parse_whole(&mut MistralParser::default(), "[TOOL] x");
        assert_eq!(out.content, "[TOOL] x");
    }

    proptest! {
        #[test]
        fn streaming_in_any_pieces_equals_parsing_whole(
            pre in "[a\\[ ]{0,8}",
            cuts in proptest::collection::vec(0usize..80, 0..8),
        ) {
            let text = format!("{pre}[TOOL_CALLS] [{{\"name\": \"f\", \"arguments\": {{\"q\": \"[x]\"}}}}]");
            let whole = parse_whole(&mut MistralParser::default(), &text);
            prop_assert_eq!(whole.tool_calls.len(), 1);
            prop_assert_eq!(&whole.content, &pre);
            let pieces = parse_pieces(&mut MistralParser::default(), &text, &cuts, &[MARKER]);
            prop_assert_eq!(pieces, whole);
        }
    }
}
