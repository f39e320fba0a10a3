//! One choice's parser as an endpoint drives it: the events of each new piece of text (and of
//! the end) merged, the calls past the first dropped unless parallel calls are on, and the ids
//! its calls were given, so chat completions and `/v1/responses` name calls the same way.

use super::{OutputParser, ParseEvent, coalesce};

/// The reasoning and tool-call parser of one choice, and the ids its calls got.
pub struct ChoiceParser {
    parser: Box<dyn OutputParser>,
    /// Keep every call, or only the first (`parallel_tool_calls: false`).
    parallel: bool,
    call_ids: Vec<String>,
}

impl ChoiceParser {
    /// Drives `parser`, keeping every call when `parallel`, else only the first.
    pub fn new(parser: Box<dyn OutputParser>, parallel: bool) -> Self {
        ChoiceParser {
            parser,
            parallel,
            call_ids: Vec::new(),
        }
    }

    /// The events of the next text (and of the end, when `last`), merged, with the calls
    /// past the first dropped unless parallel calls are on.
    pub fn events(&mut self, text: &str, last: bool) -> Vec<ParseEvent> {
        let mut events = self.parser.push(text);
        if last {
            events.extend(self.parser.finish());
        }
        let parallel = self.parallel;
        events.retain(|e| match e {
            ParseEvent::ToolCallStart { index, .. }
            | ParseEvent::ToolCallArguments { index, .. } => parallel || *index == 0,
            ParseEvent::Reasoning(_) | ParseEvent::Content(_) => true,
        });
        coalesce(events)
    }

    /// The id of call `index` (`call_` and 24 hex digits), made when first asked for.
    pub fn call_id(&mut self, index: usize) -> String {
        while self.call_ids.len() <= index {
            self.call_ids
                .push(format!("call_{:024x}", rand::random::<u128>() >> 32));
        }
        self.call_ids[index].clone()
    }

    /// Whether the output called any tool (asked for an id).
    pub fn called_tools(&self) -> bool {
        !self.call_ids.is_empty()
    }

    /// The finish reason: `tool_calls` when a choice that stopped by itself called tools.
    pub fn finish_reason(&self, reason: &'static str) -> &'static str {
        if reason == "stop" && self.called_tools() {
            "tool_calls"
        } else {
            reason
        }
    }
}
