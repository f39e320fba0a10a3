//! afd-loadtest: an OpenAI-API load generator.
//!
//! Owns arrival processes, the streaming HTTP client, vLLM `bench serve` metric definitions
//! (TTFT, TPOT, ITL, end-to-end latency, throughput, goodput), result files, tables and plots,
//! and the workload and result assembly other runners share ([`workload`], [`benchmark_result`],
//! the flags in [`args`]: afd's emulation runs the same workload and writes the same files).
//! Against a server that says it runs on a dilated clock (`x-afd-time-dilation`), it divides
//! what it measured by the dilation and says so in the result.
//!
//! Must not: depend on any other afd crate: it measures any OpenAI-compatible server.
//!
//! Layout: a deterministic, I/O-free core (`arrival`, `prompts`, `sse`, `record`, `stats`,
//! `metrics`, `report`) and a thin async shell (`connection`: kept-alive HTTP/1.1 connections
//! and the retry rule for ones the server closed; `client`, `runner`, `sweep`) plus file writers
//! (`output`, `plot`). `compare` puts several variants' results side by side (medians over
//! repeated runs, ratios against a baseline, a markdown table and plots). The entry points are
//! [`run_benchmark`] (one configuration against one base URL) and [`run_sweep`]; the
//! `afd-loadtest` binary is a CLI over them.
//!
//! ```no_run
//! # async fn demo() -> Result<(), loadtest::Error> {
//! let config = loadtest::BenchmarkConfig {
//!     base_url: "http://127.0.0.1:8000".into(),
//!     num_prompts: 50,
//!     max_concurrency: Some(8),
//!     ignore_eos: true,
//!     ..Default::default()
//! };
//! let result = loadtest::run_benchmark(&config).await?;
//! println!("{}", loadtest::report::format_result(&result));
//! println!("mean TPOT {:.1} ms", result.latency.tpot.mean_ms);
//! # Ok(()) }
//! ```

pub mod args;
pub mod arrival;
pub mod client;
pub mod compare;
pub mod config;
pub mod connection;
pub mod error;
pub mod metrics;
pub mod output;
pub mod plot;
pub mod prompts;
pub mod record;
pub mod report;
pub mod result;
pub mod runner;
pub mod sse;
pub mod stats;
pub mod sweep;

pub use config::{BenchmarkConfig, EndpointKind, PromptConfig, PromptSource, SloMetric, SloTarget};
pub use error::Error;
pub use output::{OutputOptions, save_result, save_sweep};
pub use result::BenchmarkResult;
pub use result::TimeBase;
pub use runner::{benchmark_result, resolve_model, run_benchmark, workload};
pub use sweep::{Sweep, SweepParameter, SweepResult, run_sweep};
