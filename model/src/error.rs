//! The model crate's error type.

use std::path::PathBuf;

/// Everything that can go wrong while reading a checkpoint or running the reference forward.
///
/// Variants name the file and the tensor involved so that a user can tell which part of a
/// checkpoint is broken without a debugger.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// A JSON file (config.json, the shard index, tokenizer_config.json) is not valid JSON or
    /// does not have the fields its kind needs.
    #[error("{path} is not a valid {what}: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// What kind of file it should have been.
        what: &'static str,
        /// The parser's error.
        source: serde_json::Error,
    },
    /// A JSON file parsed but lacks what its kind needs (the shard index without `weight_map`).
    #[error("{path} is not a valid {what}: {message}")]
    JsonContent {
        /// The file.
        path: PathBuf,
        /// What kind of file it should have been.
        what: &'static str,
        /// What is missing.
        message: String,
    },
    /// A JSON file that afd writes (a synthetic checkpoint's config or safetensors header)
    /// could not be serialized.
    #[error("cannot write {path} as JSON: {source}")]
    JsonWrite {
        /// The file being written.
        path: PathBuf,
        /// The serializer's error.
        source: serde_json::Error,
    },
    /// config.json parsed but describes something afd cannot run.
    #[error("{path}: {message}")]
    Config {
        /// The config file.
        path: PathBuf,
        /// What is wrong and what to do.
        message: String,
    },
    /// The anonymous memory that the weights are copied into could not be had.
    #[error(
        "cannot map {bytes} bytes of memory for the weights ({source}): free memory, or keep \
         the weights in the memory-mapped checkpoint (`--no-huge-pages`, deployment key \
         `model.huge_pages = false`)"
    )]
    WeightMemory {
        /// Bytes asked for.
        bytes: usize,
        /// What the OS said.
        source: std::io::Error,
    },
    /// The checkpoint folder has no weights.
    #[error(
        "no weights in {dir}: expected model.safetensors or model.safetensors.index.json \
         (a Hugging Face checkpoint folder, or make one with `afd synth`)"
    )]
    NoWeights {
        /// The checkpoint folder.
        dir: PathBuf,
    },
    /// A safetensors file's header cannot be parsed: the file is corrupt or truncated.
    #[error("{file} is not a valid safetensors file ({source}); it may be truncated or corrupt")]
    SafetensorsHeader {
        /// The file.
        file: PathBuf,
        /// The parser's error.
        source: safetensors::SafeTensorError,
    },
    /// A safetensors file's header parsed but disagrees with its data (a tensor's byte count).
    #[error("{file} is not a valid safetensors file ({message}); it may be truncated or corrupt")]
    Safetensors {
        /// The file.
        file: PathBuf,
        /// What disagrees.
        message: String,
    },
    /// A tensor the family needs is absent.
    #[error("tensor `{tensor}` is missing from the checkpoint in {dir}")]
    MissingTensor {
        /// The checkpoint folder.
        dir: PathBuf,
        /// The tensor name.
        tensor: String,
    },
    /// A tensor has the wrong shape.
    #[error("tensor `{tensor}` in {file} has shape {actual:?}, expected {expected:?}")]
    ShapeMismatch {
        /// The file holding the tensor.
        file: PathBuf,
        /// The tensor name.
        tensor: String,
        /// What config.json implies.
        expected: Vec<usize>,
        /// What the file says.
        actual: Vec<usize>,
    },
    /// A tensor has a dtype that this use does not support.
    #[error("tensor `{tensor}` in {file} has dtype {dtype}, expected one of {expected}")]
    UnsupportedDtype {
        /// The file holding the tensor.
        file: PathBuf,
        /// The tensor name.
        tensor: String,
        /// The dtype found.
        dtype: String,
        /// The dtypes accepted here.
        expected: &'static str,
    },
    /// The checkpoint has no tokenizer where one is needed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// tokenizer.json could not be loaded.
    #[error("tokenizer: {}: {source}", path.display())]
    TokenizerLoad {
        /// The tokenizer.json file.
        path: PathBuf,
        /// The tokenizers crate's error.
        source: tokenizers::Error,
    },
    /// Encoding or decoding with the loaded tokenizer failed.
    #[error("tokenizer: {0}")]
    TokenizerCodec(#[source] tokenizers::Error),
    /// A request to the reference forward is malformed (bad token id, unknown sequence, ...).
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// A tensor operation failed inside candle.
    #[cfg(feature = "forward")]
    #[error("tensor operation failed: {0}")]
    Candle(#[from] candle_core::Error),
}

/// The model crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn config(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Error::Config {
            path: path.into(),
            message: message.into(),
        }
    }
}
