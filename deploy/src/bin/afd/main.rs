//! `afd`: one binary that starts any role of an afd deployment.
//!
//! Each subcommand lives in its own module beside this file: an `Args` struct (clap) and a
//! `run(args) -> anyhow::Result<()>`. This file only parses the command line and dispatches.

mod attention;
mod card;
mod certs;
mod cluster_args;
mod compile;
mod emulate;
mod generate;
mod k8s;
mod overrides;
mod plan;
mod serve;
mod serve_clock;
mod serve_routing;
mod synth;
mod up;
mod verify;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "afd",
    version,
    about = "Attention-FFN disaggregated MoE inference server"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run one attention node against running card processes (multi-process deployments).
    Attention(attention::AttentionArgs),
    /// Run one simulated Corsair card (multi-process deployments).
    Card(card::CardArgs),
    /// Make the cluster CA and node certificates for JetStream's mutual TLS.
    Certs(certs::CertsArgs),
    /// Compile each card's share for the Corsair card: placement, SRAM use, spills, modeled time, sanitizer verdict.
    Compile(compile::CompileArgs),
    /// Load-test a deployment file on a modeled clock: TTFT, TPOT and throughput on the hardware
    /// it names, with afd's scheduler and routing, in seconds and without that hardware.
    Emulate(Box<emulate::EmulateArgs>),
    /// Generate from one prompt and print {prompt_ids, output_ids, text} as JSON.
    Generate(generate::GenerateArgs),
    /// Render Kubernetes manifests for a deployment file.
    K8s(k8s::K8sArgs),
    /// Plan a deployment file: what fits on the cards and the attention device, predicted TPOT and throughput.
    Plan(plan::PlanArgs),
    /// Serve the OpenAI-compatible API over continuous batching, attention nodes and cards.
    Serve(serve::ServeArgs),
    /// The HTTP frontend alone (server and router) over running `afd attention` processes:
    /// `afd serve` with --attention-addrs required.
    Frontend(serve::ServeArgs),
    /// Write a random checkpoint in Hugging Face layout.
    Synth(synth::SynthArgs),
    /// Start every process of a deployment file on this machine until Ctrl-C or one dies.
    Up(up::UpArgs),
    /// Compare the disaggregated pipeline with the reference: token agreement, largest logit difference.
    Verify(verify::VerifyArgs),
}

/// Log lines (a card going down, coming back, a failed step) on stderr: warnings and errors
/// unless `RUST_LOG` says otherwise.
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .try_init();
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    init_logging();
    let threads = match &cli.command {
        Command::Serve(args) => args.compute_threads(),
        Command::Generate(args) => args.compute_threads(),
        Command::Verify(args) => args.compute_threads(),
        _ => 0,
    };
    // SAFETY: before any thread is started (parsing the command line starts none).
    unsafe { deploy::process::set_compute_threads(threads) };
    match cli.command {
        Command::Attention(args) => attention::run(args),
        Command::Card(args) => card::run(args),
        Command::Certs(args) => certs::run(args),
        Command::Compile(args) => compile::run(args),
        Command::Emulate(args) => emulate::run(*args),
        Command::Generate(args) => generate::run(args),
        Command::K8s(args) => k8s::run(args),
        Command::Plan(args) => plan::run(args),
        Command::Serve(args) => serve::run(args),
        Command::Frontend(args) => serve::run_frontend(args),
        Command::Synth(args) => synth::run(args),
        Command::Up(args) => up::run(args),
        Command::Verify(args) => verify::run(args),
    }
}
