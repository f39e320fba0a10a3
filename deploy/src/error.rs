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
    /// An operating-system call failed (reading or writing a file, finding a port, starting a
    /// runtime); `what` says what was being done and what to check.
    #[error("{what}: {source}")]
    System {
        /// What was being done, in words.
        what: String,
        /// What the OS said.
        source: std::io::Error,
    },
    /// A TOML text (a deployment file, a device or network profile) does not parse or lacks a
    /// field.
    #[error("{what}: {source}")]
    Toml {
        /// What the text should have been.
        what: &'static str,
        /// The TOML parser's error.
        source: toml::de::Error,
    },
    /// A deployment could not be written back as TOML.
    #[error("cannot write the deployment as TOML: {0}")]
    TomlWrite(#[source] toml::ser::Error),
    /// The Kubernetes manifests could not be written as YAML.
    #[error("cannot write YAML: {0}")]
    Yaml(#[source] serde_norway::Error),
    /// A card assignment could not be written as JSON for the card.
    #[error("cannot write the card assignment as JSON: {0}")]
    AssignmentJson(#[source] serde_json::Error),
    /// A profile's `assumed` or `calibrated` list names a key the profile does not set.
    #[error("{0}")]
    ProfileKey(#[from] corsair_ffn::profile::UnsetKey),
    /// The card crate refused (the card profile, the placement, compiling a card's share);
    /// `what` says where.
    #[error("{what}: {source}")]
    Cards {
        /// Where, in words (a file, a deployment key, the step that failed).
        what: String,
        /// The card crate's error (boxed: it is large).
        source: Box<corsair_ffn::Error>,
    },
    /// The card crate refused (placing the experts on the cards).
    #[error(transparent)]
    Corsair(Box<corsair_ffn::Error>),
    /// A card's control-plane call (or a check made before one) failed.
    #[error(transparent)]
    Service(Box<corsair_ffn::service::ServiceError>),
    /// A control-plane connection to `url` could not be made (refused, no TLS handshake, a
    /// certificate not valid for the expected node).
    #[error("{url}: {source}{}", std::error::Error::source(source).map(|s| format!(": {s}")).unwrap_or_default())]
    Connect {
        /// The address dialed.
        url: String,
        /// tonic's error (its own source, shown after it, says what failed underneath).
        source: tonic::transport::Error,
    },
    /// Card `card` could not be reached over the control plane.
    #[error(
        "card {card}: cannot reach the card at {source}; is `afd card --id {card}` running there?"
    )]
    CardUnreachable {
        /// The card's index.
        card: usize,
        /// Why (boxed: the error type is recursive).
        source: Box<Error>,
    },
    /// A card's address is wrong; `what` says which address.
    #[error("card {card}: {what}: {source}")]
    CardLink {
        /// The card's index.
        card: usize,
        /// What was being done, in words.
        what: String,
        /// The address parser's error.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// An in-process card refused or failed its shard.
    #[error("card {card}: {source}")]
    CardService {
        /// The card's index.
        card: usize,
        /// What it said (boxed: it is large).
        source: Box<corsair_ffn::service::ServiceError>,
    },
    /// The dispatch placement does not match the model.
    #[error(transparent)]
    DispatchPlacement(#[from] gpu_attention::dispatch::PlacementError),
    /// The attention node could not be built.
    #[error(transparent)]
    Node(#[from] step::StepError),
    /// The planner refused (a profile, a card's share, a prediction).
    #[error(transparent)]
    Planner(#[from] planner::Error),
    /// A part of a deployment is wrong, named with where it came from (a file, a key).
    #[error("{context}: {source}")]
    In {
        /// Where (the deployment file, the profile key and value).
        context: String,
        /// What is wrong there.
        source: Box<Error>,
    },
}

impl From<corsair_ffn::Error> for Error {
    fn from(e: corsair_ffn::Error) -> Self {
        Error::Corsair(Box::new(e))
    }
}

impl From<corsair_ffn::service::ServiceError> for Error {
    fn from(e: corsair_ffn::service::ServiceError) -> Self {
        Error::Service(Box::new(e))
    }
}

impl Error {
    /// A failed OS call, saying what was being done.
    pub(crate) fn system(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
        let what = what.into();
        move |source| Error::System { what, source }
    }

    /// This error, said to have happened in `context`.
    pub(crate) fn within(self, context: impl Into<String>) -> Error {
        Error::In {
            context: context.into(),
            source: Box::new(self),
        }
    }
}

/// The deploy crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
