//! Hermes-style tool calls (Qwen3): `<tool_call>{"name": NAME, "arguments": {...}}</tool_call>`,
//! one tag per call, anywhere in the content.
//!
//! When the call's JSON begins `{"name": "NAME", "arguments": ` (the order the models write),
//! the name is announced as soon as it is complete and the arguments stream as they come,
//! without the object's closing `}`. Otherwise the call is read whole at `</tool_call>`. A
//! call that is not valid JSON stays in the content as written.

use serde_json::Value;

use super::markers::{emittable_len, find_marker};
use super::{ParseEvent, Stepwise};

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// How far the head of a call's JSON has been read.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Head {
    /// Not yet known.
    Undecided,
    /// `{"name": NAME, "arguments": ` read: the arguments start at this byte of the body,
    /// and this many bytes of them are out.
    Streaming {
        index: usize,
        args_start: usize,
        emitted: usize,
    },
    /// Another layout: read whole at the end.
    Whole,
}

/// The Hermes parser of one output.
#[derive(Debug, Clone, Default)]
pub struct HermesParser {
    /// Content not yet decided, or the body of the call being read.
    buf: String,
    /// Inside `<tool_call>`, and how its head reads.
    in_call: Option<Head>,
    /// A call ended and only whitespace came since: whitespace between calls is dropped.
    after_call: bool,
    /// Calls found so far.
    calls: usize,
}

/// What the head of a call's body says so far.
enum HeadMatch {
    /// `{"name": NAME, "arguments": ` with the arguments starting at this byte.
    Found {
        name: String,
        args_start: usize,
    },
    NeedMore,
    Other,
}

/// Reads `{ "name" : "NAME" , "arguments" :` and the whitespace after it.
fn match_head(body: &str) -> HeadMatch {
    let mut rest = body;
    let expect = |token: &str, rest: &mut &str| -> Option<bool> {
        let t = rest.trim_start();
        if t.is_empty() {
            return None;
        }
        if let Some(after) = t.strip_prefix(token) {
            *rest = after;
            Some(true)
        } else if token.starts_with(t) {
            None
        } else {
            Some(false)
        }
    };
    for token in ["{", "\"name\"", ":", "\""] {
        match expect(token, &mut rest) {
            None => return HeadMatch::NeedMore,
            Some(false) => return HeadMatch::Other,
            Some(true) => {}
        }
    }
    // The name: plain characters up to the closing quote (an escape means another path).
    let Some(end) = rest.find(['"', '\\']) else {
        return HeadMatch::NeedMore;
    };
    if rest.as_bytes()[end] == b'\\' {
        return HeadMatch::Other;
    }
    let name = rest[..end].to_string();
    rest = &rest[end + 1..];
    for token in [",", "\"arguments\"", ":"] {
        match expect(token, &mut rest) {
            None => return HeadMatch::NeedMore,
            Some(false) => return HeadMatch::Other,
            Some(true) => {}
        }
    }
    let value = rest.trim_start();
    if value.is_empty() {
        return HeadMatch::NeedMore;
    }
    HeadMatch::Found {
        name,
        args_start: body.len() - value.len(),
    }
}

/// Where the arguments end in `args` (the text after `"arguments":`): before the object's
/// closing `}`, its surrounding whitespace and (while streaming) a partial `</tool_call>`.
fn args_end(args: &str, hold_partial_close: bool) -> usize {
    let mut s = args;
    if hold_partial_close {
        s = &s[..emittable_len(s, &[CLOSE])];
    }
    s = s.trim_end();
    s = s.strip_suffix('}').unwrap_or(s);
    s.trim_end().len()
}

impl HermesParser {
    /// A whole call's JSON as a name and arguments, when it is one.
    fn read_whole(body: &str) -> Option<(String, String)> {
        let v: Value = serde_json::from_str(body.trim()).ok()?;
        let name = v.get("name")?.as_str()?.to_string();
        let arguments = match v.get("arguments") {
            Some(Value::String(s)) => s.clone(),
            Some(other) => other.to_string(),
            None => "{}".to_string(),
        };
        Some((name, arguments))
    }

    /// Ends the current call with `body` (`closed`: its `</tool_call>` came).
    fn end_call(&mut self, head: Head, body: &str, closed: bool, out: &mut Vec<ParseEvent>) {
        match head {
            Head::Streaming {
                index,
                args_start,
                emitted,
            } => {
                let args = &body[args_start..];
                let end = args_end(args, false);
                if end > emitted {
                    out.push(ParseEvent::ToolCallArguments {
                        index,
                        text: args[emitted..end].to_string(),
                    });
                }
                self.after_call = true;
            }
            Head::Undecided | Head::Whole => match Self::read_whole(body) {
                Some((name, arguments)) => {
                    let index = self.calls;
                    self.calls += 1;
                    out.push(ParseEvent::ToolCallStart { index, name });
                    out.push(ParseEvent::ToolCallArguments {
                        index,
                        text: arguments,
                    });
                    self.after_call = true;
                }
                None => {
                    let close = if closed { CLOSE } else { "" };
                    out.push(ParseEvent::Content(format!("{OPEN}{body}{close}")));
                    self.after_call = false;
                }
            },
        }
    }

    fn step(&mut self, out: &mut Vec<ParseEvent>) -> bool {
        let Some(head) = self.in_call.clone() else {
            return self.step_content(out);
        };
        let close = find_marker(&self.buf, &[CLOSE]).map(|(at, _)| at);
        if head == Head::Undecided {
            // The head is read before the end, so that a call read in one piece goes the
            // same way as one read in many.
            let body = &self.buf[..close.unwrap_or(self.buf.len())];
            match match_head(body) {
                HeadMatch::Found { name, args_start } => {
                    let index = self.calls;
                    self.calls += 1;
                    out.push(ParseEvent::ToolCallStart { index, name });
                    self.in_call = Some(Head::Streaming {
                        index,
                        args_start,
                        emitted: 0,
                    });
                    return true;
                }
                HeadMatch::NeedMore if close.is_none() => return false,
                HeadMatch::NeedMore | HeadMatch::Other => {
                    self.in_call = Some(Head::Whole);
                    return true;
                }
            }
        }
        if let Some(at) = close {
            let body: String = self.buf.drain(..at + CLOSE.len()).collect();
            self.in_call = None;
            self.end_call(head, &body[..at], true, out);
            return true;
        }
        match head {
            Head::Streaming {
                index,
                args_start,
                emitted,
            } => {
                let args = &self.buf[args_start..];
                let end = args_end(args, true);
                if end > emitted {
                    out.push(ParseEvent::ToolCallArguments {
                        index,
                        text: args[emitted..end].to_string(),
                    });
                    self.in_call = Some(Head::Streaming {
                        index,
                        args_start,
                        emitted: end,
                    });
                }
                false
            }
            Head::Undecided | Head::Whole => false,
        }
    }

    fn step_content(&mut self, out: &mut Vec<ParseEvent>) -> bool {
        let (text_end, open) = match find_marker(&self.buf, &[OPEN]) {
            Some((at, _)) => (at, true),
            None => (emittable_len(&self.buf, &[OPEN]), false),
        };
        let text = &self.buf[..text_end];
        if self.after_call && text.trim().is_empty() {
            // Whitespace after a call: dropped before the next call, else held until it is
            // known whether more text follows.
            if !open {
                return false;
            }
        } else if !text.is_empty() {
            out.push(ParseEvent::Content(text.to_string()));
            self.after_call = false;
        }
        if open {
            self.buf.drain(..text_end + OPEN.len());
            self.in_call = Some(Head::Undecided);
            true
        } else {
            self.buf.drain(..text_end);
            false
        }
    }
}

impl Stepwise for HermesParser {
    fn held(&mut self) -> &mut String {
        &mut self.buf
    }

    fn step(&mut self, out: &mut Vec<ParseEvent>) -> bool {
        HermesParser::step(self, out)
    }

    fn finish_held(&mut self, rest: String) -> Vec<ParseEvent> {
        let mut out = Vec::new();
        match self.in_call.take() {
            // Cut off inside a call (max_tokens): what there is, is the call.
            Some(head) => self.end_call(head, &rest, false, &mut out),
            None if self.after_call && rest.trim().is_empty() => {}
            None if !rest.is_empty() => out.push(ParseEvent::Content(rest)),
            None => {}
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{parse_pieces, parse_whole};
    use super::super::{OutputParser, ParseEvent, ParsedToolCall};
    use super::*;
    use proptest::prelude::*;

    fn call(name: &str, arguments: &str) -> ParsedToolCall {
        ParsedToolCall {
            name: name.into(),
            arguments: arguments.into(),
        }
    }

    #[test]
    fn calls_are_parsed_and_whitespace_between_them_dropped() {
        let text = "Checking.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": [1, {\"y\": 2}]}}\n</tool_call>\n<tool_call>\n{\"arguments\": {}, \"name\": \"b\"}\n</tool_call>\n";
        let out = parse_whole(&mut HermesParser::default(), text);
        assert_eq!(out.content, "Checking.\n");
        assert_eq!(
            out.tool_calls,
            vec![call("a", "{\"x\": [1, {\"y\": 2}]}"), call("b", "{}")]
        );
    }

    #[test]
    fn the_name_comes_before_the_arguments_end() {
        let mut p = HermesParser::default();
        let events = p.push("<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"ci");
        assert_eq!(
            events,
            vec![
                ParseEvent::ToolCallStart {
                    index: 0,
                    name: "get_weather".into()
                },
                ParseEvent::ToolCallArguments {
                    index: 0,
                    text: "{\"ci".into()
                }
            ]
        );
        let events = p.push("ty\": \"Paris\"}}");
        assert_eq!(
            events,
            vec![ParseEvent::ToolCallArguments {
                index: 0,
                text: "ty\": \"Paris\"}".into()
            }],
            "the last brace might close the call: held back"
        );
    }

    #[test]
    fn invalid_calls_stay_content() {
        let out = parse_whole(
            &mut HermesParser::default(),
            "a<tool_call>{oops</tool_call>b",
        );
        assert_eq!(out.content, "a<tool_call>{oops</tool_call>b");
        assert!(out.tool_calls.is_empty());
    }

    #[test]
    fn a_call_cut_off_by_max_tokens_keeps_what_it_has() {
        let out = parse_whole(
            &mut HermesParser::default(),
            "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1",
        );
        assert_eq!(out.tool_calls, vec![call("f", "{\"a\": 1")]);
    }

    proptest! {
        /// However the output is cut, the result is the whole output's and no tag leaks.
        #[test]
        fn streaming_in_any_pieces_equals_parsing_whole(
            pre in "[a< \n]{0,6}",
            args in "\\{(\"k\": \"[a} ]{0,4}\")?\\}",
            ws in "[ \n]{0,3}",
            post in "[a \n]{0,4}",
            cuts in proptest::collection::vec(0usize..120, 0..10),
        ) {
            let text = format!("{pre}<tool_call>{{\"name\": \"f\", \"arguments\": {args}{ws}}}{ws}</tool_call>{post}");
            let whole = parse_whole(&mut HermesParser::default(), &text);
            prop_assert_eq!(&whole.tool_calls, &vec![call("f", &args)]);
            let pieces = parse_pieces(&mut HermesParser::default(), &text, &cuts, &[OPEN, CLOSE]);
            prop_assert_eq!(pieces, whole);
        }
    }
}
