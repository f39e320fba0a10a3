//! What an attention node knows about its cards, for admission, `/health` and `/metrics`.
//!
//! A node that depends on cards keeps each card's state ([`CardState`]) and says whether it can
//! serve new requests ([`NodeHealth::unserved`]): it cannot while a card it needs is down and no
//! replica covers it. The router reads this through a [`HealthSource`] handle, from any thread,
//! without waiting for the node's engine loop.

/// A card, as the attention node sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CardState {
    /// Answering heartbeats and serving its shard.
    Up,
    /// Not answering (or its data path failed); steps that need it fail at once.
    Down,
    /// Answering again; its shard is being loaded or attached anew.
    Rejoining,
}

impl CardState {
    /// `up`, `down` or `rejoining`.
    pub fn as_str(self) -> &'static str {
        match self {
            CardState::Up => "up",
            CardState::Down => "down",
            CardState::Rejoining => "rejoining",
        }
    }
}

impl std::fmt::Display for CardState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for CardState {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "up" => Ok(CardState::Up),
            "down" => Ok(CardState::Down),
            "rejoining" => Ok(CardState::Rejoining),
            other => Err(format!("unknown card state `{other}`")),
        }
    }
}

/// One card's state and history.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CardHealth {
    /// The card's index.
    pub card: usize,
    /// Its state now.
    pub state: CardState,
    /// Why it is down or rejoining (empty while up).
    pub reason: String,
    /// How long it has been in this state.
    pub for_seconds: f64,
    /// Times it went down since the node started.
    pub failures: u64,
    /// Times it came back (its shard loaded again) since the node started.
    pub rejoins: u64,
}

/// An attention node's view of its cards.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct NodeHealth {
    /// Every card, by index (empty for a node without cards).
    pub cards: Vec<CardHealth>,
    /// Why the node cannot serve new requests now (a card it needs is down and nothing covers
    /// it); `None` when it can, possibly with cards down that replicas cover.
    pub unserved: Option<String>,
}

impl NodeHealth {
    /// Cards that are not up.
    pub fn not_up(&self) -> impl Iterator<Item = &CardHealth> {
        self.cards.iter().filter(|c| c.state != CardState::Up)
    }
}

/// A shared handle on a node's [`NodeHealth`], readable from any thread.
pub trait HealthSource: Send + Sync {
    /// The state now.
    fn health(&self) -> NodeHealth;
}
