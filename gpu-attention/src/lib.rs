//! The attention node.
//!
//! Owns the layers up to the MoE input (norms, attention, the paged KV cache), top-k routing,
//! per-layer dispatch to the cards and combination of their partial sums over JetStream,
//! micro-batch overlap, the LM-head proposal merge and sampling: the concrete nodes behind the
//! step API ([`step::AttentionNode`], in the `step` crate) that the router drives.
//!
//! Must not: depend on `corsair-ffn`; it knows the cards only through `proto` and `jetstream`.

pub mod cards;
pub mod device;
pub mod dispatch;
pub mod driver;
pub mod fabric;
pub mod kv_cache;
pub mod merge;
pub mod monolithic;
pub mod node;
pub mod remote;
pub mod sampler;

pub use device::AttentionDevice;
pub use monolithic::MonolithicNode;
pub use node::{CardLayout, DisaggregatedNode, MicroBatches, NodeConfig};
