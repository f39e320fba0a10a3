//! The router's errors.

/// What can go wrong when configuring the router or admitting a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The configuration cannot work.
    #[error("invalid router configuration: {0}")]
    Config(String),
    /// The router has no attention node.
    #[error("no attention node: the router needs at least one")]
    NoNodes,
    /// The request itself cannot be served (empty prompt, too long, ...).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// Too many requests are waiting; the client should retry later.
    #[error(
        "the server is busy: {waiting} requests are already waiting (limit {limit}); retry later"
    )]
    QueueFull {
        /// Requests waiting.
        waiting: usize,
        /// The limit (`max_waiting`).
        limit: usize,
    },
    /// The engine of the chosen node has stopped.
    #[error("attention node {node} is not running: {message}")]
    NodeDown {
        /// The node's index.
        node: usize,
        /// Why.
        message: String,
    },
}

/// Why a request failed after it was admitted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GenerationError {
    /// The node failed the step the request was in.
    #[error("attention node {node} failed a step: {message}")]
    Step {
        /// The node's index.
        node: usize,
        /// The node's error.
        message: String,
    },
    /// The router is shutting down.
    #[error("the server is shutting down")]
    Shutdown,
}
