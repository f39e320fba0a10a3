//! Reasoning and tool calls parsed out of a chat completion's text, as vLLM's reasoning and
//! tool-call parsers do it.
//!
//! Pure and I/O-free: a parser takes the generated text in whatever pieces it arrives
//! ([`OutputParser::push`]) and returns [`ParseEvent`]s; [`OutputParser::finish`] releases what
//! it still holds when the sequence ends. The non-streaming path folds the events into a
//! [`ParsedOutput`]; the streaming path turns each batch into chunk deltas. Both see the same
//! events, so the concatenated deltas equal the non-streaming fields whatever the chunking.
//!
//! Formats, one file each: [`harmony`] (GPT-OSS: `analysis` is reasoning, `final` is content,
//! `commentary to=functions.NAME` is a tool call), [`qwen3`] (`<think>...</think>`), [`hermes`]
//! (`<tool_call>{"name", "arguments"}</tool_call>`, Qwen3's tool format), [`mistral`]
//! (`[TOOL_CALLS] [{"name", "arguments"}, ...]`). A reasoning stage and a tool stage chain:
//! the tool parser sees only the reasoning parser's content.

pub mod choice;
pub mod harmony;
pub mod hermes;
pub mod markers;
pub mod mistral;
pub mod qwen3;

use std::fmt;
use std::str::FromStr;

use model::Family;

pub use choice::ChoiceParser;

/// What a parser found in a piece of text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ParseEvent {
    /// Reasoning text (`reasoning_content`).
    Reasoning(String),
    /// Answer text (`content`).
    Content(String),
    /// A tool call begins: its index among this output's calls and the function's name.
    ToolCallStart {
        /// 0 for the first call of the output, then 1, ...
        index: usize,
        /// The function's name.
        name: String,
    },
    /// More of a tool call's arguments (JSON text, in pieces).
    ToolCallArguments {
        /// The call's index, as in its [`ParseEvent::ToolCallStart`].
        index: usize,
        /// The next piece of the arguments' JSON text.
        text: String,
    },
}

/// An incremental parser of one choice's output.
pub trait OutputParser: Send {
    /// Adds the next piece of text and returns what it decides (text that may be the start
    /// of a marker is held back until a later piece decides it).
    fn push(&mut self, text: &str) -> Vec<ParseEvent>;
    /// The output ended: returns whatever is still held back.
    fn finish(&mut self) -> Vec<ParseEvent>;
}

/// A parser that keeps its undecided text in one buffer and decides it from the front, a step
/// at a time; [`OutputParser`] for it appends each piece and steps until a step must wait.
pub trait Stepwise: Send {
    /// The text not decided yet.
    fn held(&mut self) -> &mut String;
    /// Decides what it can at the front of the held text; false when it must wait for more.
    fn step(&mut self, out: &mut Vec<ParseEvent>) -> bool;
    /// The output ended with `rest` (the held text, taken) undecided: what it still says.
    fn finish_held(&mut self, rest: String) -> Vec<ParseEvent>;
}

impl<T: Stepwise> OutputParser for T {
    fn push(&mut self, text: &str) -> Vec<ParseEvent> {
        self.held().push_str(text);
        let mut out = Vec::new();
        while self.step(&mut out) {}
        out
    }

    fn finish(&mut self) -> Vec<ParseEvent> {
        let rest = std::mem::take(self.held());
        self.finish_held(rest)
    }
}

/// `--tool-call-parser`: how tool calls are written in the model's output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolCallParserKind {
    /// GPT-OSS harmony: `<|channel|>commentary to=functions.NAME ... <|message|>ARGS<|call|>`.
    Openai,
    /// Hermes / Qwen3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
    Hermes,
    /// Mistral / Mixtral: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}]`.
    Mistral,
}

/// `--reasoning-parser`: how reasoning is written in the model's output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningParserKind {
    /// GPT-OSS harmony: the `analysis` channel.
    OpenaiGptoss,
    /// Qwen3: `<think>...</think>`.
    Qwen3,
    /// No reasoning parsing: reasoning stays in `content`.
    None,
}

/// A flag value that names no parser.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {what} `{given}`; expected one of: {expected}")]
pub struct UnknownParser {
    /// Which flag.
    pub what: &'static str,
    /// The value given.
    pub given: String,
    /// The names accepted.
    pub expected: &'static str,
}

impl ToolCallParserKind {
    /// The name on the command line (vLLM's).
    pub fn name(self) -> &'static str {
        match self {
            ToolCallParserKind::Openai => "openai",
            ToolCallParserKind::Hermes => "hermes",
            ToolCallParserKind::Mistral => "mistral",
        }
    }

    /// The parser a model family writes its tool calls for (vLLM's recommended one).
    pub fn for_family(family: Family) -> Self {
        match family {
            Family::GptOss => ToolCallParserKind::Openai,
            Family::Qwen3Moe => ToolCallParserKind::Hermes,
            Family::Mixtral => ToolCallParserKind::Mistral,
        }
    }
}

impl FromStr for ToolCallParserKind {
    type Err = UnknownParser;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "openai" => Ok(ToolCallParserKind::Openai),
            "hermes" => Ok(ToolCallParserKind::Hermes),
            "mistral" => Ok(ToolCallParserKind::Mistral),
            _ => Err(UnknownParser {
                what: "tool-call parser",
                given: s.to_string(),
                expected: "openai, hermes, mistral",
            }),
        }
    }
}

impl fmt::Display for ToolCallParserKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl ReasoningParserKind {
    /// The name on the command line (vLLM's).
    pub fn name(self) -> &'static str {
        match self {
            ReasoningParserKind::OpenaiGptoss => "openai_gptoss",
            ReasoningParserKind::Qwen3 => "qwen3",
            ReasoningParserKind::None => "none",
        }
    }

    /// The parser a model family writes its reasoning for (Mixtral does not reason).
    pub fn for_family(family: Family) -> Self {
        match family {
            Family::GptOss => ReasoningParserKind::OpenaiGptoss,
            Family::Qwen3Moe => ReasoningParserKind::Qwen3,
            Family::Mixtral => ReasoningParserKind::None,
        }
    }
}

impl FromStr for ReasoningParserKind {
    type Err = UnknownParser;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "openai_gptoss" => Ok(ReasoningParserKind::OpenaiGptoss),
            "qwen3" => Ok(ReasoningParserKind::Qwen3),
            "none" => Ok(ReasoningParserKind::None),
            _ => Err(UnknownParser {
                what: "reasoning parser",
                given: s.to_string(),
                expected: "openai_gptoss, qwen3, none",
            }),
        }
    }
}

impl fmt::Display for ReasoningParserKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Which parsers one request's output goes through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParserChoice {
    /// The reasoning parser.
    pub reasoning: ReasoningParserKind,
    /// The tool-call parser; `None` when the request's tool calls are not parsed
    /// (`tool_choice: "none"`, no tools, or auto tool choice off).
    pub tools: Option<ToolCallParserKind>,
}

impl ParserChoice {
    /// Whether the detokenizer must keep special tokens: harmony's markers and Mistral's
    /// `[TOOL_CALLS]` are special tokens, which the default `skip_special_tokens` would drop.
    pub fn needs_special_tokens(&self) -> bool {
        self.uses_harmony() || self.tools == Some(ToolCallParserKind::Mistral)
    }

    fn uses_harmony(&self) -> bool {
        self.reasoning == ReasoningParserKind::OpenaiGptoss
            || self.tools == Some(ToolCallParserKind::Openai)
    }

    /// The parser for an output that continues `prompt` (its end says where the model starts:
    /// inside a harmony message, inside `<think>`, ...); `None` when nothing is parsed.
    pub fn build(&self, prompt: &str) -> Option<Box<dyn OutputParser>> {
        let first: Option<Box<dyn OutputParser>> = if self.uses_harmony() {
            Some(Box::new(harmony::HarmonyParser::new(
                prompt,
                self.reasoning == ReasoningParserKind::OpenaiGptoss,
                self.tools == Some(ToolCallParserKind::Openai),
            )))
        } else if self.reasoning == ReasoningParserKind::Qwen3 {
            Some(Box::new(qwen3::ThinkParser::new(prompt)))
        } else {
            None
        };
        let second: Option<Box<dyn OutputParser>> = match self.tools {
            Some(ToolCallParserKind::Hermes) => Some(Box::new(hermes::HermesParser::default())),
            Some(ToolCallParserKind::Mistral) => Some(Box::new(mistral::MistralParser::default())),
            Some(ToolCallParserKind::Openai) | None => None,
        };
        match (first, second) {
            (Some(first), Some(second)) => Some(Box::new(Chain { first, second })),
            (first, second) => first.or(second),
        }
    }
}

/// A reasoning parser whose content goes on through a tool-call parser.
struct Chain {
    first: Box<dyn OutputParser>,
    second: Box<dyn OutputParser>,
}

impl Chain {
    fn forward(&mut self, events: Vec<ParseEvent>) -> Vec<ParseEvent> {
        let mut out = Vec::with_capacity(events.len());
        for event in events {
            match event {
                ParseEvent::Content(text) => out.extend(self.second.push(&text)),
                other => out.push(other),
            }
        }
        out
    }
}

impl OutputParser for Chain {
    fn push(&mut self, text: &str) -> Vec<ParseEvent> {
        let events = self.first.push(text);
        self.forward(events)
    }

    fn finish(&mut self) -> Vec<ParseEvent> {
        let events = self.first.finish();
        let mut out = self.forward(events);
        out.extend(self.second.finish());
        out
    }
}

/// One tool call, whole.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ParsedToolCall {
    /// The function's name.
    pub name: String,
    /// Its arguments, JSON text.
    pub arguments: String,
}

/// Everything a parser found in one output, folded from its events.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ParsedOutput {
    /// Reasoning text.
    pub reasoning: String,
    /// Answer text.
    pub content: String,
    /// Tool calls, in order.
    pub tool_calls: Vec<ParsedToolCall>,
}

impl ParsedOutput {
    /// Folds `event` in.
    pub fn apply(&mut self, event: &ParseEvent) {
        match event {
            ParseEvent::Reasoning(t) => self.reasoning.push_str(t),
            ParseEvent::Content(t) => self.content.push_str(t),
            ParseEvent::ToolCallStart { index, name } => {
                if self.tool_calls.len() <= *index {
                    self.tool_calls
                        .resize_with(index + 1, ParsedToolCall::default);
                }
                self.tool_calls[*index].name.clone_from(name);
            }
            ParseEvent::ToolCallArguments { index, text } => {
                if let Some(call) = self.tool_calls.get_mut(*index) {
                    call.arguments.push_str(text);
                }
            }
        }
    }
}

/// Merges neighbouring events of the same kind (and the same call), so that a streamed delta
/// carries one piece of each.
pub fn coalesce(events: Vec<ParseEvent>) -> Vec<ParseEvent> {
    let mut out: Vec<ParseEvent> = Vec::with_capacity(events.len());
    for event in events {
        let merged = match (out.last_mut(), &event) {
            (Some(ParseEvent::Reasoning(a)), ParseEvent::Reasoning(b))
            | (Some(ParseEvent::Content(a)), ParseEvent::Content(b)) => {
                a.push_str(b);
                true
            }
            (
                Some(ParseEvent::ToolCallArguments { index: i, text: a }),
                ParseEvent::ToolCallArguments { index: j, text: b },
            ) if i == j => {
                a.push_str(b);
                true
            }
            _ => false,
        };
        if !merged {
            out.push(event);
        }
    }
    out.retain(|e| match e {
        ParseEvent::Reasoning(t) | ParseEvent::Content(t) => !t.is_empty(),
        ParseEvent::ToolCallArguments { text, .. } => !text.is_empty(),
        ParseEvent::ToolCallStart { .. } => true,
    });
    out
}

#[cfg(test)]
pub(crate) mod test_support {
    //! Helpers the parsers' tests share: run an output whole or cut into pieces.
    use super::*;

    /// Parses `text` in one piece.
    pub fn parse_whole(parser: &mut dyn OutputParser, text: &str) -> ParsedOutput {
        let mut out = ParsedOutput::default();
        for e in parser.push(text).iter().chain(parser.finish().iter()) {
            out.apply(e);
        }
        out
    }

    /// Parses `text` cut at the character positions `cuts`, also checking that no streamed
    /// content or reasoning piece holds a marker from `forbidden`.
    pub fn parse_pieces(
        parser: &mut dyn OutputParser,
        text: &str,
        cuts: &[usize],
        forbidden: &[&str],
    ) -> ParsedOutput {
        let chars: Vec<char> = text.chars().collect();
        let mut bounds: Vec<usize> = cuts.iter().map(|&c| c.min(chars.len())).collect();
        bounds.push(0);
        bounds.push(chars.len());
        bounds.sort_unstable();
        bounds.dedup();
        let mut out = ParsedOutput::default();
        let mut events = Vec::new();
        for w in bounds.windows(2) {
            let piece: String = chars[w[0]..w[1]].iter().collect();
            events.extend(parser.push(&piece));
        }
        events.extend(parser.finish());
        for e in &events {
            if let ParseEvent::Content(t) | ParseEvent::Reasoning(t) = e {
                for m in forbidden {
                    assert!(!t.contains(m), "{m} leaked in {e:?}");
                }
            }
            out.apply(e);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_parse_by_vllm_names() {
        assert_eq!("hermes".parse(), Ok(ToolCallParserKind::Hermes));
        assert_eq!(
            "openai_gptoss".parse(),
            Ok(ReasoningParserKind::OpenaiGptoss)
        );
        let err = "qwen".parse::<ReasoningParserKind>().unwrap_err();
        assert!(
            err.to_string().contains("openai_gptoss, qwen3, none"),
            "{err}"
        );
        for k in [ToolCallParserKind::Openai, ToolCallParserKind::Mistral] {
            assert_eq!(k.name().parse(), Ok(k));
        }
    }

    #[test]
    fn defaults_follow_the_model_family() {
        assert_eq!(
            ToolCallParserKind::for_family(Family::Qwen3Moe),
            ToolCallParserKind::Hermes
        );
        assert_eq!(
            ReasoningParserKind::for_family(Family::Mixtral),
            ReasoningParserKind::None
        );
    }

    #[test]
    fn qwen3_reasoning_chains_into_hermes_tool_calls() {
        let choice = ParserChoice {
            reasoning: ReasoningParserKind::Qwen3,
            tools: Some(ToolCallParserKind::Hermes),
        };
        assert!(!choice.needs_special_tokens());
        let mut p = choice.build("<|im_start|>assistant\n").unwrap();
        let text = "<think>check the weather</think>\n\nLet me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let out = test_support::parse_whole(p.as_mut(), text);
        assert_eq!(out.reasoning, "check the weather");
        assert_eq!(out.content, "\n\nLet me look.\n");
        assert_eq!(
            out.tool_calls,
            vec![ParsedToolCall {
                name: "get_weather".into(),
                arguments: "{\"city\": \"Paris\"}".into()
            }]
        );
    }

    #[test]
    fn nothing_to_parse_builds_no_parser() {
        let choice = ParserChoice {
            reasoning: ReasoningParserKind::None,
            tools: None,
        };
        assert!(choice.build("").is_none());
        let mistral = ParserChoice {
            reasoning: ReasoningParserKind::None,
            tools: Some(ToolCallParserKind::Mistral),
        };
        assert!(mistral.needs_special_tokens());
    }

    #[test]
    fn coalescing_merges_neighbours_and_drops_empty_text() {
        let events = vec![
            ParseEvent::Content("a".into()),
            ParseEvent::Content("b".into()),
            ParseEvent::Reasoning(String::new()),
            ParseEvent::ToolCallStart {
                index: 0,
                name: "f".into(),
            },
            ParseEvent::ToolCallArguments {
                index: 0,
                text: "{".into(),
            },
            ParseEvent::ToolCallArguments {
                index: 0,
                text: "}".into(),
            },
        ];
        assert_eq!(
            coalesce(events),
            vec![
                ParseEvent::Content("ab".into()),
                ParseEvent::ToolCallStart {
                    index: 0,
                    name: "f".into()
                },
                ParseEvent::ToolCallArguments {
                    index: 0,
                    text: "{}".into()
                },
            ]
        );
    }
}
