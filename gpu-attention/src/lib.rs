//! The attention node.
//!
//! Owns the layers up to the MoE input (norms, attention, the paged KV cache), top-k routing,
//! the dispatch planner, per-layer dispatch to the cards and combination of their partial sums
//! over JetStream, the cards' up/down board, micro-batch overlap, the LM-head proposal merge and
//! sampling: the concrete nodes behind the step API ([`step::AttentionNode`], in the `step`
//! crate) that the router drives (disaggregated, monolithic, the GPU-only baseline, and
//! [`remote`] over tonic). The numerics run on the host path (afd's CPU kernels) or the device
//! path ([`device`]: candle tensors on an NVIDIA GPU, with the CUDA kernels of `kernels/afd.cu`
//! under the `cuda` feature, or on candle's CPU device for tests).
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
mod prefix;
pub mod remote;
pub mod sampler;

pub use device::AttentionDevice;
pub use monolithic::MonolithicNode;
pub use node::{CardLayout, DisaggregatedNode, MicroBatches, NodeConfig};
