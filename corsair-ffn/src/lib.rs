//! The simulated d-Matrix Corsair card.
//!
//! Owns the hardware profile, the compiler (placement, tiling, memory plan) for a card's share of
//! the experts, dense FFN slices and LM-head rows, the sanitizer that proves each program, the
//! executor with real numerics, the performance model, and the card service (the default feature
//! `service`: tonic, tokio, `proto`, `jetstream`; without it, the part the planner uses).
//!
//! Layers, bottom up: [`profile`] (one card as data: hierarchy, memories, rates, latencies),
//! [`assignment`] (a card's share and the default placement), [`format`](mod@format) and
//! [`numerics`] (what the card computes, bit for bit), [`program`] (regions, tiles,
//! instructions), [`compiler`] (share -> program from the model's shape alone), [`sanitizer`]
//! (proves every program), [`perf`] and [`report`] (modeled time, memory use by region kind),
//! [`weights`] (binding a checkpoint to a program), [`executor`] and [`card`] (running it on the
//! CPU), [`host_cpus`] (where and how the threads computing a card run),
//! [`reference`](mod@reference) (the plain software model the executor must equal bit for
//! bit), [`lm_head`] (vocabulary-shard proposals), [`synthetic`] (weights made in memory for
//! tests and benchmarks), and the card service on top.
//!
//! Must not: depend on `gpu-attention`; it knows the attention node only through `proto`. The
//! compiler, sanitizer, executor and performance model do no I/O.

pub mod assignment;
pub mod card;
pub mod compiler;
pub mod error;
pub mod executor;
pub mod format;
pub mod host_cpus;
pub mod lm_head;
pub mod numerics;
pub mod perf;
pub mod profile;
pub mod program;
pub mod reference;
pub mod report;
pub mod sanitizer;
#[cfg(feature = "service")]
pub mod service;
pub mod synthetic;
pub mod weights;

pub use assignment::{CardAssignment, LayerShare, PlacementOptions, Span, plan_placement};
pub use card::{Card, CardOptions, CardStats};
pub use compiler::{CompileOptions, Compiled, StoredFormats, compile};
pub use error::{Error, Result};
pub use executor::{ExecOptions, KernelChoice, Slot};
pub use format::{FormatChoice, TileFormat};
pub use lm_head::{LmProposal, RowSampling};
pub use profile::HardwareProfile;
pub use program::Program;
pub use weights::WeightSource;
