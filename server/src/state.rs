//! The server's configuration and the state every handler shares.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use model::{Family, ModelConfig, ModelTokenizer};
use router::{AfdStatsSource, Router};

use crate::chat_template::{ChatFormat, ChatTemplate};
use axum::response::{IntoResponse, Response};

use crate::error::{ApiError, Error};
use crate::lifecycle::Lifecycle;
use crate::metrics::Metrics;
use crate::structured::OutputGrammars;
use crate::tool_parsing::{ReasoningParserKind, ToolCallParserKind};
use crate::tools::ToolParsing;
use crate::validation::Limits;

/// Settings of the HTTP server (the scheduler's are in [`router::RouterConfig`]).
#[derive(Debug, Clone, PartialEq)]
pub struct ServerConfig {
    /// Address to listen on.
    pub host: String,
    /// Port to listen on; 0 picks a free one.
    pub port: u16,
    /// Checkpoint folder: tokenizer.json, tokenizer_config.json / chat_template.jinja,
    /// config.json.
    pub model_dir: PathBuf,
    /// The model's id in `/v1/models` and responses; default: `model_dir` as given (as vLLM
    /// uses its `--model` argument).
    pub served_model_name: Option<String>,
    /// Tokens `/v1/completions` generates when the request gives no `max_tokens` (vLLM: 16).
    pub default_max_tokens: usize,
    /// Largest `n` accepted.
    pub max_n: usize,
    /// Largest `logprobs` / `top_logprobs` accepted (vLLM: 20).
    pub max_logprobs: usize,
    /// Bearer token every `/v1/*` request must carry (`Authorization: Bearer ...`), as vLLM's
    /// `--api-key`; `None`: no authentication. `/health`, `/metrics` and the rest stay open.
    pub api_key: Option<ApiKey>,
    /// How long a client has to send a whole request head, from the moment its connection
    /// opens or its previous response ends; also how long an idle kept-alive connection stays
    /// open. A partial head gets 408.
    pub header_timeout: Duration,
    /// How long a client has to send a request's whole body once its head has arrived (408
    /// after it).
    pub body_timeout: Duration,
    /// Largest request body accepted: 413 beyond it, at once when `Content-Length` says so.
    pub max_body_bytes: usize,
    /// Most connections open at once; at the limit the oldest idle one is closed to make
    /// room. `None`: the process's open-file limit less 256, at most 16384.
    pub max_connections: Option<usize>,
    /// After a stop signal, how long requests in flight may take to finish; what still runs
    /// then ends with an error.
    pub shutdown_timeout: Duration,
    /// vLLM's `--enable-auto-tool-choice`: with `tool_choice: "auto"` (the default when a
    /// request has tools), tool calls are parsed out of the output into `tool_calls`; off,
    /// such requests are refused (400) and `tool_choice: "none"` returns the output as text.
    pub enable_auto_tool_choice: bool,
    /// vLLM's `--tool-call-parser`: how the model writes tool calls; `None`: the model type's
    /// (gpt_oss: openai, qwen3_moe: hermes, mixtral: mistral).
    pub tool_call_parser: Option<ToolCallParserKind>,
    /// vLLM's `--reasoning-parser`: how the model writes its reasoning, which goes to
    /// `reasoning_content`; `None`: the model type's (gpt_oss: openai_gptoss, qwen3_moe:
    /// qwen3, mixtral: none).
    pub reasoning_parser: Option<ReasoningParserKind>,
}

/// A secret that never appears in logs or `Debug` output.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(String);

impl ApiKey {
    /// Wraps `key`.
    pub fn new(key: impl Into<String>) -> Self {
        ApiKey(key.into())
    }

    /// Whether `header` (an `Authorization` value) is `Bearer <this key>`. Compares in time
    /// independent of where the first difference is.
    pub fn admits(&self, header: Option<&str>) -> bool {
        let Some(token) = header.and_then(|h| h.strip_prefix("Bearer ")) else {
            return false;
        };
        let (a, b) = (token.as_bytes(), self.0.as_bytes());
        a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
    }
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey(<redacted>)")
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            host: "127.0.0.1".into(),
            port: 8000,
            model_dir: PathBuf::from("models/afd-tiny-gpt-oss"),
            served_model_name: None,
            default_max_tokens: 16,
            max_n: 16,
            max_logprobs: 20,
            api_key: None,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            max_body_bytes: 2 << 20,
            max_connections: None,
            shutdown_timeout: Duration::from_secs(30),
            enable_auto_tool_choice: false,
            tool_call_parser: None,
            reasoning_parser: None,
        }
    }
}

/// What every handler shares.
pub struct AppState {
    /// Settings.
    pub config: ServerConfig,
    /// The scheduler and its attention nodes.
    pub router: Router,
    /// The checkpoint's tokenizer.
    pub tokenizer: ModelTokenizer,
    /// How chat messages become a prompt.
    pub chat: ChatFormat,
    /// The model family, when config.json names one afd knows.
    pub family: Option<Family>,
    /// The model's id.
    pub model_id: String,
    /// The checkpoint path (`root` in `/v1/models`).
    pub model_root: String,
    /// Bounds.
    pub limits: Limits,
    /// Tokens that end generation unless `ignore_eos`.
    pub eos_token_ids: Vec<u32>,
    /// GPT-OSS harmony stop tokens (`<|return|>`, `<|call|>`) for chat.
    pub harmony_stop_ids: Vec<u32>,
    /// Tokens per KV block.
    pub block_size: usize,
    /// How chat outputs' tool calls and reasoning are parsed.
    pub tool_parsing: ToolParsing,
    /// Metrics.
    pub metrics: Metrics,
    /// The disaggregated path's figures, when the deployment provides them.
    pub afd_stats: Option<Arc<dyn AfdStatsSource>>,
    /// Unix time the server started (the model's `created`).
    pub created: u64,
    /// Draining and cutting off at shutdown.
    pub lifecycle: Arc<Lifecycle>,
    /// Compiles structured-output formats over the vocabulary.
    pub output_grammars: OutputGrammars,
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState")
            .field("config", &self.config)
            .field("model_id", &self.model_id)
            .finish()
    }
}

impl AppState {
    /// A handler's answer: its response, or its error counted in the failure metric and
    /// answered in the error envelope.
    pub fn answer(&self, result: Result<Response, ApiError>) -> Response {
        result.unwrap_or_else(|e| {
            self.metrics.error(e.error_type());
            e.into_response()
        })
    }

    /// Loads the tokenizer and template of `config.model_dir` around a running `router`.
    pub fn new(
        config: ServerConfig,
        router: Router,
        afd_stats: Option<Arc<dyn AfdStatsSource>>,
    ) -> Result<Self, Error> {
        let dir = config.model_dir.clone();
        let tokenizer = ModelTokenizer::load(&dir).map_err(|source| Error::Model {
            dir: dir.display().to_string(),
            source,
        })?;
        let model_config = ModelConfig::from_file(&dir.join("config.json")).ok();
        let family = model_config.as_ref().map(|c| c.family);
        let vocab_size = model_config
            .as_ref()
            .map(|c| c.vocab_size)
            .unwrap_or_else(|| tokenizer.vocab_size())
            .max(1);
        let mut eos_token_ids = tokenizer.eos_token_ids.clone();
        if let Some(c) = &model_config {
            for id in &c.eos_token_ids {
                if !eos_token_ids.contains(id) {
                    eos_token_ids.push(*id);
                }
            }
        }
        let harmony_stop_ids: Vec<u32> = if family == Some(Family::GptOss) {
            ["<|return|>", "<|call|>"]
                .iter()
                .filter_map(|t| tokenizer.token_to_id(t))
                .collect()
        } else {
            Vec::new()
        };
        let chat = match (&tokenizer.chat_template, family) {
            (Some(src), _) => ChatFormat::Template(Box::new(ChatTemplate::new(
                src.clone(),
                tokenizer.bos_token.clone(),
                tokenizer.eos_token.clone(),
            )?)),
            (None, Some(Family::GptOss)) => ChatFormat::Harmony,
            (None, _) => ChatFormat::None,
        };
        let model_id = config
            .served_model_name
            .clone()
            .unwrap_or_else(|| dir.display().to_string());
        let max_model_len = router.config().scheduler.max_model_len;
        let block_size = router
            .kv_capacities()
            .first()
            .map(|k| k.block_size)
            .unwrap_or(0);
        let tool_call_parser = config
            .tool_call_parser
            .or(family.map(ToolCallParserKind::for_family));
        if config.enable_auto_tool_choice && tool_call_parser.is_none() {
            return Err(Error::Config(
                "--enable-auto-tool-choice needs --tool-call-parser: config.json names no \
                 model_type with a default one"
                    .into(),
            ));
        }
        let tool_parsing = ToolParsing {
            auto_tool_choice: config.enable_auto_tool_choice,
            tool_call_parser,
            reasoning_parser: config
                .reasoning_parser
                .or(family.map(ReasoningParserKind::for_family))
                .unwrap_or(ReasoningParserKind::None),
        };
        if config.max_n == 0 {
            return Err(Error::Config("max_n must be at least 1".into()));
        }
        let output_stops: Vec<u32> = eos_token_ids
            .iter()
            .chain(&harmony_stop_ids)
            .copied()
            .collect();
        let output_grammars = OutputGrammars::new(vocab_size, &output_stops);
        Ok(AppState {
            output_grammars,
            limits: Limits {
                vocab_size,
                max_model_len,
                max_n: config.max_n,
                max_logprobs: config.max_logprobs,
            },
            metrics: Metrics::new(&model_id, max_model_len),
            model_root: dir.display().to_string(),
            model_id,
            tokenizer,
            chat,
            family,
            eos_token_ids,
            harmony_stop_ids,
            block_size,
            tool_parsing,
            afd_stats,
            created: crate::protocol::unix_now(),
            lifecycle: Arc::new(Lifecycle::default()),
            router,
            config,
        })
    }

    /// Checks the request's `model` against the served one (its id or root).
    pub fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model {
            None => Ok(()),
            Some(m) if m == self.model_id || m == self.model_root || m.is_empty() => Ok(()),
            Some(m) => Err(ApiError::NotFound {
                message: format!(
                    "The model `{m}` does not exist. This server serves `{}`.",
                    self.model_id
                ),
                param: Some("model".into()),
            }),
        }
    }

    /// Tokenizes text off the async runtime.
    pub async fn encode(
        self: &Arc<Self>,
        text: String,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, ApiError> {
        let state = Arc::clone(self);
        tokio::task::spawn_blocking(move || state.tokenizer.encode(&text, add_special_tokens))
            .await
            .map_err(|e| ApiError::Internal(format!("tokenizer task failed: {e}")))?
            .map_err(|e| ApiError::bad_param("prompt", format!("cannot tokenize the prompt: {e}")))
    }

    /// One token's text (for logprobs).
    pub fn token_text(&self, id: u32) -> String {
        self.tokenizer.decode(&[id], false).unwrap_or_default()
    }
}
