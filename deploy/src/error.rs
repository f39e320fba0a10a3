//! The deploy crate's error type.

/// What can go wrong while assembling or running a deployment.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The deployment settings are inconsistent.
    #[error("{0}")]
    Config(String),
    /// A card refused or failed.
    #[error("card {card}: {message}")]
    Card {
        /// The card's index.
        card: usize,
        /// What it said.
        message: String,
    },
    /// The model could not be read.
    #[error(transparent)]
    Model(#[from] model::Error),
    /// The data plane failed.
    #[error("data plane: {0}")]
    Transport(#[from] jetstream::Error),
    /// An I/O problem outside the data plane.
    #[error("{0}")]
    Io(String),
}

/// The deploy crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
