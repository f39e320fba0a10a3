//! The router's errors.

/// What can go wrong when configuring the router or admitting a request.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The configuration cannot work.
    #[error("invalid router configuration: {0}")]
    Config(String),
    /// The router has no attention node.
    #[error("no attention node: the router needs at least one")]
    NoNodes,
    /// A node's engine thread could not be started (the machine is out of threads or memory).
    #[error("cannot start engine thread {node}: {source}")]
    EngineThread {
        /// The node's index.
        node: usize,
        /// What the OS said.
        source: std::io::Error,
    },
    /// The request itself cannot be served (empty prompt, too long, ...).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// Too many requests are waiting for this one's sequences to join them now; the client
    /// should retry later.
    #[error(
        "the server is busy: {waiting} sequences are already waiting (limit {limit}) and this \
         request needs {asked} more; retry later"
    )]
    QueueFull {
        /// Sequences waiting.
        waiting: usize,
        /// Sequences the refused request needed.
        asked: usize,
        /// The limit (`max_waiting`).
        limit: usize,
    },
    /// A request has more sequences (prompts x `n`) than admission can ever take at once:
    /// retrying cannot help, the request must be split.
    #[error(
        "this request needs {sequences} sequences (prompts x n), more than the server admits \
         at once (max_waiting {limit}); send at most {limit} prompts x n per request, or raise \
         --max-waiting"
    )]
    TooManySequences {
        /// Sequences the request needs.
        sequences: usize,
        /// The limit (`max_waiting`).
        limit: usize,
    },
    /// No attention node can serve now: a card they need is down and nothing covers it.
    #[error("{message}")]
    CardsDown {
        /// Why, naming the card (from the node's health).
        message: String,
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
    /// The node could not finish the step for want of a card (down, stalled, unreachable):
    /// the request may succeed once the card is back or covered.
    #[error("attention node {node} could not finish a step: {message}")]
    Unavailable {
        /// The node's index.
        node: usize,
        /// The node's error, naming the card.
        message: String,
    },
    /// The router is shutting down.
    #[error("the server is shutting down")]
    Shutdown,
}
