//! `afd-loadtest`: measure TTFT, TPOT, ITL, throughput and goodput of any OpenAI-compatible
//! server under load, the way `vllm bench serve` does, and write vLLM-compatible JSON, a table
//! and SVG plots. `afd-loadtest compare` puts several runs' results side by side. A thin CLI
//! over the `loadtest` library.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand, ValueEnum};
use loadtest::args::{OutputArgs, WorkloadArgs};
use loadtest::compare::{Comparison, InputSpec, read_inputs, write_comparison};
use loadtest::report::{format_result, format_sweep};
use loadtest::{BenchmarkConfig, EndpointKind};

#[derive(Debug, Clone, Copy, ValueEnum)]
enum EndpointArg {
    /// POST /v1/completions
    Completions,
    /// POST /v1/chat/completions
    Chat,
}

/// Load-test an OpenAI-compatible server (afd, vLLM, ...) with vLLM `bench serve` metrics.
#[derive(Debug, Parser)]
#[command(
    name = "afd-loadtest",
    version,
    about,
    long_about = None,
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,

    /// Server root, without /v1.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    base_url: String,
    /// Which API to load.
    #[arg(long, value_enum, default_value = "completions")]
    endpoint: EndpointArg,
    /// Model name to send; default: the first model of GET /v1/models.
    #[arg(long)]
    model: Option<String>,
    /// Bearer token for the Authorization header.
    #[arg(long, env = "OPENAI_API_KEY", hide_env_values = true)]
    api_key: Option<String>,

    #[command(flatten)]
    workload: WorkloadArgs,
    /// Warm-up requests before measuring (0 skips the reachability check too).
    #[arg(long, default_value_t = 1)]
    num_warmups: usize,
    /// Stop sending new requests after this many seconds (requests in flight finish).
    #[arg(long)]
    max_duration: Option<f64>,
    /// Limit on one request, seconds.
    #[arg(long, default_value_t = 21600.0)]
    request_timeout: f64,

    #[command(flatten)]
    output: OutputArgs,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Put several variants' results side by side: medians over repeated runs per concurrency,
    /// ratios against a baseline, a markdown table (also printed) and SVG plots.
    Compare(CompareArgs),
}

#[derive(Debug, clap::Args)]
struct CompareArgs {
    /// Results as [LABEL=]PATH: PATH is a result JSON, a sweep summary or a folder of results;
    /// LABEL names the variant (default: each result's own label).
    #[arg(required = true)]
    inputs: Vec<InputSpec>,
    /// The variant ratios are taken against (default: the first one given).
    #[arg(long)]
    baseline: Option<String>,
    /// Folder for comparison.md, comparison.json, tpot.svg, throughput.svg and ttft.svg.
    #[arg(long, default_value = "bench-compare")]
    out: PathBuf,
    /// Title of the table and the plots.
    #[arg(long, default_value = "afd-loadtest comparison")]
    title: String,
}

fn run_compare(args: &CompareArgs) -> anyhow::Result<ExitCode> {
    let points = read_inputs(&args.inputs)?;
    let comparison = Comparison::new(&points, args.baseline.as_deref())?;
    let written = write_comparison(&comparison, &args.title, &args.out)?;
    print!("{}", loadtest::compare::markdown(&comparison, &args.title));
    for path in [&written.markdown, &written.json]
        .into_iter()
        .chain(&written.plots)
    {
        eprintln!("wrote {}", path.display());
    }
    Ok(ExitCode::SUCCESS)
}

impl Cli {
    fn config(&self) -> anyhow::Result<BenchmarkConfig> {
        let seconds = |name: &str, s: f64| -> anyhow::Result<Duration> {
            Duration::try_from_secs_f64(s)
                .ok()
                .filter(|d| !d.is_zero())
                .with_context(|| format!("--{name} {s} must be a positive number of seconds"))
        };
        let mut config = BenchmarkConfig {
            base_url: self.base_url.trim_end_matches('/').to_string(),
            endpoint: match self.endpoint {
                EndpointArg::Completions => EndpointKind::Completions,
                EndpointArg::Chat => EndpointKind::Chat,
            },
            model: self.model.clone(),
            api_key: self.api_key.clone().filter(|k| !k.is_empty()),
            num_warmups: self.num_warmups,
            max_duration: self
                .max_duration
                .map(|s| seconds("max-duration", s))
                .transpose()?,
            request_timeout: seconds("request-timeout", self.request_timeout)?,
            label: self.output.label.clone(),
            show_progress: !self.output.no_progress,
            ..BenchmarkConfig::default()
        };
        self.workload
            .apply(&mut config)
            .map_err(anyhow::Error::msg)?;
        Ok(config)
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let outcome = match &cli.command {
        Some(Command::Compare(args)) => run_compare(args),
        None => run(&cli),
    };
    match outcome {
        Ok(code) => code,
        Err(e) => {
            eprintln!("afd-loadtest: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: &Cli) -> anyhow::Result<ExitCode> {
    let config = cli.config()?;
    config.validate()?;
    let runtime = tokio::runtime::Runtime::new().context("could not start the async runtime")?;
    match &cli.workload.sweep {
        None => {
            eprintln!(
                "afd-loadtest: {} requests to {}{} ...",
                config.num_prompts,
                config.base_url,
                config.endpoint.path()
            );
            let result = runtime.block_on(loadtest::run_benchmark(&config))?;
            print!("{}", format_result(&result));
            if !cli.output.no_save {
                for path in loadtest::save_result(&result, &cli.output.options())? {
                    eprintln!("wrote {}", path.display());
                }
            }
            Ok(exit_code(result.completed, result.num_requests_sent))
        }
        Some(sweep) => {
            eprintln!(
                "afd-loadtest: sweep {sweep} against {} ...",
                config.base_url
            );
            let result = runtime.block_on(loadtest::run_sweep(&config, sweep, |point| {
                eprintln!(
                    "  {}={}: {} ok, {} failed, {:.2} req/s, {:.2} output tok/s, mean TPOT {:.2} ms",
                    sweep.parameter.field_name(),
                    loadtest::sweep::format_value(point.value),
                    point.result.completed,
                    point.result.failed,
                    point.result.request_throughput,
                    point.result.output_throughput,
                    point.result.latency.tpot.mean_ms
                );
            }))?;
            for point in &result.points {
                print!("{}", format_result(&point.result));
            }
            print!("{}", format_sweep(&result));
            if !cli.output.no_save {
                for path in loadtest::save_sweep(&result, &cli.output.options())? {
                    eprintln!("wrote {}", path.display());
                }
            }
            let completed = result.points.iter().map(|p| p.result.completed).sum();
            let sent = result
                .points
                .iter()
                .map(|p| p.result.num_requests_sent)
                .sum();
            Ok(exit_code(completed, sent))
        }
    }
}

/// Failure when nothing succeeded: the table above says why.
fn exit_code(completed: usize, sent: usize) -> ExitCode {
    if completed == 0 && sent > 0 {
        eprintln!("afd-loadtest: all {sent} requests failed; see the failure reasons above");
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
