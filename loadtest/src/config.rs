//! Benchmark settings: one `BenchmarkConfig` describes one measured run (one point of a sweep).
//! Defaults follow `vllm bench serve` where it has one; where afd-loadtest differs the doc
//! comment says so.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use crate::error::Error;

/// Which OpenAI API the requests go to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EndpointKind {
    /// `POST /v1/completions` with `prompt` (text or token ids) and `max_tokens`.
    #[default]
    Completions,
    /// `POST /v1/chat/completions` with one user message whose content is a list of parts,
    /// and `max_completion_tokens`, as vLLM's `openai-chat` backend sends it.
    Chat,
}

impl EndpointKind {
    /// The request path below the base URL.
    pub fn path(self) -> &'static str {
        match self {
            EndpointKind::Completions => "/v1/completions",
            EndpointKind::Chat => "/v1/chat/completions",
        }
    }

    /// The name vLLM's `--backend` uses for this endpoint, written as `backend` and
    /// `endpoint_type` in the result JSON.
    pub fn vllm_backend_name(self) -> &'static str {
        match self {
            EndpointKind::Completions => "openai",
            EndpointKind::Chat => "openai-chat",
        }
    }
}

impl FromStr for EndpointKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "completions" | "openai" => Ok(EndpointKind::Completions),
            "chat" | "openai-chat" => Ok(EndpointKind::Chat),
            other => Err(format!(
                "unknown endpoint '{other}': use 'completions' or 'chat'"
            )),
        }
    }
}

/// Where prompts come from.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum PromptSource {
    /// Token ids for completions, random words for chat (chat cannot take token ids).
    #[default]
    Auto,
    /// Random token ids in `[0, vocab_size)`, sent as `prompt: [ids]`: the input length is exact.
    TokenIds,
    /// Random common English words, about one token each with most tokenizers; the input
    /// length written to the result is the server's `usage.prompt_tokens` when it reports one.
    RandomWords,
    /// One prompt per line of a text file (blank lines skipped), used in order and repeated
    /// if the file has fewer lines than `num_prompts`; `input_len` does not apply.
    File(PathBuf),
}

/// How prompts and output lengths are made.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptConfig {
    /// The prompt kind.
    pub source: PromptSource,
    /// Prompt length in tokens (words for random text). vLLM's `--random-input-len` default.
    pub input_len: usize,
    /// Tokens (words for text) of one prefix drawn once per run and put before every prompt,
    /// as a long shared system prompt is: what prefix caching serves from cache. Each prompt
    /// is then `prefix_len + input_len` long. vLLM's `--random-prefix-len`; 0 for none.
    pub prefix_len: usize,
    /// Output length in tokens, sent as `max_tokens` / `max_completion_tokens`.
    pub output_len: usize,
    /// Each length is drawn uniformly from `[len * (1 - r), len * (1 + r)]`, as vLLM's random
    /// dataset does; 0 keeps every length exact. Must be in `[0, 1)`.
    pub range_ratio: f64,
    /// Token ids are drawn from `[0, vocab_size)`; keep it below the model's vocabulary size.
    pub vocab_size: u32,
}

impl Default for PromptConfig {
    fn default() -> Self {
        PromptConfig {
            source: PromptSource::Auto,
            input_len: 1024,
            prefix_len: 0,
            output_len: 128,
            range_ratio: 0.0,
            vocab_size: 1000,
        }
    }
}

/// A latency metric that a goodput SLO can bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum SloMetric {
    /// Time to first token.
    Ttft,
    /// Time per output token after the first (counted as 0 for one-token outputs, as vLLM does).
    Tpot,
    /// End-to-end latency.
    E2el,
}

impl SloMetric {
    /// The vLLM name (`ttft`, `tpot`, `e2el`).
    pub fn name(self) -> &'static str {
        match self {
            SloMetric::Ttft => "ttft",
            SloMetric::Tpot => "tpot",
            SloMetric::E2el => "e2el",
        }
    }
}

/// One service-level objective: `metric <= limit_ms` for a request to count toward goodput.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SloTarget {
    /// The bounded metric.
    pub metric: SloMetric,
    /// The limit in milliseconds.
    pub limit_ms: f64,
}

impl FromStr for SloTarget {
    type Err = String;
    /// Parses vLLM's `--goodput` form, `ttft:200` (milliseconds).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let usage =
            "write SLOs as KEY:MILLISECONDS with KEY one of ttft, tpot, e2el (e.g. ttft:200)";
        let (name, value) = s
            .split_once(':')
            .ok_or_else(|| format!("'{s}' is not an SLO: {usage}"))?;
        let metric = match name.trim() {
            "ttft" => SloMetric::Ttft,
            "tpot" => SloMetric::Tpot,
            "e2el" => SloMetric::E2el,
            other => return Err(format!("unknown SLO metric '{other}': {usage}")),
        };
        let limit_ms: f64 = value
            .trim()
            .parse()
            .map_err(|_| format!("'{value}' in '{s}' is not a number: {usage}"))?;
        if !(limit_ms.is_finite() && limit_ms >= 0.0) {
            return Err(format!("SLO limit in '{s}' must be a non-negative number"));
        }
        Ok(SloTarget { metric, limit_ms })
    }
}

impl fmt::Display for SloTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.metric.name(), self.limit_ms)
    }
}

/// Settings of one measured run against one server.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchmarkConfig {
    /// Server root, without `/v1` (e.g. `http://127.0.0.1:8000`).
    pub base_url: String,
    /// Completions or chat.
    pub endpoint: EndpointKind,
    /// Model name sent in requests; `None` asks `GET /v1/models` and takes the first `id`.
    pub model: Option<String>,
    /// Sent as `Authorization: Bearer <key>` when set.
    pub api_key: Option<String>,
    /// Requests in the measured run. vLLM defaults to 1000; afd-loadtest to 100, since a CPU
    /// deployment serves far fewer tokens per second.
    pub num_prompts: usize,
    /// Prompt and output shapes.
    pub prompts: PromptConfig,
    /// Send `ignore_eos: true` so every request generates exactly `output_len` tokens.
    pub ignore_eos: bool,
    /// Sampling temperature; `None` leaves the server's default (vLLM no longer sends one).
    pub temperature: Option<f64>,
    /// Mean arrival rate in requests per second; infinity sends every request at once.
    pub request_rate: f64,
    /// Gamma shape of the gaps between arrivals: 1 is Poisson, lower is burstier, infinity is
    /// evenly spaced.
    pub burstiness: f64,
    /// At most this many requests in flight; `None` is unbounded.
    pub max_concurrency: Option<usize>,
    /// Warm-up requests (the first prompt) sent before measuring; if all of them fail the run
    /// stops with a clear error. vLLM's default is 0 plus one "initial test run"; this 1 is both.
    pub num_warmups: usize,
    /// Stop sending new requests this long after the measured run starts; requests in flight
    /// still finish. `None` sends all `num_prompts`.
    pub max_duration: Option<Duration>,
    /// Limit on one request from connect to last byte (vLLM uses 6 hours).
    pub request_timeout: Duration,
    /// Goodput SLOs; empty leaves `request_goodput` null, as vLLM does.
    pub goodput: Vec<SloTarget>,
    /// Percentiles reported for every latency metric besides the median.
    pub percentiles: Vec<f64>,
    /// Seed for prompts, lengths and arrival times: the same seed gives the same workload.
    pub seed: u64,
    /// The result's `label` (vLLM uses the backend name when none is given).
    pub label: Option<String>,
    /// Draw a progress bar on stderr while running.
    pub show_progress: bool,
}

impl Default for BenchmarkConfig {
    fn default() -> Self {
        BenchmarkConfig {
            base_url: "http://127.0.0.1:8000".to_string(),
            endpoint: EndpointKind::Completions,
            model: None,
            api_key: None,
            num_prompts: 100,
            prompts: PromptConfig::default(),
            ignore_eos: false,
            temperature: None,
            request_rate: f64::INFINITY,
            burstiness: 1.0,
            max_concurrency: None,
            num_warmups: 1,
            max_duration: None,
            request_timeout: Duration::from_secs(6 * 60 * 60),
            goodput: Vec::new(),
            percentiles: vec![90.0, 99.0],
            seed: 0,
            label: None,
            show_progress: false,
        }
    }
}

impl BenchmarkConfig {
    /// Checks ranges and combinations; every message says which setting to change.
    pub fn validate(&self) -> Result<(), Error> {
        let bad = |msg: String| Err(Error::InvalidConfig(msg));
        if self.base_url.starts_with("https://") {
            // The HTTP client is built without TLS (loopback and cluster-internal endpoints are
            // plain HTTP, as vLLM and afd serve them).
            return bad(format!(
                "--base-url '{}' uses https, but afd-loadtest speaks plain http only: point it \
                 at the server's http port (or a local TLS-terminating proxy)",
                self.base_url
            ));
        }
        if !self.base_url.starts_with("http://") {
            return bad(format!(
                "--base-url '{}' must start with http:// (e.g. http://127.0.0.1:8000)",
                self.base_url
            ));
        }
        if self.num_prompts == 0 {
            return bad("--num-prompts must be at least 1".into());
        }
        if self.prompts.output_len == 0 {
            return bad("--output-len must be at least 1".into());
        }
        if !matches!(self.prompts.source, PromptSource::File(_)) && self.prompts.input_len == 0 {
            return bad("--input-len must be at least 1".into());
        }
        if !(0.0..1.0).contains(&self.prompts.range_ratio) {
            return bad(format!(
                "--range-ratio {} must be in [0, 1)",
                self.prompts.range_ratio
            ));
        }
        if self.prompts.vocab_size == 0 {
            return bad("--vocab-size must be at least 1".into());
        }
        if self.endpoint == EndpointKind::Chat && self.prompts.source == PromptSource::TokenIds {
            return bad(
                "the chat endpoint takes text, not token ids: use --prompt-source words or file"
                    .into(),
            );
        }
        if self.request_rate.is_nan() || self.request_rate <= 0.0 {
            return bad(format!(
                "--request-rate {} must be positive (or inf)",
                self.request_rate
            ));
        }
        if self.burstiness.is_nan() || self.burstiness <= 0.0 {
            return bad(format!("--burstiness {} must be positive", self.burstiness));
        }
        if self.max_concurrency == Some(0) {
            return bad("--max-concurrency must be at least 1".into());
        }
        if self.request_timeout.is_zero() {
            return bad("--request-timeout must be positive".into());
        }
        if let Some(p) = self
            .percentiles
            .iter()
            .find(|p| !(p.is_finite() && **p >= 0.0 && **p <= 100.0))
        {
            return bad(format!("percentile {p} must be within [0, 100]"));
        }
        Ok(())
    }

    /// The prompt source after resolving `Auto` for this endpoint.
    pub fn effective_prompt_source(&self) -> PromptSource {
        match (&self.prompts.source, self.endpoint) {
            (PromptSource::Auto, EndpointKind::Completions) => PromptSource::TokenIds,
            (PromptSource::Auto, EndpointKind::Chat) => PromptSource::RandomWords,
            (other, _) => other.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slo_parses_vllm_form() {
        let slo: SloTarget = "tpot:50".parse().unwrap();
        assert_eq!(slo.metric, SloMetric::Tpot);
        assert_eq!(slo.limit_ms, 50.0);
        assert_eq!(slo.to_string(), "tpot:50");
        assert!("itl:5".parse::<SloTarget>().is_err());
        assert!("ttft".parse::<SloTarget>().is_err());
        assert!("ttft:-1".parse::<SloTarget>().is_err());
        assert!("ttft:abc".parse::<SloTarget>().is_err());
    }

    #[test]
    fn validation_rejects_contradictions() {
        let ok = BenchmarkConfig::default();
        assert!(ok.validate().is_ok());
        let chat_ids = BenchmarkConfig {
            endpoint: EndpointKind::Chat,
            prompts: PromptConfig {
                source: PromptSource::TokenIds,
                ..PromptConfig::default()
            },
            ..BenchmarkConfig::default()
        };
        assert!(chat_ids.validate().is_err());
        let zero_rate = BenchmarkConfig {
            request_rate: 0.0,
            ..BenchmarkConfig::default()
        };
        assert!(zero_rate.validate().is_err());
        let bad_ratio = BenchmarkConfig {
            prompts: PromptConfig {
                range_ratio: 1.0,
                ..PromptConfig::default()
            },
            ..BenchmarkConfig::default()
        };
        assert!(bad_ratio.validate().is_err());
        let bad_url = BenchmarkConfig {
            base_url: "127.0.0.1:8000".into(),
            ..BenchmarkConfig::default()
        };
        assert!(bad_url.validate().is_err());
        let tls = BenchmarkConfig {
            base_url: "https://example.invalid".into(),
            ..BenchmarkConfig::default()
        };
        let err = tls.validate().unwrap_err().to_string();
        assert!(err.contains("plain http only"), "{err}");
    }

    #[test]
    fn auto_source_depends_on_endpoint() {
        let mut cfg = BenchmarkConfig::default();
        assert_eq!(cfg.effective_prompt_source(), PromptSource::TokenIds);
        cfg.endpoint = EndpointKind::Chat;
        assert_eq!(cfg.effective_prompt_source(), PromptSource::RandomWords);
        assert_eq!("chat".parse::<EndpointKind>(), Ok(EndpointKind::Chat));
        assert!("embeddings".parse::<EndpointKind>().is_err());
    }
}
