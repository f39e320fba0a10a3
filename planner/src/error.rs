//! The planner's error type.

/// What can go wrong while planning.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The target's settings are inconsistent, or a prediction is impossible.
    #[error("{0}")]
    Config(String),
    /// A profile's TOML does not parse or lacks a field.
    #[error("{what}: {source}")]
    Toml {
        /// What the text should have been.
        what: &'static str,
        /// The TOML parser's error.
        source: toml::de::Error,
    },
    /// A profile's `assumed` or `calibrated` list names a key the profile does not set.
    #[error("{0}")]
    ProfileKey(#[from] corsair_ffn::profile::UnsetKey),
    /// The card crate refused (the card profile, the placement, compiling a card's share);
    /// `what` says where.
    #[error("{what}: {source}")]
    Cards {
        /// Where, in words.
        what: String,
        /// The card crate's error (boxed: it is large).
        source: Box<corsair_ffn::Error>,
    },
    /// The model's configuration could not be read.
    #[error(transparent)]
    Model(#[from] model::Error),
    /// Something is wrong in a named place (a file, a profile).
    #[error("{context}: {source}")]
    In {
        /// Where.
        context: String,
        /// What is wrong there.
        source: Box<Error>,
    },
}

impl Error {
    /// This error, said to have happened in `context`.
    pub fn within(self, context: impl Into<String>) -> Error {
        Error::In {
            context: context.into(),
            source: Box::new(self),
        }
    }
}

/// The planner's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
