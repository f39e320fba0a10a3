//! GPT-OSS's harmony format, as the model writes it after the prompt's `<|start|>assistant`:
//!
//! ```text
//! <|channel|>analysis<|message|>REASONING<|end|>
//! <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>
//! <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>
//! ```
//!
//! Each message is a header (up to `<|message|>`) and a body (up to `<|end|>`, `<|call|>` or
//! `<|return|>`). The header's channel and recipient decide where the body goes: `analysis`
//! is reasoning, a recipient `functions.NAME` is a tool call whose body is its arguments,
//! anything else (`final`, a `commentary` preamble, no channel) is content. Markers never
//! reach the output.

use super::markers::{emittable_len, find_marker};
use super::{ParseEvent, Stepwise};

const START: &str = "<|start|>";
const CHANNEL: &str = "<|channel|>";
const MESSAGE: &str = "<|message|>";
const CONSTRAIN: &str = "<|constrain|>";
const END: &str = "<|end|>";
const CALL: &str = "<|call|>";
const RETURN: &str = "<|return|>";

/// Every marker: none may leak into the output.
const ALL: [&str; 7] = [START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN];

/// How a header may begin. A header that begins otherwise is not harmony (a model, or a
/// template, that writes plain text), and its text is content.
const HEADER_OPENINGS: [&str; 5] = [CHANNEL, MESSAGE, CONSTRAIN, " to=", "assistant"];

/// Where a body goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Body {
    Reasoning,
    Content,
    ToolCall(usize),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Reading a header, up to `<|message|>`.
    Header,
    /// Inside a message's body.
    Body(Body),
    /// After a message's end, before the next `<|start|>`.
    Between,
}

/// The harmony parser of one output.
#[derive(Debug, Clone)]
pub struct HarmonyParser {
    state: State,
    /// Text not yet decided.
    buf: String,
    /// `analysis` is reasoning (else content).
    reasoning: bool,
    /// `to=functions.NAME` is a tool call (else its body is content).
    tools: bool,
    /// Tool calls started so far.
    calls: usize,
}

impl HarmonyParser {
    /// A parser of the output that follows `prompt`: a prompt that ends inside a message
    /// (`...<|message|>`, as templates that open the assistant's message do) starts in its
    /// body, as content; otherwise the output starts with a header.
    pub fn new(prompt: &str, reasoning: bool, tools: bool) -> Self {
        let state = if prompt.ends_with(MESSAGE) {
            State::Body(Body::Content)
        } else {
            State::Header
        };
        HarmonyParser {
            state,
            buf: String::new(),
            reasoning,
            tools,
            calls: 0,
        }
    }

    /// Where the body of a message with `header` goes.
    fn body_for(&mut self, header: &str) -> (Body, Option<ParseEvent>) {
        let fields = HeaderFields::parse(header);
        let function = fields
            .recipient
            .as_deref()
            .and_then(|r| r.strip_prefix("functions."));
        match function {
            Some(name) if self.tools => {
                let index = self.calls;
                self.calls += 1;
                let start = ParseEvent::ToolCallStart {
                    index,
                    name: name.to_string(),
                };
                return (Body::ToolCall(index), Some(start));
            }
            // Calls not parsed (`tool_choice: "none"`) are returned as text.
            Some(_) => return (Body::Content, None),
            None => {}
        }
        // Built-in tools' calls (`to=browser.search`, `to=python`) are the model's own work,
        // as its analysis is.
        let internal = fields.channel.as_deref() == Some("analysis") || fields.recipient.is_some();
        if internal && self.reasoning {
            (Body::Reasoning, None)
        } else {
            (Body::Content, None)
        }
    }

    fn emit(body: Body, text: &str, out: &mut Vec<ParseEvent>) {
        if text.is_empty() {
            return;
        }
        out.push(match body {
            Body::Reasoning => ParseEvent::Reasoning(text.to_string()),
            Body::Content => ParseEvent::Content(text.to_string()),
            Body::ToolCall(index) => ParseEvent::ToolCallArguments {
                index,
                text: text.to_string(),
            },
        });
    }

    /// Whether `header` can still be (the beginning of) a harmony header.
    fn plausible_header(header: &str) -> bool {
        HEADER_OPENINGS
            .iter()
            .any(|o| header.starts_with(o) || o.starts_with(header))
    }

    /// Advances over `buf` as far as it decides; returns false when more text is needed.
    fn step(&mut self, out: &mut Vec<ParseEvent>) -> bool {
        match self.state {
            State::Header => {
                if !Self::plausible_header(&self.buf) {
                    self.state = State::Body(Body::Content);
                    return true;
                }
                let Some(at) = self.buf.find(MESSAGE) else {
                    return false;
                };
                let header: String = self.buf.drain(..at + MESSAGE.len()).collect();
                let (body, start) = self.body_for(&header[..at]);
                out.extend(start);
                self.state = State::Body(body);
                true
            }
            State::Body(body) => match find_marker(&self.buf, &ALL) {
                Some((at, marker)) => {
                    Self::emit(body, &self.buf[..at], out);
                    self.buf.drain(..at + ALL[marker].len());
                    self.state = match ALL[marker] {
                        START => State::Header,
                        END | CALL | RETURN => State::Between,
                        // A stray header marker inside a body is dropped.
                        _ => State::Body(body),
                    };
                    true
                }
                None => {
                    let n = emittable_len(&self.buf, &ALL);
                    Self::emit(body, &self.buf[..n], out);
                    self.buf.drain(..n);
                    false
                }
            },
            State::Between => match find_marker(&self.buf, &[START, CHANNEL]) {
                Some((at, marker)) => {
                    // `<|channel|>` without `<|start|>assistant` opens a header too; it stays
                    // in the header, where it says the channel.
                    let drop_to = if marker == 0 { at + START.len() } else { at };
                    self.buf.drain(..drop_to);
                    self.state = State::Header;
                    true
                }
                None => {
                    // Text between messages belongs to none: only a partial marker is kept.
                    let n = emittable_len(&self.buf, &[START, CHANNEL]);
                    self.buf.drain(..n);
                    false
                }
            },
        }
    }
}

impl Stepwise for HarmonyParser {
    fn held(&mut self) -> &mut String {
        &mut self.buf
    }

    fn step(&mut self, out: &mut Vec<ParseEvent>) -> bool {
        HarmonyParser::step(self, out)
    }

    fn finish_held(&mut self, rest: String) -> Vec<ParseEvent> {
        let mut out = Vec::new();
        match self.state {
            // A partial marker at the end of a body was held back; it never completed, so it
            // is text (a whole marker was already consumed).
            State::Body(body) => Self::emit(body, &rest, &mut out),
            // An unfinished header or text between messages carries no answer.
            State::Header | State::Between => {}
        }
        out
    }
}

/// What a header says.
#[derive(Debug, Default, PartialEq, Eq)]
struct HeaderFields {
    channel: Option<String>,
    recipient: Option<String>,
}

impl HeaderFields {
    /// Reads `assistant<|channel|>commentary to=functions.f <|constrain|>json` and its
    /// variants (the recipient may also come before the channel).
    fn parse(header: &str) -> Self {
        // Markers separate words as spaces do.
        let mut spaced = header.to_string();
        for m in [CHANNEL, CONSTRAIN, START] {
            spaced = spaced.replace(m, &format!(" {m} "));
        }
        let words: Vec<&str> = spaced.split_whitespace().collect();
        let mut fields = HeaderFields::default();
        for (i, w) in words.iter().enumerate() {
            if *w == CHANNEL {
                fields.channel = words.get(i + 1).map(|c| c.to_string());
            } else if let Some(r) = w.strip_prefix("to=") {
                fields.recipient = Some(r.to_string());
            }
        }
        fields
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{parse_pieces, parse_whole};
    use super::super::{ParsedOutput, ParsedToolCall};
    use super::*;
    use proptest::prelude::*;

    const TOOL_TURN: &str = "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Paris\"}<|call|>";
    const ANSWER_TURN: &str = "<|channel|>analysis<|message|>Easy: 4.<|end|><|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>";

    fn parser() -> HarmonyParser {
        HarmonyParser::new(
            "<|start|>user<|message|>hi<|end|><|start|>assistant",
            true,
            true,
        )
    }

    #[test]
    fn analysis_is_reasoning_and_final_is_content() {
        let out = parse_whole(&mut parser(), ANSWER_TURN);
        assert_eq!(out.reasoning, "Easy: 4.");
        assert_eq!(out.content, "2 + 2 = 4.");
        assert!(out.tool_calls.is_empty());
    }

    #[test]
    fn a_commentary_message_to_a_function_is_a_tool_call() {
        let out = parse_whole(&mut parser(), TOOL_TURN);
        assert_eq!(out.reasoning, "Need the weather.");
        assert_eq!(out.content, "");
        assert_eq!(
            out.tool_calls,
            vec![ParsedToolCall {
                name: "get_weather".into(),
                arguments: "{\"city\":\"Paris\"}".into()
            }]
        );
    }

    #[test]
    fn the_recipient_may_come_before_the_channel_and_stop_tokens_may_be_missing() {
        // The stop token (<|call|>) is not decoded unless asked for: the body ends at the end.
        let text = "<|channel|>analysis<|message|>r<|end|><|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}";
        let out = parse_whole(&mut parser(), text);
        assert_eq!(out.tool_calls[0].name, "f");
        assert_eq!(out.tool_calls[0].arguments, "{}");
    }

    #[test]
    fn without_tools_or_reasoning_the_bodies_are_content() {
        let mut p = HarmonyParser::new("<|start|>assistant", false, false);
        let out = parse_whole(&mut p, TOOL_TURN);
        assert_eq!(out.reasoning, "");
        assert_eq!(out.content, "Need the weather.{\"city\":\"Paris\"}");
        assert!(out.tool_calls.is_empty());
        let mut p = HarmonyParser::new("<|start|>assistant", true, false);
        let out = parse_whole(&mut p, TOOL_TURN);
        assert_eq!(out.reasoning, "Need the weather.");
        assert_eq!(
            out.content, "{\"city\":\"Paris\"}",
            "calls not parsed are text"
        );
    }

    #[test]
    fn a_prompt_that_opens_the_message_starts_in_its_body() {
        let mut p = HarmonyParser::new("<|start|>assistant<|message|>", true, true);
        let out = parse_whole(&mut p, "Hello<|end|>");
        assert_eq!(out.content, "Hello");
    }

    #[test]
    fn plain_text_where_a_header_belongs_is_content() {
        let out = parse_whole(&mut parser(), "Hello there");
        assert_eq!(out.content, "Hello there");
        let out = parse_whole(&mut parser(), "<|channel|>analysis<|message|>cut short");
        assert_eq!(out.reasoning, "cut short", "a body cut by max_tokens");
        let out = parse_whole(&mut parser(), "<|channel|>analys");
        assert_eq!(
            out,
            ParsedOutput::default(),
            "an unfinished header says nothing"
        );
    }

    #[test]
    fn parallel_calls_get_their_own_indices() {
        let text = "<|channel|>commentary to=functions.a<|message|>{}<|call|><|start|>assistant<|channel|>commentary to=functions.b<|message|>{\"x\":1}<|call|>";
        let out = parse_whole(&mut parser(), text);
        let names: Vec<&str> = out.tool_calls.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
        assert_eq!(out.tool_calls[1].arguments, "{\"x\":1}");
    }

    #[test]
    fn header_fields() {
        let f = HeaderFields::parse(
            "assistant<|channel|>commentary to=functions.get_weather <|constrain|>json",
        );
        assert_eq!(f.channel.as_deref(), Some("commentary"));
        assert_eq!(f.recipient.as_deref(), Some("functions.get_weather"));
    }

    proptest! {
        /// However the output is cut into pieces, the result is the whole output's, and no
        /// marker ever leaks into content or reasoning.
        #[test]
        fn streaming_in_any_pieces_equals_parsing_whole(
            pick in 0usize..3,
            cuts in proptest::collection::vec(0usize..260, 0..12),
        ) {
            let text = [TOOL_TURN, ANSWER_TURN, "<|channel|>final<|message|>a <|x| b<|return|>"][pick];
            let whole = parse_whole(&mut parser(), text);
            let pieces = parse_pieces(&mut parser(), text, &cuts, &ALL);
            prop_assert_eq!(pieces, whole);
        }
    }
}
