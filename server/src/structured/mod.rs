//! Structured outputs: `response_format` (`json_object`, `json_schema`) and vLLM's
//! `structured_outputs` (`json`, `regex`, `choice`, `grammar`), compiled by llguidance (the
//! engine vLLM, SGLang and llama.cpp use) into a grammar whose token masks the router computes
//! while the node steps ([`step::constraint`]).
//!
//! For GPT-OSS chat the grammar wraps harmony: the model may think in the analysis channel
//! first, then writes the constrained text as its final message, which the harmony parser
//! reports as `content`. Everything here is pure apart from the lazily built vocabulary.

#[cfg(test)]
mod tests;
mod token_env;
mod tool_calls;

pub use tool_calls::forced_calls;

use std::sync::{Arc, Mutex, OnceLock};

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use model::ModelTokenizer;
use serde_json::Value;
use step::Constraint;

use crate::error::ApiError;
use crate::protocol::CommonParams;
use crate::state::AppState;
use token_env::{GrammarConstraint, VocabularyEnv};

/// What the output must be.
#[derive(Debug, Clone, PartialEq)]
pub enum OutputFormat {
    /// Any JSON object.
    JsonObject,
    /// JSON valid under this schema.
    JsonSchema(Value),
    /// Text matching this regular expression (Rust `regex` syntax).
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A grammar in llguidance's Lark syntax.
    Grammar(String),
    /// The tool calls `tool_choice` requires, as a grammar of the whole output (see
    /// [`forced_calls`]).
    ToolCalls(String),
}

/// Reads the request's `response_format` and `structured_outputs` (at most one format).
pub fn output_format(
    response_format: Option<&Value>,
    structured_outputs: Option<&Value>,
) -> Result<Option<OutputFormat>, ApiError> {
    let from_response_format = response_format
        .filter(|v| !v.is_null())
        .map(parse_response_format)
        .transpose()?
        .flatten();
    let from_structured = structured_outputs
        .filter(|v| !v.is_null())
        .map(parse_structured_outputs)
        .transpose()?;
    match (from_response_format, from_structured) {
        (Some(_), Some(_)) => Err(ApiError::bad_param(
            "structured_outputs",
            "give either response_format or structured_outputs, not both.",
        )),
        (a, b) => Ok(a.or(b)),
    }
}

/// OpenAI's `response_format`: `text` (no constraint), `json_object`, or `json_schema` with
/// `{"json_schema": {"name", "schema", "strict"}}`.
fn parse_response_format(v: &Value) -> Result<Option<OutputFormat>, ApiError> {
    let kind = v.get("type").and_then(Value::as_str);
    match kind {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(OutputFormat::JsonObject)),
        Some("json_schema") => {
            let schema = v
                .get("json_schema")
                .and_then(|s| s.get("schema"))
                .filter(|s| s.is_object() || s.is_boolean())
                .ok_or_else(|| {
                    ApiError::bad_param(
                        "response_format.json_schema.schema",
                        "response_format of type json_schema needs \
                         {\"json_schema\": {\"name\": ..., \"schema\": {...}}}.",
                    )
                })?;
            Ok(Some(OutputFormat::JsonSchema(schema.clone())))
        }
        _ => Err(ApiError::bad_param(
            "response_format.type",
            format!(
                "response_format.type must be text, json_object or json_schema; got {}.",
                v.get("type").unwrap_or(&Value::Null)
            ),
        )),
    }
}

/// vLLM's `structured_outputs`: exactly one of `json` (a schema, or its text), `regex`,
/// `choice` (a list of strings) and `grammar` (Lark).
fn parse_structured_outputs(v: &Value) -> Result<OutputFormat, ApiError> {
    let param = "structured_outputs";
    let Some(map) = v.as_object() else {
        return Err(ApiError::bad_param(
            param,
            "structured_outputs must be an object with one of json, regex, choice or grammar.",
        ));
    };
    let given: Vec<&str> = ["json", "regex", "choice", "grammar", "json_object"]
        .into_iter()
        .filter(|k| {
            map.get(*k)
                .is_some_and(|v| !v.is_null() && *v != Value::Bool(false))
        })
        .collect();
    let unknown: Vec<&String> = map
        .keys()
        .filter(|k| {
            !["json", "regex", "choice", "grammar", "json_object"].contains(&k.as_str())
                && !map[k.as_str()].is_null()
        })
        .collect();
    if let Some(k) = unknown.first() {
        return Err(ApiError::bad_param(
            &format!("{param}.{k}"),
            format!("structured_outputs.{k} is not supported; use json, regex, choice or grammar."),
        ));
    }
    let [key] = given.as_slice() else {
        return Err(ApiError::bad_param(
            param,
            format!(
                "structured_outputs needs exactly one of json, regex, choice or grammar; got {}.",
                if given.is_empty() {
                    "none".to_string()
                } else {
                    given.join(", ")
                }
            ),
        ));
    };
    let value = &map[*key];
    let text = |what: &str| {
        value.as_str().map(str::to_owned).ok_or_else(|| {
            ApiError::bad_param(&format!("{param}.{key}"), format!("{key} must be {what}."))
        })
    };
    match *key {
        "json" => match value {
            Value::String(s) => serde_json::from_str(s)
                .map(OutputFormat::JsonSchema)
                .map_err(|e| {
                    ApiError::bad_param(
                        "structured_outputs.json",
                        format!("json is not valid JSON: {e}."),
                    )
                }),
            Value::Object(_) | Value::Bool(_) => Ok(OutputFormat::JsonSchema(value.clone())),
            _ => Err(ApiError::bad_param(
                "structured_outputs.json",
                "json must be a JSON schema (an object, or its text).",
            )),
        },
        "json_object" => Ok(OutputFormat::JsonObject),
        "regex" => text("a regular expression").map(OutputFormat::Regex),
        "grammar" => text("a grammar in Lark syntax").map(OutputFormat::Grammar),
        _ => {
            let choices: Option<Vec<String>> = value
                .as_array()
                .and_then(|a| a.iter().map(|c| c.as_str().map(str::to_owned)).collect());
            match choices {
                Some(c) if !c.is_empty() => Ok(OutputFormat::Choice(c)),
                _ => Err(ApiError::bad_param(
                    "structured_outputs.choice",
                    "choice must be a non-empty list of strings.",
                )),
            }
        }
    }
}

/// The output format `common` asks for (or `tool_calls`, the grammar of a required tool
/// call), compiled for `framing` off the async runtime; `None` when there is none.
pub async fn compile_requested(
    state: &Arc<AppState>,
    common: &CommonParams,
    framing: Framing,
    tool_calls: Option<OutputFormat>,
) -> Result<Option<Arc<CompiledFormat>>, ApiError> {
    let structured = structured_outputs(common)?;
    let requested = output_format(common.response_format.as_ref(), structured.as_ref())?;
    let format = match (requested, tool_calls) {
        (None, None) => return Ok(None),
        (Some(_), Some(_)) => {
            return Err(ApiError::bad_param(
                "tool_choice",
                "a required or named tool_choice already fixes the output's format: leave \
                 response_format and structured_outputs out, or use tool_choice \"auto\".",
            ));
        }
        (Some(f), None) | (None, Some(f)) => f,
    };
    if common.ignore_eos == Some(true) {
        return Err(ApiError::bad_param(
            "ignore_eos",
            "ignore_eos cannot be combined with a structured output format: the output ends \
             where its grammar does.",
        ));
    }
    let state = Arc::clone(state);
    let compiled = tokio::task::spawn_blocking(move || {
        state
            .output_grammars
            .compile(&state.tokenizer, &format, framing)
    })
    .await
    .map_err(|e| ApiError::Internal(format!("grammar task failed: {e}")))??;
    Ok(Some(Arc::new(compiled)))
}

/// `structured_outputs`, or the same built from older vLLM's `guided_json`, `guided_regex`,
/// `guided_choice` and `guided_grammar` (not both ways at once).
fn structured_outputs(common: &CommonParams) -> Result<Option<Value>, ApiError> {
    let guided: serde_json::Map<String, Value> = [
        ("json", &common.guided_json),
        ("regex", &common.guided_regex),
        ("choice", &common.guided_choice),
        ("grammar", &common.guided_grammar),
    ]
    .into_iter()
    .filter_map(|(k, v)| {
        v.clone()
            .filter(|v| !v.is_null())
            .map(|v| (k.to_string(), v))
    })
    .collect();
    match (&common.structured_outputs, guided.is_empty()) {
        (_, true) => Ok(common.structured_outputs.clone()),
        (Some(s), false) if !s.is_null() => Err(ApiError::bad_param(
            "structured_outputs",
            "give structured_outputs or the older guided_* parameters, not both.",
        )),
        _ => Ok(Some(Value::Object(guided))),
    }
}

/// Where the constrained text sits in the output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// The whole output (completions, and chat for models without a channel format).
    Whole,
    /// GPT-OSS harmony after `<|start|>assistant`: optional analysis, then the final message.
    Harmony,
    /// Qwen3's `<think>...</think>` before the answer: optional, or already opened by the
    /// prompt (`opened`), closed by `</think>` before the constrained text.
    Think {
        /// The prompt ends inside `<think>`.
        opened: bool,
    },
}

/// The vocabulary's grammar compiler, built on the first request that needs it (building
/// the token trie of a 200k vocabulary takes a moment no other request should wait for).
pub struct OutputGrammars {
    vocab: usize,
    stop_ids: Vec<u32>,
    factory: OnceLock<Result<Arc<ParserFactory>, String>>,
}

impl std::fmt::Debug for OutputGrammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutputGrammars")
            .field("vocab", &self.vocab)
            .finish()
    }
}

impl OutputGrammars {
    /// The compiler for a vocabulary of `vocab` ids (the model's, which may pad the
    /// tokenizer's), whose outputs end on any of `stop_ids` (the end-of-sequence tokens).
    pub fn new(vocab: usize, stop_ids: &[u32]) -> Self {
        OutputGrammars {
            vocab,
            stop_ids: stop_ids.to_vec(),
            factory: OnceLock::new(),
        }
    }

    fn factory(&self, tokenizer: &ModelTokenizer) -> Result<Arc<ParserFactory>, ApiError> {
        self.factory
            .get_or_init(|| {
                let env = VocabularyEnv::new(tokenizer, self.vocab, &self.stop_ids);
                let env: llguidance::toktrie::TokEnv = Arc::new(env);
                let mut factory = ParserFactory::new_simple(&env)
                    .map_err(|e| format!("the vocabulary's grammar compiler failed: {e}"))?;
                factory.quiet();
                Ok(Arc::new(factory))
            })
            .clone()
            .map_err(ApiError::Internal)
    }

    /// Compiles `format` framed as `framing` over `tokenizer`'s vocabulary (always the same
    /// tokenizer: the first call builds the vocabulary's tables from it). Checked once here, so
    /// that a bad schema or regex is a 400 before anything is queued. Blocking: call it off
    /// the async runtime.
    pub fn compile(
        &self,
        tokenizer: &ModelTokenizer,
        format: &OutputFormat,
        framing: Framing,
    ) -> Result<CompiledFormat, ApiError> {
        let factory = self.factory(tokenizer)?;
        let parser = factory
            .create_parser(grammar(format, framing))
            .map_err(|e| compile_error(format, &e.to_string()))?;
        let prototype = Matcher::new(Ok(parser));
        if let Some(e) = prototype.get_error() {
            return Err(compile_error(format, &e));
        }
        Ok(CompiledFormat {
            prototype: Mutex::new(prototype),
            vocab: self.vocab,
            stop_ids: self.stop_ids.clone(),
        })
    }
}

/// A compiled output format, ready to hand each choice its own grammar state.
pub struct CompiledFormat {
    prototype: Mutex<Matcher>,
    vocab: usize,
    stop_ids: Vec<u32>,
}

impl std::fmt::Debug for CompiledFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CompiledFormat")
    }
}

impl CompiledFormat {
    /// A fresh grammar state for one choice.
    pub fn constraint(&self) -> Constraint {
        let matcher = self
            .prototype
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .deep_clone();
        Constraint(Arc::new(GrammarConstraint {
            matcher: Mutex::new(matcher),
            vocab: self.vocab,
            stop_ids: self.stop_ids.clone(),
        }))
    }
}

/// The parameter a format came from, for errors.
fn param_of(format: &OutputFormat) -> &'static str {
    match format {
        OutputFormat::JsonObject | OutputFormat::JsonSchema(_) => "response_format",
        OutputFormat::Regex(_) => "structured_outputs.regex",
        OutputFormat::Choice(_) => "structured_outputs.choice",
        OutputFormat::Grammar(_) => "structured_outputs.grammar",
        OutputFormat::ToolCalls(_) => "tools",
    }
}

fn compile_error(format: &OutputFormat, error: &str) -> ApiError {
    let what = match format {
        OutputFormat::JsonObject | OutputFormat::JsonSchema(_) => "the JSON schema",
        OutputFormat::Regex(_) => "the regular expression",
        OutputFormat::Choice(_) => "the choices",
        OutputFormat::Grammar(_) => "the grammar",
        OutputFormat::ToolCalls(_) => "the tools' parameters",
    };
    ApiError::bad_param(
        param_of(format),
        format!("{what} cannot be used for structured output: {error}"),
    )
}

/// The Lark rule body of the constrained text.
fn body(format: &OutputFormat) -> String {
    match format {
        OutputFormat::JsonObject => {
            format!("%json {}", compact(&serde_json::json!({"type": "object"})))
        }
        OutputFormat::JsonSchema(schema) => format!("%json {}", compact(schema)),
        OutputFormat::Regex(rx) => format!("/{}/", rx.replace('/', "\\/")),
        OutputFormat::Choice(choices) => choices
            .iter()
            .map(|c| Value::String(c.clone()).to_string())
            .collect::<Vec<_>>()
            .join(" | "),
        OutputFormat::Grammar(lark) | OutputFormat::ToolCalls(lark) => {
            format!("%lark {{\n{lark}\n}}")
        }
    }
}

/// `schema` written as OpenAI writes JSON (`{"a": 1, "b": [2, 3]}`): one space after `:` and
/// `,`, no other whitespace, unless the schema sets llguidance's own `x-guidance` options.
/// Free whitespace lets a weak model pad forever (newline after newline until `max_tokens`).
fn compact(schema: &Value) -> Value {
    let mut schema = schema.clone();
    if let Value::Object(map) = &mut schema
        && !map.contains_key("x-guidance")
    {
        map.insert(
            "x-guidance".into(),
            serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
    schema
}

/// Harmony's optional analysis message before the answer (Lark rules).
const HARMONY_ANALYSIS: &str = "analysis: <|channel|> \"analysis\" <|message|> THINKING <|end|> <|start|> \"assistant\"\nTHINKING: /(.|\\n)*/\n";

/// Lark rules: Qwen3's thought (optional, or already opened by the prompt), then `rule`.
fn after_thought(opened: bool, rule: &str) -> String {
    format!(
        "start: {} NL* {rule}\n\
         think: \"<think>\" thought\n\
         thought[suffix=\"</think>\"]: /(.|\\n)*/\n\
         NL: \"\\n\"\n",
        if opened { "thought" } else { "think?" }
    )
}

/// The whole grammar of the output.
fn grammar(format: &OutputFormat, framing: Framing) -> TopLevelGrammar {
    match (framing, format) {
        // Qwen3 may think before its forced calls, as before any answer: the calls' grammar
        // (whose rule `start` is renamed) after the optional `<think>...</think>`.
        (Framing::Think { opened }, OutputFormat::ToolCalls(lark)) => {
            TopLevelGrammar::from_lark(format!(
                "{}{}",
                after_thought(opened, "calls"),
                lark.replacen("start:", "calls:", 1)
            ))
        }
        // Other tool calls frame themselves (harmony's allow the analysis channel first).
        (_, OutputFormat::ToolCalls(lark)) | (Framing::Whole, OutputFormat::Grammar(lark)) => {
            TopLevelGrammar::from_lark(lark.clone())
        }
        (Framing::Whole, _) => TopLevelGrammar::from_lark(format!("start: {}\n", body(format))),
        (Framing::Think { opened }, _) => TopLevelGrammar::from_lark(format!(
            "{}body: {}\n",
            after_thought(opened, "body"),
            body(format)
        )),
        (Framing::Harmony, _) => TopLevelGrammar::from_lark(format!(
            "start: analysis? <|channel|> \"final\" <|message|> body <|return|>\n\
             body: {}\n{HARMONY_ANALYSIS}",
            body(format)
        )),
    }
}
