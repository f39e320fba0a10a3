//! `afd-loadtest`: measure TTFT, TPOT, ITL, throughput and goodput of any OpenAI-compatible
//! server under load, the way `vllm bench serve` does, and write vLLM-compatible JSON, a table
//! and SVG plots. `afd-loadtest compare` puts several runs' results side by side. A thin CLI
//! over the `loadtest` library.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand, ValueEnum};
use loadtest::compare::{Comparison, InputSpec, read_inputs, write_comparison};
use loadtest::report::{format_result, format_sweep};
use loadtest::{
    BenchmarkConfig, EndpointKind, OutputOptions, PromptConfig, PromptSource, SloTarget, Sweep,
};

#[derive(Debug, Clone, Copy, ValueEnum)]
enum EndpointArg {
    /// POST /v1/completions
    Completions,
    /// POST /v1/chat/completions
    Chat,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum PromptSourceArg {
    /// token ids for completions, random words for chat
    Auto,
    /// random token ids in [0, --vocab-size): exact prompt lengths (completions only)
    TokenIds,
    /// random common English words (about one token each)
    Words,
    /// the lines of --prompt-file
    File,
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

    /// Requests in the measured run.
    #[arg(long, default_value_t = 100)]
    num_prompts: usize,
    /// Prompt length in tokens (words for text prompts).
    #[arg(long, default_value_t = 1024)]
    input_len: usize,
    /// Output length in tokens (max_tokens); add --ignore-eos to get exactly this many.
    #[arg(long, default_value_t = 128)]
    output_len: usize,
    /// Draw each length uniformly from [len*(1-r), len*(1+r)].
    #[arg(long, default_value_t = 0.0)]
    range_ratio: f64,
    /// Where prompts come from.
    #[arg(long, value_enum, default_value = "auto")]
    prompt_source: PromptSourceArg,
    /// A text file with one prompt per line (implies --prompt-source file).
    #[arg(long)]
    prompt_file: Option<PathBuf>,
    /// Token ids are drawn from [0, vocab-size); keep it below the model's vocabulary.
    #[arg(long, default_value_t = 1000)]
    vocab_size: u32,
    /// Send ignore_eos: true so every request generates exactly --output-len tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Sampling temperature (default: the server's).
    #[arg(long)]
    temperature: Option<f64>,

    /// Mean arrivals per second (Poisson; see --burstiness); inf sends all at once.
    #[arg(long, default_value = "inf")]
    request_rate: f64,
    /// Gamma shape of arrival gaps: 1 = Poisson, <1 burstier, >1 smoother.
    #[arg(long, default_value_t = 1.0)]
    burstiness: f64,
    /// At most this many requests in flight.
    #[arg(long)]
    max_concurrency: Option<usize>,
    /// Run one benchmark per value: concurrency=1,2,4,8 or rate=1,2,4,inf.
    #[arg(long)]
    sweep: Option<Sweep>,
    /// Warm-up requests before measuring (0 skips the reachability check too).
    #[arg(long, default_value_t = 1)]
    num_warmups: usize,
    /// Stop sending new requests after this many seconds (requests in flight finish).
    #[arg(long)]
    max_duration: Option<f64>,
    /// Limit on one request, seconds.
    #[arg(long, default_value_t = 21600.0)]
    request_timeout: f64,
    /// Goodput SLOs in ms, e.g. --goodput ttft:200 tpot:50 (keys: ttft, tpot, e2el).
    #[arg(long, num_args = 1..)]
    goodput: Vec<SloTarget>,
    /// Percentiles to report besides the median, comma-separated.
    #[arg(long, default_value = "90,99", value_delimiter = ',')]
    metric_percentiles: Vec<f64>,
    /// Seed of prompts, lengths and arrival times.
    #[arg(long, default_value_t = 0)]
    seed: u64,

    /// Label written to the result (default: the backend name, openai or openai-chat).
    #[arg(long)]
    label: Option<String>,
    /// Folder for the JSON results and plots.
    #[arg(long, default_value = "bench-results")]
    result_dir: PathBuf,
    /// File name of the JSON result of a single run (default: vLLM's naming scheme).
    #[arg(long)]
    result_filename: Option<String>,
    /// Write no files; print the table only.
    #[arg(long)]
    no_save: bool,
    /// Write the JSON but no plots.
    #[arg(long)]
    no_plots: bool,
    /// No progress bar (also vLLM's --disable-tqdm).
    #[arg(long, alias = "disable-tqdm")]
    no_progress: bool,
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
        let source = match (self.prompt_source, &self.prompt_file) {
            (PromptSourceArg::File | PromptSourceArg::Auto, Some(path)) => {
                PromptSource::File(path.clone())
            }
            (PromptSourceArg::File, None) => {
                anyhow::bail!("--prompt-source file needs --prompt-file PATH")
            }
            (_, Some(_)) => {
                anyhow::bail!("--prompt-file goes with --prompt-source file (or leave it auto)")
            }
            (PromptSourceArg::Auto, None) => PromptSource::Auto,
            (PromptSourceArg::TokenIds, None) => PromptSource::TokenIds,
            (PromptSourceArg::Words, None) => PromptSource::RandomWords,
        };
        let seconds = |name: &str, s: f64| -> anyhow::Result<Duration> {
            Duration::try_from_secs_f64(s)
                .ok()
                .filter(|d| !d.is_zero())
                .with_context(|| format!("--{name} {s} must be a positive number of seconds"))
        };
        Ok(BenchmarkConfig {
            base_url: self.base_url.trim_end_matches('/').to_string(),
            endpoint: match self.endpoint {
                EndpointArg::Completions => EndpointKind::Completions,
                EndpointArg::Chat => EndpointKind::Chat,
            },
            model: self.model.clone(),
            api_key: self.api_key.clone().filter(|k| !k.is_empty()),
            num_prompts: self.num_prompts,
            prompts: PromptConfig {
                source,
                input_len: self.input_len,
                output_len: self.output_len,
                range_ratio: self.range_ratio,
                vocab_size: self.vocab_size,
            },
            ignore_eos: self.ignore_eos,
            temperature: self.temperature,
            request_rate: self.request_rate,
            burstiness: self.burstiness,
            max_concurrency: self.max_concurrency,
            num_warmups: self.num_warmups,
            max_duration: self
                .max_duration
                .map(|s| seconds("max-duration", s))
                .transpose()?,
            request_timeout: seconds("request-timeout", self.request_timeout)?,
            goodput: self.goodput.clone(),
            percentiles: self.metric_percentiles.clone(),
            seed: self.seed,
            label: self.label.clone(),
            show_progress: !self.no_progress,
        })
    }

    fn output(&self) -> OutputOptions {
        OutputOptions {
            result_dir: self.result_dir.clone(),
            result_filename: self.result_filename.clone(),
            plots: !self.no_plots,
        }
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
    match &cli.sweep {
        None => {
            eprintln!(
                "afd-loadtest: {} requests to {}{} ...",
                config.num_prompts,
                config.base_url,
                config.endpoint.path()
            );
            let result = runtime.block_on(loadtest::run_benchmark(&config))?;
            print!("{}", format_result(&result));
            if !cli.no_save {
                for path in loadtest::save_result(&result, &cli.output())? {
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
            if !cli.no_save {
                for path in loadtest::save_sweep(&result, &cli.output())? {
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
