//! The request side of tool calling: `tools`, `tool_choice` and `parallel_tool_calls` checked
//! against what the server parses, and the tool turns of a conversation (assistant messages
//! with `tool_calls`, `tool` messages with their results) checked and shaped for the prompt.

use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::tool_parsing::{ParserChoice, ReasoningParserKind, ToolCallParserKind};

/// The server's tool-call and reasoning settings, resolved against the model's type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ToolParsing {
    /// `--enable-auto-tool-choice`: `tool_choice: "auto"` parses tool calls out of the output.
    pub auto_tool_choice: bool,
    /// The tool-call format (`--tool-call-parser`, else the model type's).
    pub tool_call_parser: Option<ToolCallParserKind>,
    /// The reasoning format (`--reasoning-parser`, else the model type's).
    pub reasoning_parser: ReasoningParserKind,
}

/// What a request asks of tool calling, once checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolUse {
    /// Which parsers its output goes through.
    pub parsers: ParserChoice,
    /// Keep every call (`parallel_tool_calls`, default true) or only the first.
    pub parallel: bool,
    /// The calls the output must make (`tool_choice` `"required"` or a named function),
    /// enforced by a grammar in the model's own call format.
    pub forced: Option<ForcedCalls>,
}

/// Tool calls a request requires.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ForcedCalls {
    /// At least one call, of any of the tools (`"required"`).
    Any,
    /// A call of this function.
    Named(String),
}

/// Checks `tools`, `tool_choice` and `parallel_tool_calls` (as vLLM does) and says how the
/// output is parsed.
pub fn resolve_tool_use(
    tools: Option<&Value>,
    tool_choice: Option<&Value>,
    parallel_tool_calls: Option<bool>,
    server: &ToolParsing,
) -> Result<ToolUse, ApiError> {
    let names = check_tools(tools)?;
    let mut forced = None;
    let choice = match tool_choice {
        None | Some(Value::Null) if names.is_empty() => "none",
        None | Some(Value::Null) => "auto",
        Some(Value::String(s)) if s == "none" || s == "auto" => s.as_str(),
        Some(Value::String(s)) if s == "required" => {
            forced = Some(ForcedCalls::Any);
            "required"
        }
        Some(Value::Object(o)) if o.get("type").and_then(Value::as_str) == Some("function") => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    ApiError::bad_param(
                        "tool_choice",
                        "a named tool_choice is {\"type\": \"function\", \"function\": \
                         {\"name\": ...}}.",
                    )
                })?;
            if !names.iter().any(|n| n == name) {
                return Err(ApiError::bad_param(
                    "tool_choice",
                    format!("tool_choice names `{name}`, which is not among the tools."),
                ));
            }
            forced = Some(ForcedCalls::Named(name.to_string()));
            "required"
        }
        Some(other) => {
            return Err(ApiError::bad_param(
                "tool_choice",
                format!(
                    "tool_choice must be \"none\", \"auto\", \"required\" or \
                     {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}; got {other}."
                ),
            ));
        }
    };
    if (choice == "auto" || choice == "required") && names.is_empty() {
        return Err(ApiError::bad_param(
            "tool_choice",
            format!(
                "tool_choice {} needs tools: send the functions the model may call in \
                 `tools`, or leave tool_choice out.",
                tool_choice.map_or("\"auto\"".to_string(), Value::to_string)
            ),
        ));
    }
    let tools = match (choice, server.tool_call_parser) {
        ("auto", Some(parser)) if server.auto_tool_choice => Some(parser),
        // A required call is written by a grammar in the parser's format: no flag needed.
        ("required", Some(parser)) => Some(parser),
        ("required", None) => {
            return Err(ApiError::bad_param(
                "tool_choice",
                "a required or named tool_choice needs --tool-call-parser: the model's type \
                 has no default call format.",
            ));
        }
        ("auto", _) => {
            return Err(ApiError::bad_param(
                "tool_choice",
                "\"auto\" tool choice requires the server to be started with \
                 --enable-auto-tool-choice (and --tool-call-parser when the model's type has \
                 no default); send tool_choice \"none\" to get the model's output as text.",
            ));
        }
        _ => None,
    };
    Ok(ToolUse {
        parsers: ParserChoice {
            reasoning: server.reasoning_parser,
            tools,
        },
        parallel: parallel_tool_calls.unwrap_or(true),
        forced,
    })
}

/// The functions' names, checking each tool is `{"type": "function", "function": {"name"}}`.
fn check_tools(tools: Option<&Value>) -> Result<Vec<String>, ApiError> {
    let list = match tools {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(list)) => list,
        Some(_) => return Err(ApiError::bad_param("tools", "tools must be a list.")),
    };
    list.iter()
        .enumerate()
        .map(|(i, tool)| {
            if tool.get("type").and_then(Value::as_str) != Some("function") {
                return Err(ApiError::bad_param(
                    "tools",
                    format!("tools[{i}].type must be \"function\" (the only kind of tool)."),
                ));
            }
            tool.get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|n| !n.is_empty())
                .map(str::to_string)
                .ok_or_else(|| {
                    ApiError::bad_param(
                        "tools",
                        format!("tools[{i}].function.name must be a non-empty string."),
                    )
                })
        })
        .collect()
}

/// Checks the tool turns of normalized `messages` and shapes them for a chat template, as
/// vLLM does: each call's `function.arguments` (JSON text on the wire) becomes the object it
/// encodes, which templates render with `tojson`. `tool` messages need their `tool_call_id`.
pub fn prepare_tool_turns(messages: &mut [Value]) -> Result<(), ApiError> {
    for (i, m) in messages.iter_mut().enumerate() {
        let Some(obj) = m.as_object_mut() else {
            continue;
        };
        let role = obj
            .get("role")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        if role == "tool" && !obj.get("tool_call_id").is_some_and(Value::is_string) {
            return Err(ApiError::bad_param(
                "messages",
                format!(
                    "messages[{i}] has role \"tool\" but no tool_call_id: give the id of the \
                     assistant's tool call it answers."
                ),
            ));
        }
        match obj.get_mut("tool_calls") {
            None | Some(Value::Null) => {}
            Some(Value::Array(calls)) => {
                if role != "assistant" {
                    return Err(ApiError::bad_param(
                        "messages",
                        format!("messages[{i}] has tool_calls but only assistant messages may."),
                    ));
                }
                for (j, call) in calls.iter_mut().enumerate() {
                    prepare_call(call).map_err(|what| {
                        ApiError::bad_param(
                            "messages",
                            format!("messages[{i}].tool_calls[{j}]: {what}"),
                        )
                    })?;
                }
            }
            Some(_) => {
                return Err(ApiError::bad_param(
                    "messages",
                    format!("messages[{i}].tool_calls must be a list."),
                ));
            }
        }
    }
    Ok(())
}

/// Checks one call and replaces its JSON-text arguments with the object.
fn prepare_call(call: &mut Value) -> Result<(), String> {
    let function = call
        .get_mut("function")
        .and_then(Value::as_object_mut)
        .ok_or("needs a `function` object with `name` and `arguments`.")?;
    if !function.get("name").is_some_and(Value::is_string) {
        return Err("function.name must be a string.".into());
    }
    if let Some(Value::String(text)) = function.get("arguments") {
        let parsed: Value = serde_json::from_str(text).map_err(|e| {
            format!("function.arguments must be JSON text (as the model returned it): {e}.")
        })?;
        function.insert("arguments".into(), parsed);
    }
    Ok(())
}

/// Whether a conversation uses tools: tool definitions, calls or results.
pub fn uses_tools(messages: &[Value], extra: &Map<String, Value>) -> bool {
    extra
        .get("tools")
        .is_some_and(|t| t.as_array().is_some_and(|a| !a.is_empty()))
        || messages.iter().any(|m| {
            m.get("role").and_then(Value::as_str) == Some("tool")
                || m.get("tool_calls")
                    .is_some_and(|c| c.as_array().is_some_and(|a| !a.is_empty()))
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn server(auto: bool) -> ToolParsing {
        ToolParsing {
            auto_tool_choice: auto,
            tool_call_parser: Some(ToolCallParserKind::Openai),
            reasoning_parser: ReasoningParserKind::OpenaiGptoss,
        }
    }

    fn tools() -> Value {
        json!([{"type": "function", "function": {"name": "get_weather", "parameters": {}}}])
    }

    #[test]
    fn auto_is_the_default_with_tools_and_needs_the_flag() {
        let t = tools();
        let u = resolve_tool_use(Some(&t), None, None, &server(true)).unwrap();
        assert_eq!(u.parsers.tools, Some(ToolCallParserKind::Openai));
        assert!(u.parallel);
        let err = resolve_tool_use(Some(&t), None, None, &server(false)).unwrap_err();
        assert!(
            err.to_string().contains("--enable-auto-tool-choice"),
            "{err}"
        );
        let none = json!("none");
        let u = resolve_tool_use(Some(&t), Some(&none), Some(false), &server(false)).unwrap();
        assert_eq!(u.parsers.tools, None, "none: output returned as content");
        assert!(!u.parallel);
    }

    #[test]
    fn required_and_named_choices_force_calls_without_the_auto_flag() {
        let t = tools();
        let required = json!("required");
        let u = resolve_tool_use(Some(&t), Some(&required), None, &server(false)).unwrap();
        assert_eq!(u.forced, Some(ForcedCalls::Any));
        assert_eq!(u.parsers.tools, Some(ToolCallParserKind::Openai));
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        let u = resolve_tool_use(Some(&t), Some(&named), None, &server(false)).unwrap();
        assert_eq!(u.forced, Some(ForcedCalls::Named("get_weather".into())));
        let unknown = json!({"type": "function", "function": {"name": "get_time"}});
        let err = resolve_tool_use(Some(&t), Some(&unknown), None, &server(true)).unwrap_err();
        assert!(err.to_string().contains("not among the tools"), "{err}");
        let err = resolve_tool_use(None, Some(&required), None, &server(true)).unwrap_err();
        assert!(err.to_string().contains("needs tools"), "{err}");
        let bad = json!("sometimes");
        assert!(resolve_tool_use(Some(&t), Some(&bad), None, &server(true)).is_err());
        let auto = json!("auto");
        let err = resolve_tool_use(None, Some(&auto), None, &server(true)).unwrap_err();
        assert!(err.to_string().contains("needs tools"), "{err}");
    }

    #[test]
    fn malformed_tools_are_refused() {
        for t in [
            json!({"x": 1}),
            json!([{"type": "code"}]),
            json!([{"type": "function", "function": {}}]),
        ] {
            assert!(
                resolve_tool_use(Some(&t), None, None, &server(true)).is_err(),
                "{t}"
            );
        }
    }

    #[test]
    fn tool_turns_are_checked_and_arguments_become_objects() {
        let mut m = vec![
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]}),
            json!({"role": "tool", "tool_call_id": "call_1", "content": "sunny"}),
        ];
        prepare_tool_turns(&mut m).unwrap();
        assert_eq!(
            m[0]["tool_calls"][0]["function"]["arguments"],
            json!({"a": 1})
        );
        assert!(uses_tools(&m, &Map::new()));
        let mut bad = vec![json!({"role": "tool", "content": "x"})];
        let err = prepare_tool_turns(&mut bad).unwrap_err();
        assert!(err.to_string().contains("tool_call_id"), "{err}");
        let mut bad = vec![
            json!({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}),
        ];
        let err = prepare_tool_turns(&mut bad).unwrap_err();
        assert!(err.to_string().contains("tool_calls[0]"), "{err}");
    }
}
