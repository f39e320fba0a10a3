//! The emulation's error type.

/// What can go wrong while setting up or running an emulation.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The settings are inconsistent or name something that is not there.
    #[error("{0}")]
    Config(String),
    /// The planner refused (a profile, a card's share).
    #[error(transparent)]
    Planner(#[from] planner::Error),
    /// The workload or its report failed (prompt file, result files).
    #[error(transparent)]
    Loadtest(#[from] loadtest::Error),
    /// The router's scheduler refused its settings.
    #[error(transparent)]
    Router(#[from] router::Error),
    /// A file could not be written.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// What the OS said.
        source: std::io::Error,
    },
}

/// The emulation's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
