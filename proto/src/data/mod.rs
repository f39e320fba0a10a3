//! Data-plane layouts: the bytes the attention node and the cards write into each other's
//! JetStream regions, with checked encode and decode (no I/O, no panics on any input).
//!
//! Every message is a 32-byte [`Header`] (its last 4 bytes the card shard version the message is
//! for) followed by a payload whose size the header fixes.
//! Integers and floats are little-endian.
//!
//! | kind | message | payload |
//! |---|---|---|
//! | 1 | [`MoeDispatch`] (attention -> card) | rows `[tokens, hidden]` (dtype), expert ids `[tokens, slots]` u32 (`NO_EXPERT` = empty slot), weights `[tokens, slots]` f32 |
//! | 2 | dense dispatch (attention -> card) | rows `[tokens, hidden]` |
//! | 3 | partial sums (card -> attention) | rows `[tokens, hidden]` |
//! | 4 | [`LmHeadDispatch`] (attention -> card) | normed rows `[tokens, hidden]`, then per row a [`RowSampling`] (32 bytes: temperature f32, flags u32, seed u64, position u64, target u32, 4 zero bytes); `slots` = candidates wanted per row |
//! | 5 | `LmHeadProposals` (card -> attention) | per row a [`Proposal`]: lse f64, scaled lse f64, winner score f64, winner u32, winner logit f32, shard rows u32, target logit f32 (NaN: the row has no target in the shard), then `slots` candidates (logit f32, id u32; padding: id `u32::MAX`) |
//! | 6 | error (card -> attention) | UTF-8 message of `tokens` bytes |

mod codec;
#[cfg(test)]
mod tests;

pub use codec::*;

/// First two bytes of every data-plane message.
pub const MAGIC: [u8; 2] = *b"AF";
/// The layout version this crate speaks.
pub const VERSION: u8 = 4;
/// Bytes of the header.
pub const HEADER_LEN: usize = 32;
/// Expert id marking an unused slot.
pub const NO_EXPERT: u32 = u32::MAX;
/// `layer` value of LM-head messages.
pub const LM_HEAD_LAYER: u16 = u16::MAX;

/// What a message carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// Hidden rows with their local (expert, weight) slots, for an MoE layer.
    MoeDispatch,
    /// Hidden rows for a dense FFN layer split by intermediate columns.
    DenseDispatch,
    /// A card's partial sums for the rows it was sent.
    PartialSums,
    /// Normed final hidden rows and per-row sampling settings for the LM-head shards.
    LmHeadDispatch,
    /// A card's LM-head proposals.
    LmHeadProposals,
    /// A card could not process a message; the payload says why.
    Error,
}

impl Kind {
    fn to_byte(self) -> u8 {
        match self {
            Kind::MoeDispatch => 1,
            Kind::DenseDispatch => 2,
            Kind::PartialSums => 3,
            Kind::LmHeadDispatch => 4,
            Kind::LmHeadProposals => 5,
            Kind::Error => 6,
        }
    }

    fn from_byte(b: u8) -> Option<Self> {
        Some(match b {
            1 => Kind::MoeDispatch,
            2 => Kind::DenseDispatch,
            3 => Kind::PartialSums,
            4 => Kind::LmHeadDispatch,
            5 => Kind::LmHeadProposals,
            6 => Kind::Error,
            _ => return None,
        })
    }
}

/// Element type of hidden rows on the wire.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum WireDtype {
    /// 32-bit float: the disaggregated path is then bitwise the reference's arithmetic.
    #[default]
    F32,
    /// bfloat16: half the bytes; results are measured against the reference, not assumed equal.
    Bf16,
}

impl WireDtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            WireDtype::F32 => 4,
            WireDtype::Bf16 => 2,
        }
    }

    fn to_byte(self) -> u8 {
        match self {
            WireDtype::F32 => 0,
            WireDtype::Bf16 => 1,
        }
    }

    fn from_byte(b: u8) -> Option<Self> {
        match b {
            0 => Some(WireDtype::F32),
            1 => Some(WireDtype::Bf16),
            _ => None,
        }
    }
}

impl std::str::FromStr for WireDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(WireDtype::F32),
            "bf16" => Ok(WireDtype::Bf16),
            other => Err(format!(
                "unknown wire dtype `{other}`: expected f32 or bf16"
            )),
        }
    }
}

/// The fixed part of every message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// What follows.
    pub kind: Kind,
    /// The attention node's step counter.
    pub step: u64,
    /// Decoder layer, or [`LM_HEAD_LAYER`].
    pub layer: u16,
    /// Micro-batch within the step.
    pub micro_batch: u8,
    /// Element type of hidden rows.
    pub dtype: WireDtype,
    /// Rows (tokens), or the error message's byte length.
    pub tokens: u32,
    /// Width of a row.
    pub hidden: u32,
    /// Expert slots per row (MoE), or candidates per row (LM head).
    pub slots: u32,
    /// The card shard version the message is for (an expert move adds one; the reply
    /// repeats it).
    pub shard: u32,
}

/// Why bytes are not a valid message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Fewer bytes than the header.
    #[error("message of {0} bytes is shorter than the {HEADER_LEN}-byte header")]
    Short(usize),
    /// Not an afd data-plane message.
    #[error("bad magic {0:?}: not an afd data-plane message")]
    Magic([u8; 2]),
    /// A version this build does not speak.
    #[error(
        "data-plane version {0}, this build speaks {VERSION}: run the same afd version on every node"
    )]
    Version(u8),
    /// Unknown message kind.
    #[error("unknown message kind {0}")]
    Kind(u8),
    /// Unknown dtype.
    #[error("unknown wire dtype {0}")]
    Dtype(u8),
    /// The payload is not the size the header implies.
    #[error("{kind:?} payload has {actual} bytes, its header implies {expected}")]
    Length {
        /// The kind.
        kind: Kind,
        /// What the header implies (saturating).
        expected: usize,
        /// What is there.
        actual: usize,
    },
    /// A different message than the receiver expected.
    #[error("expected a {expected:?} message, got {actual:?}")]
    UnexpectedKind {
        /// Expected kind.
        expected: Kind,
        /// Received kind.
        actual: Kind,
    },
    /// An error message that is not UTF-8.
    #[error("error message is not UTF-8")]
    Utf8,
}

/// Bits of the step counter an [`Immediate`] carries (its low bits; the top of the 64).
pub const IMMEDIATE_STEP_BITS: u32 = 40;
/// The step bits an [`Immediate`] keeps: a step counter `s` comes back as
/// `s & IMMEDIATE_STEP_MASK`.
pub const IMMEDIATE_STEP_MASK: u64 = (1 << IMMEDIATE_STEP_BITS) - 1;
/// Where the step starts in a packed immediate: above the layer and the micro-batch.
pub const IMMEDIATE_STEP_SHIFT: u32 = IMMEDIATE_LAYER_SHIFT + u16::BITS;
/// Where the layer starts in a packed immediate: above the micro-batch.
pub const IMMEDIATE_LAYER_SHIFT: u32 = u8::BITS;

/// The 64-bit immediate of a JetStream write: (step, layer, micro-batch), so a completion says
/// what landed without reading the region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Immediate {
    /// Step counter (its low [`IMMEDIATE_STEP_BITS`] bits are kept).
    pub step: u64,
    /// Layer, or [`LM_HEAD_LAYER`].
    pub layer: u16,
    /// Micro-batch.
    pub micro_batch: u8,
}

impl Immediate {
    /// Packs into 64 bits: step in the top 40, layer in the next 16, micro-batch in the low 8.
    pub fn pack(self) -> u64 {
        (Self::wire_step(self.step) << IMMEDIATE_STEP_SHIFT)
            | ((self.layer as u64) << IMMEDIATE_LAYER_SHIFT)
            | self.micro_batch as u64
    }

    /// Unpacks what [`Self::pack`] made.
    pub fn unpack(v: u64) -> Self {
        Immediate {
            step: v >> IMMEDIATE_STEP_SHIFT,
            layer: (v >> IMMEDIATE_LAYER_SHIFT) as u16,
            micro_batch: v as u8,
        }
    }

    /// The step an immediate carries for step counter `step` (what [`Self::unpack`] gives
    /// back), to compare a completion's step with a counter.
    pub fn wire_step(step: u64) -> u64 {
        step & IMMEDIATE_STEP_MASK
    }
}

/// Per-row sampling settings sent to the LM-head shards.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowSampling {
    /// Temperature; 0 means greedy (no Gumbel draw needed).
    pub temperature: f32,
    /// The request's seed.
    pub seed: u64,
    /// Position of the token being sampled (the Gumbel counter).
    pub position: u64,
    /// Whether the row's log-probabilities are wanted: only then does a card compute its
    /// shard's log-sum-exp (NaN in the proposal otherwise).
    pub logprobs: bool,
    /// Whether the row samples with top-k, top-p or min-p: only then does a card compute its
    /// shard's log-sum-exp of the scaled logits (NaN in the proposal otherwise).
    pub filtered: bool,
    /// A token whose logit the card holding it returns ([`Proposal::target_logit`]): the
    /// prompt token a scored row asks the logprob of (prompt logprobs). `None` for sampled rows.
    pub target: Option<u32>,
}

/// Flag bit of [`RowSampling::logprobs`] in the encoded row.
pub const ROW_FLAG_LOGPROBS: u32 = 1;
/// Flag bit of [`RowSampling::filtered`] in the encoded row.
pub const ROW_FLAG_FILTERED: u32 = 2;
/// Flag bit saying the encoded row carries a [`RowSampling::target`].
pub const ROW_FLAG_TARGET: u32 = 4;

/// Bytes of one encoded [`RowSampling`].
pub const ROW_SAMPLING_LEN: usize = 32;

/// One LM-head candidate: a token and its logit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    /// Logit.
    pub logit: f32,
    /// Token id (global vocabulary index).
    pub token: u32,
}

/// A shard's Gumbel-max winner.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Winner {
    /// Its vocabulary id.
    pub token: u32,
    /// Its logit (so its logprob is known even when it is not a candidate).
    pub logit: f32,
    /// Its Gumbel score (`logit / T + gumbel`).
    pub score: f64,
}

/// One row's proposal from one card's vocabulary shard. On the wire an absent value is NaN
/// (and an absent winner the id `u32::MAX`); decoded, absence is `None`.
#[derive(Debug, Clone, PartialEq)]
pub struct Proposal {
    /// `ln(sum(exp(logit)))` over the shard, for rows that want logprobs.
    pub log_sum_exp: Option<f64>,
    /// `ln(sum(exp(logit / T)))` over the shard, `T` the row's temperature, for sampled rows
    /// with top-k, top-p or min-p filters: with every card's, the probability of any candidate
    /// under the distribution the row samples from.
    pub scaled_log_sum_exp: Option<f64>,
    /// The shard's Gumbel-max winner, for sampled rows.
    pub winner: Option<Winner>,
    /// Vocabulary rows of the shard: the candidates are all of them when there are this many.
    pub shard_rows: u32,
    /// The logit of the row's [`RowSampling::target`], from the card whose shard holds it;
    /// `None` from the others and for rows without a target. (On the wire `None` is NaN, so a
    /// NaN logit reads as absent and the row is then reported unscored.)
    pub target_logit: Option<f32>,
    /// The shard's best candidates, highest logit first (lowest id first on ties).
    pub candidates: Vec<Candidate>,
}

/// Bytes of a [`Proposal`] before its candidates.
pub const PROPOSAL_FIXED_LEN: usize = 40;

/// Bytes of one encoded [`Proposal`] with `slots` candidates.
pub fn proposal_len(slots: usize) -> usize {
    PROPOSAL_FIXED_LEN.saturating_add(slots.saturating_mul(8))
}
