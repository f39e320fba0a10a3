//! Whether a deployment keeps a second copy of every expert (`cards.replicate_experts`).
//!
//! With one copy, a step computes each expert on the one card that holds it: a decode token's
//! top-k experts often land on the same card, which then works while the others wait. With a
//! copy of every expert on the card after its primary, each step spreads its experts evenly
//! over their holders, and a card's loss costs no expert. The price is the experts' memory
//! twice, so `auto` (the default) replicates only where the copies fit: in every card's SRAM
//! without spilling to LPDDR, and, for cards simulated in this process, in half of the host's
//! available memory.

use corsair_ffn::assignment::{ExpertReplica, PlacementOptions};
use corsair_ffn::compiler::{CompileOptions, StoredFormats, compile_deployment};
use corsair_ffn::{HardwareProfile, report};
use model::ModelConfig;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// `cards.replicate_experts` / `--replicate-experts`: `auto`, `true` or `false`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReplicateExperts {
    /// Replicate where the copies fit (see the module doc).
    #[default]
    Auto,
    /// Always replicate (the deployment fails where the copies do not fit).
    Always,
    /// Never replicate.
    Never,
}

impl std::str::FromStr for ReplicateExperts {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(ReplicateExperts::Auto),
            "true" | "on" => Ok(ReplicateExperts::Always),
            "false" | "off" => Ok(ReplicateExperts::Never),
            other => Err(format!(
                "unknown replicate_experts `{other}`: expected auto, true or false"
            )),
        }
    }
}

impl std::fmt::Display for ReplicateExperts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ReplicateExperts::Auto => "auto",
            ReplicateExperts::Always => "true",
            ReplicateExperts::Never => "false",
        })
    }
}

impl Serialize for ReplicateExperts {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            ReplicateExperts::Auto => s.serialize_str("auto"),
            ReplicateExperts::Always => s.serialize_bool(true),
            ReplicateExperts::Never => s.serialize_bool(false),
        }
    }
}

impl<'de> Deserialize<'de> for ReplicateExperts {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Written {
            Flag(bool),
            Word(String),
        }
        match Written::deserialize(d)? {
            Written::Flag(true) => Ok(ReplicateExperts::Always),
            Written::Flag(false) => Ok(ReplicateExperts::Never),
            Written::Word(w) => w.parse().map_err(serde::de::Error::custom),
        }
    }
}

/// What [`choose`] decided, and why (for the start-up log and `afd plan`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicationChoice {
    /// Whether every expert gets a second copy.
    pub every_expert: bool,
    /// The reason, in words.
    pub reason: String,
}

/// What [`choose`] needs to know about the cards.
pub struct CardsToFit<'a> {
    /// The model's shape.
    pub model: &'a ModelConfig,
    /// Its stored weight formats.
    pub stored: &'a StoredFormats,
    /// How the cards compile their shares (its `allow_spill` is ignored: copies that only
    /// fit by spilling are not worth their memory).
    pub options: &'a CompileOptions,
    /// The cards' hardware.
    pub profile: &'a HardwareProfile,
    /// Number of cards.
    pub cards: usize,
    /// The replicas listed by hand.
    pub listed: &'a [ExpertReplica],
    /// Bytes of memory this host has available, where the cards keep their weights in it
    /// (cards simulated in this process); `None` for cards elsewhere.
    pub host_available: Option<u64>,
}

/// Decides `setting` for the deployment `cards` describes. `Always` and `Never` are taken as
/// given; `Auto` compiles every card's share with the copies and replicates only where each
/// fits in SRAM and, with `host_available`, their weights together take at most half of it.
pub fn choose(setting: ReplicateExperts, cards: &CardsToFit<'_>) -> ReplicationChoice {
    let decided = |every_expert: bool, reason: String| ReplicationChoice {
        every_expert,
        reason,
    };
    match setting {
        ReplicateExperts::Always => return decided(true, "cards.replicate_experts = true".into()),
        ReplicateExperts::Never => return decided(false, "cards.replicate_experts = false".into()),
        ReplicateExperts::Auto => {}
    }
    if cards.cards < 2 {
        return decided(false, "one card holds every expert already".into());
    }
    if cards.model.moe.is_none() {
        return decided(false, "the model has no experts".into());
    }
    let placement = PlacementOptions {
        cards: cards.cards,
        replicas: ExpertReplica::placed(cards.listed.to_vec(), true, cards.model),
    };
    let options = CompileOptions {
        allow_spill: false,
        ..cards.options.clone()
    };
    // A share that does not compile with the copies for any other reason does not compile
    // without them either: that error is the deployment's to report, not this choice's.
    let compiled = match compile_deployment(
        cards.model,
        cards.stored,
        &placement,
        &options,
        cards.profile,
    ) {
        Ok(compiled) => compiled,
        Err(e) => return decided(false, format!("the copies could not be placed: {e}")),
    };
    let mut bytes = 0u64;
    for c in compiled {
        match c {
            Ok(c) => bytes += report::sram_needed(&c.program),
            Err(corsair_ffn::Error::DoesNotFit(_)) => {
                return decided(
                    false,
                    "a copy of every expert would not fit in the cards' SRAM".into(),
                );
            }
            Err(e) => return decided(false, format!("the copies could not be compiled: {e}")),
        }
    }
    if let Some(available) = cards.host_available
        && bytes > available / 2
    {
        return decided(
            false,
            format!(
                "the cards' weights with a copy of every expert ({}) would take more than half \
                 of this host's available memory ({})",
                report::human_bytes(bytes),
                report::human_bytes(available)
            ),
        );
    }
    decided(
        true,
        format!(
            "a copy of every expert fits: {} of weights and buffers on {} cards",
            report::human_bytes(bytes),
            cards.cards
        ),
    )
}

#[cfg(test)]
mod tests;
