//! `afd emulate FILE`: a load test of a deployment on a modeled clock (docs/EMULATION.md). The
//! workload, the scheduler, the dispatch and the report are afd's own; every step is timed by
//! the planner's step model on the hardware the file names.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use deploy::cluster::TransportKind;
use deploy::deployment::Deployment;
use emulate::{CardFault, EmulatedRun, Emulation, RoutingSource, StepModel};
use gpu_attention::kv_cache::KvCacheConfig;
use indicatif::{ProgressBar, ProgressStyle};
use loadtest::args::{OutputArgs, WorkloadArgs};
use loadtest::report::{format_result, format_sweep};
use loadtest::sweep::{SweepPoint, SweepResult};
use loadtest::{BenchmarkConfig, Sweep};
use router::{RouterConfig, SchedulerConfig};
use step::{AttentionNode, KvCapacity};

use crate::overrides::DeploymentOverrides;

/// Load-test a deployment file in modeled time: afd-loadtest's workload through afd's
/// scheduler, each step timed on the hardware the file names (attention device, cards,
/// network profiles), routing from the model or a generator. Writes afd-loadtest's result
/// files, marked as modeled.
#[derive(Debug, clap::Args)]
pub struct EmulateArgs {
    /// The deployment file (TOML; docs/PLANNING.md lists its keys).
    file: PathBuf,
    #[command(flatten)]
    overrides: DeploymentOverrides,
    /// Where each token's experts come from: model (the deployment's checkpoint runs on the
    /// prompts: its own top-k, tokens as served), uniform, zipf:S (Zipf-skewed, exponent S),
    /// or trace:FILE (the counts a run recorded with --record-routing).
    #[arg(long, default_value = "uniform")]
    routing: RoutingSource,
    /// Write the routing of every step (per layer and expert, per window of steps) to FILE,
    /// for --routing trace:FILE.
    #[arg(long)]
    record_routing: Option<PathBuf>,
    /// Steps per window of --record-routing.
    #[arg(long, default_value_t = 256)]
    record_window: u64,
    /// Write a Chrome/Perfetto trace of a few modeled steps (open in ui.perfetto.dev).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Decode steps in the trace (after the first prompt step).
    #[arg(long, default_value_t = 3)]
    trace_steps: usize,
    /// Kill this card's process during the run (at --at seconds of modeled time).
    #[arg(long)]
    fail_card: Option<usize>,
    /// When --fail-card's card dies, in modeled seconds since the run began.
    #[arg(long, default_value_t = 1.0, requires = "fail_card")]
    at: f64,
    /// Seconds until the failed card's process is back (default: it stays down).
    #[arg(long, requires = "fail_card")]
    card_down_for: Option<f64>,
    /// Size the deployment: run the workload on each of these card counts (with each of
    /// --size-nodes) and print which meet the --goodput SLOs.
    #[arg(long, value_delimiter = ',')]
    size_cards: Vec<usize>,
    /// Attention-node counts to try with --size-cards (default: the file's).
    #[arg(long, value_delimiter = ',', requires = "size_cards")]
    size_nodes: Vec<usize>,
    /// Fraction of requests that must meet every --goodput SLO for a size to pass.
    #[arg(long, default_value_t = 0.9)]
    slo_attainment: f64,
    #[command(flatten)]
    workload: WorkloadArgs,
    #[command(flatten)]
    output: OutputArgs,
}

/// Why a deployment cannot be emulated: it does not fit (the planner's reasons).
#[derive(Debug)]
struct DoesNotFit(String);

impl std::fmt::Display for DoesNotFit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "it does not fit: {} (`afd plan` says more)", self.0)
    }
}

impl std::error::Error for DoesNotFit {}

/// A deployment made ready to emulate.
struct Prepared {
    emulation: Emulation,
    /// The checkpoint's cluster settings, for --routing model.
    deployment: Deployment,
}

/// `d` with the flags applied (and `size`, attention nodes and cards, over them), checked and
/// ready to run.
fn prepare(
    args: &EmulateArgs,
    mut d: Deployment,
    size: Option<(usize, usize)>,
) -> anyhow::Result<Prepared> {
    args.overrides.apply(&mut d);
    if let Some((nodes, cards)) = size {
        d.attention.nodes = nodes;
        d.cards.count = cards;
    }
    // The file's `[workload]` is the planner's operating point; an emulation's workload is
    // its flags', and what must fit is one sequence per node of their lengths.
    // (Prompts from a file have their own lengths; the scheduler refuses any too long.)
    d.workload.batch = d.attention.nodes;
    d.workload.input_len = if args.workload.prompt_file.is_some() {
        1
    } else {
        args.workload.input_len
    };
    d.workload.output_len = args.workload.output_len;
    d.validate()
        .with_context(|| format!("{} with the flags given", args.file.display()))?;
    let (config, stored) = deploy::plan::model_shape(&d)?;
    let profiles = deploy::plan::load_profiles(&d)?;
    let target = deploy::plan::target(&d);
    let plan = planner::plan(&target, &config, &stored, &profiles)?;
    if !plan.fits {
        return Err(DoesNotFit(plan.problems.join("; ")))
            .with_context(|| format!("{}: nothing to emulate", args.file.display()));
    }
    let kv_tokens = d.kv_cache_bytes(&config) / KvCacheConfig::bytes_per_token(&config).max(1);
    let kv = KvCapacity {
        block_size: d.attention.block_size,
        num_blocks: (kv_tokens / d.attention.block_size.max(1)).max(1),
    };
    let router = RouterConfig {
        scheduler: SchedulerConfig {
            max_num_seqs: d.attention.max_num_seqs,
            max_num_batched_tokens: d.attention.max_num_batched_tokens,
            max_model_len: d.attention.max_model_len,
            enable_chunked_prefill: true,
            enable_prefix_caching: d.attention.enable_prefix_caching,
        },
        max_waiting: d.server.max_waiting,
    };
    let (tokenize, detokenize, eos) = match (&args.routing, d.checkpoint()) {
        (RoutingSource::Model, Ok(dir)) => {
            let tokenizer = Arc::new(
                model::ModelTokenizer::load(&dir)
                    .with_context(|| format!("reading the tokenizer of {}", dir.display()))?,
            );
            let (enc, dec) = (Arc::clone(&tokenizer), tokenizer);
            let tokenize: emulate::Tokenize =
                Box::new(move |text| enc.encode(text, true).unwrap_or_default());
            let detokenize: emulate::Detokenize =
                Box::new(move |ids| dec.decode(ids, true).unwrap_or_default());
            (
                Some(tokenize),
                Some(detokenize),
                config.eos_token_ids.clone(),
            )
        }
        (RoutingSource::Model, Err(e)) => bail!(
            "--routing model runs the model, and {e:#}; use --routing uniform, zipf:S or \
             trace:FILE for a shape"
        ),
        _ => (None, None, config.eos_token_ids.clone()),
    };
    let fault = args.fail_card.map(|card| CardFault {
        card,
        at: Duration::from_secs_f64(args.at.max(0.0)),
        down_for: args
            .card_down_for
            .map(|s| Duration::from_secs_f64(s.max(0.0))),
    });
    if let Some(f) = &fault
        && f.card >= d.cards.count
    {
        bail!(
            "--fail-card {} names no card: the deployment has {} (0..{})",
            f.card,
            d.cards.count,
            d.cards.count
        );
    }
    let model_name = d
        .model
        .served_name
        .clone()
        .or_else(|| d.model.shape.clone())
        .unwrap_or_else(|| target.model_name.clone());
    let nodes = d.attention.nodes;
    let model = StepModel::new(&target, config, &stored, profiles)?;
    Ok(Prepared {
        emulation: Emulation {
            model: Arc::new(model),
            deployment: args.file.display().to_string(),
            model_name,
            router,
            nodes,
            kv,
            routing: args.routing.clone(),
            eos_token_ids: eos,
            tokenize,
            detokenize,
            fault,
        },
        deployment: d,
    })
}

/// The nodes of a run, and the cluster that keeps real ones alive.
type RunNodes = (
    Option<deploy::cluster::EmbeddedCluster>,
    Vec<Box<dyn AttentionNode>>,
);

/// The attention nodes a run steps: synthetic ones, or the deployment's real nodes over
/// in-process cards for `--routing model` (kept alive by the returned cluster).
fn nodes(p: &Prepared, seed: u64) -> anyhow::Result<RunNodes> {
    if p.emulation.routing != RoutingSource::Model {
        return Ok((None, p.emulation.synthetic_nodes(seed)?));
    }
    let mut config = p.deployment.cluster_config()?;
    config.transport = TransportKind::Inproc;
    // The step model chooses the micro-batches a step is timed with; the node on this host
    // need not measure its own (its choice would follow the host's timing, run to run).
    if config.node.micro_batches == gpu_attention::MicroBatches::Auto {
        config.node.micro_batches = gpu_attention::MicroBatches::One;
    }
    let mut cluster = deploy::cluster::EmbeddedCluster::start(&config, &mut |_| {})
        .context("starting the deployment's cards and attention nodes for --routing model")?;
    let nodes = cluster
        .take_nodes()
        .into_iter()
        .map(|n| Box::new(n) as Box<dyn AttentionNode>)
        .collect();
    Ok((Some(cluster), nodes))
}

fn progress_bar(show: bool, total: usize, what: &str) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total as u64);
    if let Ok(style) =
        ProgressStyle::with_template("{spinner} [{elapsed}] {bar:30} {pos}/{len} requests {msg}")
    {
        bar.set_style(style);
    }
    bar.set_message(what.to_string());
    bar
}

/// One run of `bench` on `p`.
fn run_once(
    args: &EmulateArgs,
    p: &Prepared,
    bench: &BenchmarkConfig,
    what: &str,
) -> anyhow::Result<EmulatedRun> {
    let (_cluster, nodes) = nodes(p, bench.seed)?;
    let bar = progress_bar(!args.output.no_progress, bench.num_prompts, what);
    let record = args.record_routing.as_ref().map(|_| args.record_window);
    let run = p.emulation.run(bench, nodes, record, |_| bar.inc(1))?;
    bar.finish_and_clear();
    if let Some(path) = &args.record_routing {
        let counts = run
            .sim
            .routing
            .as_ref()
            .context("--record-routing needs a MoE model on cards: this run routed nothing")?;
        counts.write(path)?;
        eprintln!(
            "wrote {} (routing of {} steps; hottest expert over the mean, by layer: {})",
            path.display(),
            run.sim.steps.len(),
            counts
                .hottest_over_mean()
                .iter()
                .map(|x| format!("{x:.2}"))
                .collect::<Vec<_>>()
                .join(" ")
        );
    }
    if let Some(path) = &args.trace {
        let steps = emulate::trace::pick_steps(&run.sim.steps, args.trace_steps);
        let cards = p.emulation.model.cards().map_or(0, |c| c.len());
        let trace = emulate::trace::chrome_trace(&steps, cards);
        std::fs::write(path, serde_json::to_string(&trace)?)
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {} ({} modeled steps)", path.display(), steps.len());
    }
    Ok(run)
}

fn bench_config(args: &EmulateArgs) -> anyhow::Result<BenchmarkConfig> {
    let mut bench = BenchmarkConfig {
        label: args.output.label.clone().or(Some("afd-emulate".into())),
        num_warmups: 0,
        ..BenchmarkConfig::default()
    };
    args.workload
        .apply(&mut bench)
        .map_err(anyhow::Error::msg)?;
    bench.validate()?;
    Ok(bench)
}

pub fn run(args: EmulateArgs) -> anyhow::Result<()> {
    let d = Deployment::load(&args.file)?;
    let bench = bench_config(&args)?;
    if !args.size_cards.is_empty() {
        return size(&args, &d, &bench);
    }
    let p = prepare(&args, d, None)?;
    match &args.workload.sweep {
        None => {
            let run = run_once(&args, &p, &bench, "")?;
            print!("{}", format_result(&run.result));
            print_steps(&run);
            if !args.output.no_save {
                for path in loadtest::save_result(&run.result, &args.output.options())? {
                    eprintln!("wrote {}", path.display());
                }
            }
            Ok(())
        }
        Some(sweep) => {
            let result = sweep_points(&args, &p, &bench, sweep)?;
            print!("{}", format_sweep(&result));
            if let Some(knee) = knee(&result) {
                println!("{knee}");
            }
            if !args.output.no_save {
                for path in loadtest::save_sweep(&result, &args.output.options())? {
                    eprintln!("wrote {}", path.display());
                }
            }
            Ok(())
        }
    }
}

fn sweep_points(
    args: &EmulateArgs,
    p: &Prepared,
    bench: &BenchmarkConfig,
    sweep: &Sweep,
) -> anyhow::Result<SweepResult> {
    let mut points = Vec::with_capacity(sweep.values.len());
    for &value in &sweep.values {
        let config = sweep.config_for(bench, value);
        let what = format!(
            "{}={}",
            sweep.parameter.field_name(),
            loadtest::sweep::format_value(value)
        );
        let run = run_once(args, p, &config, &what)?;
        eprintln!(
            "  {what}: {} ok, {} failed, {:.2} req/s, {:.1} output tok/s, mean TTFT {:.2} ms, \
             mean TPOT {:.3} ms",
            run.result.completed,
            run.result.failed,
            run.result.request_throughput,
            run.result.output_throughput,
            run.result.latency.ttft.mean_ms,
            run.result.latency.tpot.mean_ms
        );
        points.push(SweepPoint {
            value,
            result: run.result,
        });
    }
    Ok(SweepResult {
        parameter: sweep.parameter,
        points,
    })
}

/// Where queueing starts in a rate sweep: the first rate at which the requests served per
/// second fall below 95% of the rate offered, or the median TTFT passes twice its value at the
/// lightest rate.
fn knee(sweep: &SweepResult) -> Option<String> {
    if sweep.parameter != loadtest::sweep::SweepParameter::RequestRate {
        return None;
    }
    let light = sweep.points.first()?.result.latency.ttft.median_ms;
    let point = sweep.points.iter().find(|p| {
        let r = &p.result;
        (p.value.is_finite() && r.request_throughput < 0.95 * p.value)
            || r.latency.ttft.median_ms > 2.0 * light
    })?;
    Some(format!(
        "knee: queueing starts by {} req/s ({:.2} req/s served, median TTFT {:.2} ms against {:.2} \
         at the lightest rate)",
        loadtest::sweep::format_value(point.value),
        point.result.request_throughput,
        point.result.latency.ttft.median_ms,
        light
    ))
}

/// The step breakdown of a run, in a few lines.
fn print_steps(run: &EmulatedRun) {
    let Some(e) = &run.result.emulation else {
        return;
    };
    let b = &e["steps"]["decode_only"];
    if b["steps"].as_u64().unwrap_or(0) > 0 {
        println!(
            "Modeled decode step: {:.3} ms mean over {} steps ({:.1} tokens): attention device \
             {:.3} ms (idle {:.3}), transfers {:.3}, slowest card {:.3}, LM head {:.3}; overlap \
             hid {:.3} ms",
            b["step_ms"].as_f64().unwrap_or(0.0),
            b["steps"],
            b["tokens"].as_f64().unwrap_or(0.0),
            b["attention_device_ms"].as_f64().unwrap_or(0.0),
            b["attention_device_idle_ms"].as_f64().unwrap_or(0.0),
            b["transfers_ms"].as_f64().unwrap_or(0.0),
            b["slowest_card_ms"].as_f64().unwrap_or(0.0),
            b["lm_head_ms"].as_f64().unwrap_or(0.0),
            b["overlap_hidden_ms"].as_f64().unwrap_or(0.0),
        );
    }
    let busy = &e["card_busy"];
    if let Some(u) = busy["utilization"].as_array().filter(|u| !u.is_empty()) {
        let u: Vec<String> = u
            .iter()
            .map(|x| format!("{:.0}%", 100.0 * x.as_f64().unwrap_or(0.0)))
            .collect();
        println!(
            "Card busy time (of the run): {}; hottest card over the mean: {:.2}",
            u.join(" "),
            busy["hottest_over_mean"].as_f64().unwrap_or(0.0)
        );
    }
    if let Some(f) = e["fault"].as_object() {
        println!(
            "Card {} down at {:.3} s, marked down at {:.3} s, {}; {} request(s) failed",
            f["card"],
            f["down_at_s"].as_f64().unwrap_or(0.0),
            f["detected_at_s"].as_f64().unwrap_or(0.0),
            match f["back_at_s"].as_f64() {
                Some(b) => format!("serving again at {b:.3} s"),
                None => "not back".to_string(),
            },
            f["failed_requests"]
        );
    }
}

/// `--size-cards`: the workload on each size; which meet the SLOs.
fn size(args: &EmulateArgs, d: &Deployment, bench: &BenchmarkConfig) -> anyhow::Result<()> {
    if bench.goodput.is_empty() {
        bail!(
            "--size-cards needs the SLOs to meet: give them with --goodput, e.g. ttft:500 tpot:20"
        );
    }
    if !(args.slo_attainment > 0.0 && args.slo_attainment <= 1.0) {
        bail!(
            "--slo-attainment must be in (0, 1], not {}",
            args.slo_attainment
        );
    }
    let node_counts = if args.size_nodes.is_empty() {
        vec![d.attention.nodes]
    } else {
        args.size_nodes.clone()
    };
    let slos: Vec<String> = bench.goodput.iter().map(ToString::to_string).collect();
    println!(
        "{}: {} requests at {} req/s, SLOs {} met by at least {:.0}% of requests",
        args.file.display(),
        bench.num_prompts,
        loadtest::sweep::format_value(bench.request_rate),
        slos.join(" "),
        100.0 * args.slo_attainment
    );
    println!(
        "| attention nodes | cards | fits | met SLOs | goodput req/s | p99 TTFT ms | mean TPOT ms | output tok/s |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let mut smallest: Vec<(usize, usize)> = Vec::new();
    for &nodes in &node_counts {
        for &cards in &args.size_cards {
            let p = match prepare(args, d.clone(), Some((nodes, cards))) {
                Ok(p) => p,
                Err(e) => {
                    let why = e
                        .downcast_ref::<DoesNotFit>()
                        .map_or_else(|| format!("{e:#}"), |d| d.0.clone());
                    println!("| {nodes} | {cards} | no: {why} | - | - | - | - | - |");
                    continue;
                }
            };
            let run = run_once(
                args,
                &p,
                bench,
                &format!("{nodes} node(s), {cards} card(s)"),
            )?;
            let r = &run.result;
            let met = r.good_requests.unwrap_or(0) as f64 / bench.num_prompts.max(1) as f64;
            let pass = met >= args.slo_attainment;
            if pass && !smallest.iter().any(|(n, _)| *n == nodes) {
                smallest.push((nodes, cards));
            }
            println!(
                "| {nodes} | {cards} | yes | {:.0}%{} | {:.2} | {:.2} | {:.3} | {:.0} |",
                100.0 * met,
                if pass { " (meets)" } else { "" },
                r.request_goodput.unwrap_or(0.0),
                r.latency
                    .ttft
                    .percentiles_ms
                    .iter()
                    .find(|(p, _)| *p == 99.0)
                    .map_or(f64::NAN, |(_, v)| *v),
                r.latency.tpot.mean_ms,
                r.output_throughput
            );
        }
    }
    for &nodes in &node_counts {
        match smallest.iter().find(|(n, _)| *n == nodes) {
            Some((_, cards)) => println!(
                "with {nodes} attention node(s): {cards} card(s) is the smallest count tried that meets the SLOs"
            ),
            None => println!("with {nodes} attention node(s): no card count tried meets the SLOs"),
        }
    }
    Ok(())
}
