//! Request scheduling.
//!
//! Owns continuous batching (a vLLM-v1-style `schedule()` / `update_from_output()` core with a
//! token budget and chunked prefill), KV-block accounting, preemption, admission and queue limits,
//! and spreading requests over several attention nodes.
//!
//! Must not: do HTTP, know the model's numerics or depend on `gpu-attention`; it drives attention
//! nodes through their step API (the `step` crate).
//!
//! Layout:
//! - [`scheduler`]: the deterministic, I/O-free core of one node ([`Scheduler`], its
//!   [`BlockManager`]); tested with fake model outputs.
//! - `engine`: the thin shell, one OS thread per attention node running
//!   schedule -> free -> step -> update, with commands (submit, abort) over a channel.
//! - [`Router`]: what the server holds. [`Router::submit_all`] admits every sequence of a
//!   client request (its [`GenerationRequest`]s) or none (refusing with [`Error::QueueFull`], or
//!   [`Error::TooManySequences`] when they could never fit), places each on the least-loaded
//!   node and returns a [`RequestStream`] of [`TokenOutput`]s per sequence; dropping a stream
//!   aborts its request and frees its KV blocks at once.
//! - [`stats`]: snapshots for metrics, including the [`AfdStats`] hooks of the disaggregated path.
//! - [`timing`]: the clock the engines stamp with, and on a modeled clock the pacing of each
//!   step to its dilated modeled end ([`Timing`]).
//! - [`fake`]: a deterministic fake attention node for tests without a model.

pub mod config;
mod dispatch;
mod engine;
pub mod error;
pub mod fake;
pub mod scheduler;
pub mod stats;
pub mod timing;

pub use config::{RouterConfig, SchedulerConfig};
pub use dispatch::{GenerationRequest, RequestStream, Router, pick_node};
pub use engine::RequestEvent;
pub use error::{Error, GenerationError};
pub use scheduler::{
    BlockManager, FinishReason, RequestId, Scheduler, SchedulerOutput, SequenceFailure,
    SequenceParams, TokenOutput,
};
pub use stats::{AfdStats, AfdStatsSource, BalanceWindow, NodeStats, RouterStats};
pub use timing::{ClockSnapshot, Dilation, Timing};
