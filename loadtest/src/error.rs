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
    },

    /// A result, table or plot file could not be written.
    #[error("could not write {path}: {reason}")]
    Output {
        /// The file or folder that could not be written.
        path: PathBuf,
        /// What went wrong.
        reason: String,
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
    },
}

impl Error {
    /// An `Output` error for `path` from any displayable cause.
    pub(crate) fn output(path: impl Into<PathBuf>, reason: impl std::fmt::Display) -> Self {
        Error::Output {
            path: path.into(),
            reason: reason.to_string(),
        }
    }
}
