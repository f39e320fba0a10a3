//! Chat prompts: the checkpoint's Jinja template rendered with minijinja (as transformers
//! renders it: `trim_blocks`, `lstrip_blocks`, loop controls, Python string methods through
//! pycompat, `raise_exception`, `strftime_now`), or GPT-OSS's harmony format when a GPT-OSS
//! checkpoint ships no template.

use minijinja::{Environment, ErrorKind, Value as JinjaValue};
use serde_json::{Map, Value};

use crate::error::{ApiError, Error};
use crate::protocol::chat::{ChatMessage, MessageContent};

const TEMPLATE_NAME: &str = "chat";

/// How chat messages become a prompt.
#[derive(Debug)]
pub enum ChatFormat {
    /// The checkpoint's template.
    Template(Box<ChatTemplate>),
    /// GPT-OSS harmony, rendered here.
    Harmony,
    /// Neither: chat is refused.
    None,
}

/// A compiled chat template and the special tokens it may use.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    /// The template reads `tool_calls`: it can render a conversation's tool turns.
    renders_tool_calls: bool,
}

/// What a render needs besides the messages.
#[derive(Debug, Clone, Default)]
pub struct RenderOptions {
    /// End with the assistant's header.
    pub add_generation_prompt: bool,
    /// Leave the last message open (no end-of-turn), to be continued.
    pub continue_final_message: bool,
    /// Extra template variables (`chat_template_kwargs`, `tools`, `reasoning_effort`).
    pub extra: Map<String, Value>,
}

fn raise_exception(message: String) -> Result<String, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
}

/// Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// `strftime_now(format)` for the conversions chat templates use (UTC).
fn strftime_now(format: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let (y, m, d) = civil_from_days(secs.div_euclid(86_400));
    let tod = secs.rem_euclid(86_400);
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let month = MONTHS[(m - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('B') => out.push_str(month),
            Some('b') => out.push_str(&month[..3]),
            Some('H') => out.push_str(&format!("{:02}", tod / 3600)),
            Some('M') => out.push_str(&format!("{:02}", tod / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", tod % 60)),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

impl ChatTemplate {
    /// Compiles `source`.
    pub fn new(
        source: String,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, Error> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        let renders_tool_calls = source.contains("tool_calls");
        env.add_template_owned(TEMPLATE_NAME, source)
            .map_err(Error::ChatTemplate)?;
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.unwrap_or_default(),
            eos_token: eos_token.unwrap_or_default(),
            renders_tool_calls,
        })
    }

    /// Whether the template can render tool turns (it reads `tool_calls`); one that cannot
    /// would drop them from the prompt without a word.
    pub fn renders_tool_calls(&self) -> bool {
        self.renders_tool_calls
    }

    /// Renders `messages`.
    pub fn render(&self, messages: &[Value], options: &RenderOptions) -> Result<String, ApiError> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| ApiError::Internal(format!("chat template: {e}")))?;
        let mut ctx = options.extra.clone();
        ctx.insert("messages".into(), Value::Array(messages.to_vec()));
        ctx.insert(
            "add_generation_prompt".into(),
            Value::Bool(options.add_generation_prompt),
        );
        ctx.insert("bos_token".into(), Value::String(self.bos_token.clone()));
        ctx.insert("eos_token".into(), Value::String(self.eos_token.clone()));
        let rendered = template
            .render(JinjaValue::from_serialize(&ctx))
            .map_err(|e| {
                let mut message = format!("the chat template failed on these messages: {e}");
                if let Some(detail) = e.detail() {
                    message = format!("{message} ({detail})");
                }
                ApiError::bad_param("messages", message)
            })?;
        if options.continue_final_message {
            return Ok(trim_to_last_content(rendered, messages));
        }
        Ok(rendered)
    }
}

/// With `continue_final_message`, the prompt ends right after the last message's content (the
/// template's end-of-turn after it is cut), as vLLM does.
fn trim_to_last_content(rendered: String, messages: &[Value]) -> String {
    let last = messages
        .last()
        .and_then(|m| m.get("content"))
        .and_then(Value::as_str)
        .unwrap_or("");
    if last.is_empty() {
        return rendered;
    }
    match rendered.rfind(last) {
        Some(at) => rendered[..at + last.len()].to_string(),
        None => rendered,
    }
}

/// GPT-OSS harmony: `<|start|>{role}<|message|>{content}<|end|>` per message, then
/// `<|start|>assistant` (docs/reference/gpt-oss.md §5). Tool turns take harmony's own shape:
/// the tools in a developer message (after a leading system message), an assistant's calls as
/// `commentary to=functions.NAME` messages ending in `<|call|>`, its `reasoning_content` in
/// the `analysis` channel, and each `tool` message from `functions.NAME` (the call it answers
/// names the function).
pub fn render_harmony(messages: &[Value], options: &RenderOptions) -> Result<String, ApiError> {
    let mut out = String::new();
    let tools = harmony_tools(options.extra.get("tools"));
    let mut tools_pending = !tools.is_empty();
    for (i, m) in messages.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("user");
        let content = m.get("content").and_then(Value::as_str).unwrap_or("");
        if tools_pending && role != "system" {
            out.push_str(&format!("<|start|>developer<|message|>{tools}<|end|>"));
            tools_pending = false;
        }
        let open = options.continue_final_message && i + 1 == messages.len();
        let end = if open { "" } else { "<|end|>" };
        match role {
            "assistant"
                if m.get("tool_calls").is_some() || m.get("reasoning_content").is_some() =>
            {
                if let Some(r) = m.get("reasoning_content").and_then(Value::as_str) {
                    out.push_str(&format!(
                        "<|start|>assistant<|channel|>analysis<|message|>{r}<|end|>"
                    ));
                }
                let calls = m.get("tool_calls").and_then(Value::as_array);
                if !content.is_empty() {
                    // Beside calls, the text is a preamble to them (commentary), else the
                    // answer.
                    let channel = if calls.is_some() {
                        "commentary"
                    } else {
                        "final"
                    };
                    out.push_str(&format!(
                        "<|start|>assistant<|channel|>{channel}<|message|>{content}{end}"
                    ));
                }
                for call in calls.into_iter().flatten() {
                    let f = &call["function"];
                    let name = f["name"].as_str().unwrap_or("");
                    let args = match &f["arguments"] {
                        Value::String(s) => s.clone(),
                        other => other.to_string(),
                    };
                    out.push_str(&format!(
                        "<|start|>assistant<|channel|>commentary to=functions.{name} \
                         <|constrain|>json<|message|>{args}<|call|>"
                    ));
                }
            }
            "tool" => {
                let name = called_function(&messages[..i], m).ok_or_else(|| {
                    ApiError::bad_param(
                        "messages",
                        format!(
                            "messages[{i}] answers tool call {}, which no earlier assistant \
                             message made: give the id from that message's tool_calls.",
                            m.get("tool_call_id").unwrap_or(&Value::Null)
                        ),
                    )
                })?;
                out.push_str(&format!(
                    "<|start|>functions.{name} to=assistant<|channel|>commentary<|message|>\
                     {content}{end}"
                ));
            }
            _ => out.push_str(&format!("<|start|>{role}<|message|>{content}{end}")),
        }
    }
    if tools_pending {
        out.push_str(&format!("<|start|>developer<|message|>{tools}<|end|>"));
    }
    if options.add_generation_prompt && !options.continue_final_message {
        out.push_str("<|start|>assistant");
    }
    Ok(out)
}

/// The function a `tool` message answers: the earlier call with its `tool_call_id`, else
/// the message's own `name`.
fn called_function(earlier: &[Value], tool_message: &Value) -> Option<String> {
    let id = tool_message.get("tool_call_id").and_then(Value::as_str);
    earlier
        .iter()
        .rev()
        .filter_map(|m| m.get("tool_calls").and_then(Value::as_array))
        .flatten()
        .find(|c| id.is_some() && c.get("id").and_then(Value::as_str) == id)
        .and_then(|c| c["function"]["name"].as_str())
        .or_else(|| tool_message.get("name").and_then(Value::as_str))
        .map(str::to_string)
}

/// Harmony's tool section: each function as a TypeScript-like signature whose parameter is
/// its JSON schema, in `namespace functions`; empty without tools.
fn harmony_tools(tools: Option<&Value>) -> String {
    let Some(list) = tools.and_then(Value::as_array).filter(|l| !l.is_empty()) else {
        return String::new();
    };
    let mut out = String::from("# Tools\n\n## functions\n\nnamespace functions {\n\n");
    for tool in list {
        let f = &tool["function"];
        let name = f["name"].as_str().unwrap_or("");
        if let Some(d) = f.get("description").and_then(Value::as_str) {
            out.push_str(&format!("// {d}\n"));
        }
        match f.get("parameters").filter(|p| !p.is_null()) {
            Some(p) => out.push_str(&format!("type {name} = (_: {p}) => any;\n\n")),
            None => out.push_str(&format!("type {name} = () => any;\n\n")),
        }
    }
    out.push_str("} // namespace functions");
    out
}

/// Messages as the template sees them: content as one string (text parts joined by newlines,
/// vLLM's "string" content format), other fields as given.
pub fn normalize_messages(messages: &[ChatMessage]) -> Result<Vec<Value>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::bad_param(
            "messages",
            "messages must not be empty.",
        ));
    }
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let content = match &m.content {
                None => Value::Null,
                Some(MessageContent::Text(t)) => Value::String(t.clone()),
                Some(MessageContent::Parts(parts)) => {
                    let mut texts = Vec::new();
                    for p in parts {
                        if p.kind != "text" {
                            return Err(ApiError::bad_param(
                                "messages",
                                format!(
                                    "messages[{i}].content has a part of type `{}`; only `text` \
                                     parts are supported by this text-only model.",
                                    p.kind
                                ),
                            ));
                        }
                        texts.push(p.text.clone().unwrap_or_default());
                    }
                    Value::String(texts.join("\n"))
                }
            };
            let mut obj = m.rest.clone();
            obj.insert("role".into(), Value::String(m.role.clone()));
            obj.insert("content".into(), content);
            Ok(Value::Object(obj))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn messages(json: Value) -> Vec<Value> {
        let m: Vec<ChatMessage> = serde_json::from_value(json).unwrap();
        normalize_messages(&m).unwrap()
    }

    #[test]
    fn fixture_templates_render_as_transformers_did() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures");
        for name in ["gpt-oss-bf16", "mixtral", "qwen3-moe"] {
            let dir = root.join(name);
            let tok = model::ModelTokenizer::load(&dir).unwrap();
            let t = ChatTemplate::new(
                tok.chat_template.clone().unwrap(),
                tok.bos_token.clone(),
                tok.eos_token.clone(),
            )
            .unwrap();
            let expected: Value =
                serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap())
                    .unwrap();
            let chat = expected["prompts"]
                .as_array()
                .unwrap()
                .iter()
                .find(|p| p["kind"] == "chat")
                .unwrap();
            let msgs = messages(chat["messages"].clone());
            let opts = RenderOptions {
                add_generation_prompt: true,
                ..Default::default()
            };
            assert_eq!(
                t.render(&msgs, &opts).unwrap(),
                chat["text"].as_str().unwrap(),
                "{name}"
            );
        }
    }

    #[test]
    fn harmony_matches_the_reference_layout() {
        let msgs = messages(serde_json::json!([
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "2 + 2?"}]}
        ]));
        let opts = RenderOptions {
            add_generation_prompt: true,
            ..Default::default()
        };
        assert_eq!(
            render_harmony(&msgs, &opts).unwrap(),
            "<|start|>system<|message|>You are a helpful assistant.<|end|><|start|>user<|message|>What is\n2 + 2?<|end|><|start|>assistant"
        );
    }

    #[test]
    fn harmony_renders_tools_calls_and_results() {
        let mut msgs = messages(serde_json::json!([
            {"role": "system", "content": "S"},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": null, "reasoning_content": "Use the tool.",
             "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
        ]));
        crate::tools::prepare_tool_turns(&mut msgs).unwrap();
        let mut extra = Map::new();
        extra.insert(
            "tools".into(),
            serde_json::json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather now.", "parameters": {"type": "object"}}}]),
        );
        let opts = RenderOptions {
            add_generation_prompt: true,
            extra,
            ..Default::default()
        };
        assert_eq!(
            render_harmony(&msgs, &opts).unwrap(),
            "<|start|>system<|message|>S<|end|>\
             <|start|>developer<|message|># Tools\n\n## functions\n\nnamespace functions {\n\n// Weather now.\ntype get_weather = (_: {\"type\":\"object\"}) => any;\n\n} // namespace functions<|end|>\
             <|start|>user<|message|>Weather in Paris?<|end|>\
             <|start|>assistant<|channel|>analysis<|message|>Use the tool.<|end|>\
             <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Paris\"}<|call|>\
             <|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny<|end|>\
             <|start|>assistant"
        );
        let orphan =
            messages(serde_json::json!([{"role": "tool", "tool_call_id": "nope", "content": "x"}]));
        let err = render_harmony(&orphan, &opts).unwrap_err();
        assert!(err.to_string().contains("no earlier assistant"), "{err}");
    }

    #[test]
    fn python_methods_loop_controls_and_exceptions() {
        let src = "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}\
                   {{ m.content.strip().upper() }}{% if loop.index > 5 %}{% break %}{% endif %}\
                   {% endfor %}{% if messages|length > 3 %}{{ raise_exception('too many') }}{% endif %}\
                   {{ strftime_now('%Y')|length }}";
        let t = ChatTemplate::new(src.into(), None, None).unwrap();
        let msgs = messages(serde_json::json!([
            {"role": "system", "content": "sys"}, {"role": "user", "content": "  hi "}
        ]));
        assert_eq!(t.render(&msgs, &RenderOptions::default()).unwrap(), "HI4");
        let many = messages(serde_json::json!([
            {"role": "user", "content": "a"}, {"role": "user", "content": "b"},
            {"role": "user", "content": "c"}, {"role": "user", "content": "d"}
        ]));
        let err = t.render(&many, &RenderOptions::default()).unwrap_err();
        assert!(err.to_string().contains("too many"), "{err}");
    }

    #[test]
    fn non_text_parts_are_refused() {
        let m: Vec<ChatMessage> = serde_json::from_value(serde_json::json!([
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
        ]))
        .unwrap();
        assert!(normalize_messages(&m).is_err());
    }

    #[test]
    fn dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(19_723), (2024, 1, 1));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
    }
}
