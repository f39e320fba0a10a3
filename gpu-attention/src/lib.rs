//! The attention node.
//!
//! Owns the layers up to the MoE input (norms, attention, the paged KV cache), top-k routing,
//! per-layer dispatch to the cards and combination of their partial sums over JetStream,
//! micro-batch overlap, the LM-head proposal merge and sampling, and the step API
//! ([`step::AttentionNode`]) the router drives; [`compute::on_own_pool`] puts the thread that
//! steps a node at the head of its own compute pool.
//!
//! Must not: depend on `corsair-ffn`; it knows the cards only through `proto` and `jetstream`.

pub mod compute;
pub mod dispatch;
pub mod driver;
pub mod fabric;
pub mod kv_cache;
pub mod merge;
pub mod monolithic;
pub mod node;
pub mod remote;
pub mod sampler;
pub mod step;

pub use monolithic::MonolithicNode;
pub use node::{CardLayout, DisaggregatedNode, MicroBatches, NodeConfig};
pub use step::{
    AttentionNode, KvCapacity, Penalties, SampleRequest, SampledToken, SeqId, StepBatch, StepEntry,
    StepError, StepOutput,
};
