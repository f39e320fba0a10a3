//! Qwen3's reasoning: `<think>REASONING</think>ANSWER`.
//!
//! The model opens `<think>` itself, or the prompt already did (templates that start the
//! assistant's turn thinking); then the output is reasoning up to `</think>`. An output that
//! does not begin with `<think>` is all content (thinking off).

use super::markers::{emittable_len, find_marker};
use super::{ParseEvent, Stepwise};

const THINK: &str = "<think>";
const END_THINK: &str = "</think>";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Before the first text: is it `<think>`?
    Opening,
    /// Inside `<think>`.
    Thinking,
    /// After `</think>`, or thinking off: the rest is content.
    Answer,
}

/// The `<think>` parser of one output.
#[derive(Debug, Clone)]
pub struct ThinkParser {
    state: State,
    buf: String,
}

impl ThinkParser {
    /// A parser of the output that follows `prompt` (thinking already when the prompt ends
    /// with `<think>`).
    pub fn new(prompt: &str) -> Self {
        let state = if prompt.trim_end().ends_with(THINK) {
            State::Thinking
        } else {
            State::Opening
        };
        ThinkParser {
            state,
            buf: String::new(),
        }
    }

    fn step(&mut self, out: &mut Vec<ParseEvent>) -> bool {
        match self.state {
            State::Opening => {
                // Leading whitespace before `<think>` is the model's and says nothing.
                let trimmed = self.buf.trim_start();
                if trimmed.starts_with(THINK) {
                    let skip = self.buf.len() - trimmed.len() + THINK.len();
                    self.buf.drain(..skip);
                    self.state = State::Thinking;
                    true
                } else if THINK.starts_with(trimmed) {
                    false
                } else {
                    self.state = State::Answer;
                    true
                }
            }
            State::Thinking => match find_marker(&self.buf, &[END_THINK]) {
                Some((at, _)) => {
                    push_text(out, ParseEvent::Reasoning(self.buf[..at].to_string()));
                    self.buf.drain(..at + END_THINK.len());
                    self.state = State::Answer;
                    true
                }
                None => {
                    let n = emittable_len(&self.buf, &[END_THINK]);
                    push_text(out, ParseEvent::Reasoning(self.buf[..n].to_string()));
                    self.buf.drain(..n);
                    false
                }
            },
            State::Answer => {
                push_text(out, ParseEvent::Content(std::mem::take(&mut self.buf)));
                false
            }
        }
    }
}

fn push_text(out: &mut Vec<ParseEvent>, event: ParseEvent) {
    if let ParseEvent::Reasoning(t) | ParseEvent::Content(t) = &event
        && t.is_empty()
    {
        return;
    }
    out.push(event);
}

impl Stepwise for ThinkParser {
    fn held(&mut self) -> &mut String {
        &mut self.buf
    }

    fn step(&mut self, out: &mut Vec<ParseEvent>) -> bool {
        ThinkParser::step(self, out)
    }

    fn finish_held(&mut self, rest: String) -> Vec<ParseEvent> {
        let mut out = Vec::new();
        match self.state {
            // Cut off while thinking (max_tokens): what there is, is reasoning.
            State::Thinking => push_text(&mut out, ParseEvent::Reasoning(rest)),
            State::Opening | State::Answer => push_text(&mut out, ParseEvent::Content(rest)),
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{parse_pieces, parse_whole};
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn think_is_reasoning_and_the_rest_content() {
        let out = parse_whole(&mut ThinkParser::new(""), "<think>\nhmm\n</think>\n\nHi!");
        assert_eq!(out.reasoning, "\nhmm\n");
        assert_eq!(out.content, "\n\nHi!");
    }

    #[test]
    fn a_prompt_that_opens_think_starts_in_reasoning() {
        let out = parse_whole(
            &mut ThinkParser::new("assistant\n<think>\n"),
            "hmm</think>Hi",
        );
        assert_eq!(out.reasoning, "hmm");
        assert_eq!(out.content, "Hi");
    }

    #[test]
    fn without_think_everything_is_content() {
        let out = parse_whole(&mut ThinkParser::new(""), "<thought>x</think>");
        assert_eq!(out.reasoning, "");
        assert_eq!(out.content, "<thought>x</think>");
        let out = parse_whole(&mut ThinkParser::new(""), "<thi");
        assert_eq!(out.content, "<thi", "an unfinished opening is text");
    }

    proptest! {
        #[test]
        fn streaming_in_any_pieces_equals_parsing_whole(
            text in "(<think>)?[a<>/ \n]{0,12}(</think>)?[a<>/ ]{0,12}",
            cuts in proptest::collection::vec(0usize..40, 0..8),
        ) {
            let whole = parse_whole(&mut ThinkParser::new(""), &text);
            let pieces = parse_pieces(&mut ThinkParser::new(""), &text, &cuts, &[]);
            prop_assert_eq!(&pieces, &whole);
            prop_assert!(!whole.reasoning.contains(END_THINK), "{:?}", whole);
        }
    }
}
