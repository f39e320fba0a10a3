//! The card's error type.

use crate::sanitizer::Finding;

/// Everything that can go wrong while compiling a card's share, binding its weights or
/// running it. Messages say what was wrong and what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The hardware profile is malformed.
    #[error("hardware profile: {0}")]
    Profile(String),
    /// The hardware profile is not valid TOML or does not have a profile's fields.
    #[error("hardware profile: {what}: {source}")]
    ProfileToml {
        /// What the text failed to be ("not a valid profile", "not valid TOML").
        what: &'static str,
        /// The TOML parser's error.
        source: toml::de::Error,
    },
    /// A list of the hardware profile names a key the profile does not set.
    #[error("hardware profile: {0}")]
    ProfileKey(#[from] crate::profile::UnsetKey),
    /// A card assignment does not match the model (unknown expert, bad range, ...).
    #[error("card assignment: {0}")]
    Assignment(String),
    /// The model shape cannot be compiled with these options.
    #[error("cannot compile: {0}")]
    Unsupported(String),
    /// The checkpoint's config.json is not JSON (read for its stored formats).
    #[error("cannot compile: config.json is not valid JSON: {0}")]
    ConfigJson(#[source] serde_json::Error),
    /// The card's share does not fit its memory.
    #[error("{0}")]
    DoesNotFit(Box<crate::compiler::FitError>),
    /// The sanitizer found problems in a compiled program.
    #[error(
        "the sanitizer rejected the program for card {card} ({} finding(s)); first: {}",
        findings.len(),
        findings.first().map(|f| f.to_string()).unwrap_or_default()
    )]
    Sanitizer {
        /// The card.
        card: usize,
        /// Everything found.
        findings: Vec<Finding>,
    },
    /// Weights handed to a card do not match its program.
    #[error("weights: {0}")]
    Weights(String),
    /// A request to a card is malformed (wrong row count, unknown layer, foreign expert...).
    #[error("invalid request: {0}")]
    Request(String),
    /// The executor's thread pool could not be started (the machine is out of threads).
    #[error("cannot start the executor's threads: {0}")]
    ExecutorThreads(#[source] rayon::ThreadPoolBuildError),
    /// The model crate failed.
    #[error(transparent)]
    Model(#[from] model::Error),
}

/// The card's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
