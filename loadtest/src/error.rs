//! The crate's error type. Failures of single benchmark requests are not errors: they are
//! recorded in the result (`failed`, `errors`). An `Error` means the benchmark as a whole could
//! not run or its output could not be written.

use std::path::PathBuf;

/// Everything that can stop a benchmark run.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A setting is out of range or settings contradict each other.
    #[error("invalid setting: {0}")]
    InvalidConfig(String),

    /// The server could not be reached or did not answer `GET /v1/models` usefully.
    #[error(
        "could not get the model list from {url}: {reason}. Check that the server is running and \
         --base-url is right, or pass --model to skip the lookup"
    )]
    ModelLookup {
        /// The `/v1/models` URL that was asked.
        url: String,
        /// What went wrong, in words.
        reason: String,
        /// The failure behind it, when another crate reported one.
        #[source]
        cause: Option<Cause>,
    },

    /// Every warm-up request failed, so the measured run would only record failures.
    #[error(
        "all {attempted} warm-up request(s) to {url} failed; the first failure: {reason}. \
         Check that the server is running and serves model '{model}' on this endpoint \
         (or pass --num-warmups 0 to measure anyway)"
    )]
    WarmupFailed {
        /// The request URL.
        url: String,
        /// The model name sent.
        model: String,
        /// How many warm-up requests were sent.
        attempted: usize,
        /// The first failure's reason.
        reason: String,
    },

    /// The HTTP client could not be built (a TLS or proxy setting of the machine).
    #[error("could not build the HTTP client: {0}")]
    HttpClient(String),

    /// A prompt file could not be read or held no prompts.
    #[error("prompt file {path}: {reason}")]
    PromptFile {
        /// The file given with `--prompt-file`.
        path: PathBuf,
        /// What went wrong.
        reason: String,
        /// The failure behind it, when another crate reported one.
        #[source]
        cause: Option<Cause>,
    },

    /// A result, table or plot file could not be written.
    #[error("could not write {path}: {reason}")]
    Output {
        /// The file or folder that could not be written.
        path: PathBuf,
        /// What went wrong.
        reason: String,
        /// The failure behind it, when another crate reported one.
        #[source]
        cause: Option<Cause>,
    },

    /// A result file given to `compare` could not be read or is not a result.
    #[error(
        "could not use {path} as a benchmark result: {reason}. Pass per-run result JSON files \
         (afd-loadtest's or vllm bench serve's), sweep summaries, or folders of them"
    )]
    CompareInput {
        /// The file or folder.
        path: PathBuf,
        /// What was wrong with it.
        reason: String,
        /// The failure behind it, when another crate reported one.
        #[source]
        cause: Option<Cause>,
    },

    /// The results given to `compare` cannot be compared as asked.
    #[error("cannot compare: {0}")]
    Compare(String),

    /// Drawing a plot failed.
    #[error("could not draw plot {path}: {reason}")]
    Plot {
        /// The plot file.
        path: PathBuf,
        /// What went wrong.
        reason: String,
        /// The failure behind it, when another crate reported one.
        #[source]
        cause: Option<Cause>,
    },
}

/// A failure another crate reported (the OS, serde_json, plotters, the HTTP client), kept as
/// the `source()` of an [`Error`] whose message already says what it said.
pub type Cause = Box<dyn std::error::Error + Send + Sync>;

impl Error {
    /// An `Output` error for `path`, keeping the error that stopped the write as the cause.
    pub(crate) fn output(
        path: impl Into<PathBuf>,
        cause: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Error::Output {
            path: path.into(),
            reason: cause.to_string(),
            cause: Some(Box::new(cause)),
        }
    }
}
