//! The GPU check behind `scripts/gpu_check.sh`: on a machine with an NVIDIA GPU (a build with
//! `--features cuda`), the attention node's device path against the transformers fixtures, then
//! its speed on a GPT-OSS-20B-shaped checkpoint beside `afd plan`'s prediction for the same
//! shape on the GPU's profile; first, each linear kernel against its CPU twin at awkward shapes
//! (`kernels.rs`). Everything is printed; the exit status says whether every kernel agreed with
//! its twin and every fixture's tokens matched.
//!
//! ```sh
//! afd synth --family gpt-oss --preset gpt-oss-20b --out /tmp/gpt-oss-20b
//! cargo run --release --features cuda -p deploy --example gpu_check -- \
//!     --checkpoint /tmp/gpt-oss-20b --profile h200
//! ```
//!
//! Runs on candle's CPU device too (`--device candle-cpu`, small checkpoints only), which is
//! how it is tested without a GPU.

mod bench;
mod fixtures;
mod kernels;

use std::path::PathBuf;

use anyhow::{Result, bail};
use clap::Parser;
use gpu_attention::AttentionDevice;

/// The attention node's device path: fixtures, then speed against the planner.
#[derive(Debug, Parser)]
struct Args {
    /// The device under test.
    #[arg(long, default_value = "cuda")]
    device: AttentionDevice,
    /// The transformers fixtures (folders with expected.json).
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures"))]
    fixtures: PathBuf,
    /// Card counts the fixtures run on.
    #[arg(long, value_delimiter = ',', default_value = "1,2,3,4")]
    cards: Vec<usize>,
    /// A GPT-OSS-20B-shaped checkpoint (`afd synth --preset gpt-oss-20b`) for the speed part;
    /// without it only the fixtures run.
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// The shipped deployment files the planner's predictions start from.
    #[arg(long, default_value_os_t = bench::default_deployments())]
    deployments: PathBuf,
    /// The planner's profile of this GPU (h100, h200 or a profile file).
    #[arg(long, default_value = "h100")]
    profile: String,
    /// Decode batches timed.
    #[arg(long, value_delimiter = ',', default_value = "1,32,64")]
    batches: Vec<usize>,
    /// Context of every timed decode step.
    #[arg(long, default_value_t = 1024)]
    context: usize,
    /// Decode steps timed per batch (the median is reported).
    #[arg(long, default_value_t = 8)]
    steps: usize,
    /// Cards the dispatched rows are planned for (their replies are zeros: only the node is
    /// timed).
    #[arg(long, default_value_t = 8)]
    bench_cards: usize,
    /// Skip the GPU-only baseline (the whole model on the device).
    #[arg(long)]
    no_baseline: bool,
    /// Skip the fixtures.
    #[arg(long)]
    no_fixtures: bool,
    /// Skip the linear kernels' checks against their CPU twins.
    #[arg(long)]
    no_kernels: bool,
}

fn main() -> Result<()> {
    let args = Args::parse();
    println!("== gpu check on {}", args.device);
    let mut failures = 0;
    if !args.no_kernels {
        match args.device.open()? {
            Some(dev) => failures += kernels::run(&dev)?,
            None => println!("-- linear kernels: the host path has none (skipped)"),
        }
    }
    if !args.no_fixtures {
        failures += fixtures::run(&args)?;
    }
    if let Some(checkpoint) = &args.checkpoint {
        bench::run(&args, checkpoint)?;
    }
    if failures > 0 {
        bail!("{failures} check(s) failed");
    }
    println!("== gpu check passed");
    Ok(())
}
