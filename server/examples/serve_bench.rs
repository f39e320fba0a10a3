//! Serving benchmark (prints ratios; not a pass/fail test).
//!
//! Starts `afd serve` on a model, measures output tokens/s at several concurrencies with
//! afd-loadtest (vLLM `bench serve` definitions) in one run, and times `afd generate` on the
//! same model and cards to compare single-stream TPOT with and without the HTTP path.
//!
//! ```text
//! cargo build --release --bin afd
//! cargo run --release -p server --example serve_bench -- --model DIR [--cards 2]
//! ```
//!
//! Goals (issue 6): 64 concurrent requests reach at least 8x the throughput of 1; at
//! concurrency 1 the HTTP path adds at most 10% to TPOT against `afd generate`.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use loadtest::{BenchmarkConfig, PromptConfig, PromptSource};

#[derive(Debug, Parser)]
struct Args {
    /// Checkpoint folder.
    #[arg(long, default_value = "models/afd-tiny-gpt-oss")]
    model: PathBuf,
    /// The afd binary; default: `afd` beside this example's directory (target/<profile>/afd).
    #[arg(long)]
    afd: Option<PathBuf>,
    /// Simulated cards.
    #[arg(long, default_value_t = 2)]
    cards: usize,
    /// Attention nodes.
    #[arg(long, default_value_t = 1)]
    attention_nodes: usize,
    /// Serve the monolithic reference instead of the cards (and time `generate --reference`).
    #[arg(long)]
    reference: bool,
    /// Concurrencies to measure, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,64")]
    concurrency: Vec<usize>,
    /// Prompt tokens per request.
    #[arg(long, default_value_t = 32)]
    input_len: usize,
    /// Output tokens per request (ignore_eos).
    #[arg(long, default_value_t = 128)]
    output_len: usize,
    /// Requests per level: this many times the concurrency (at least 8).
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Times to measure every concurrency (interleaved: 1, 8, 32, 64, 1, 8, ...) and to run
    /// `afd generate` per length; the medians count, so one noisy run moves nothing.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
}

/// One concurrency's medians over the repeats.
struct Level {
    concurrency: usize,
    requests: usize,
    throughput: f64,
    tpot_ms: f64,
    ttft_ms: f64,
    /// Slowest and fastest run's output tokens/s.
    spread: std::ops::RangeInclusive<f64>,
}

struct Serve(Child);

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn afd_binary(args: &Args) -> anyhow::Result<PathBuf> {
    if let Some(p) = &args.afd {
        return Ok(p.clone());
    }
    let exe = std::env::current_exe()?;
    let dir = exe
        .parent()
        .and_then(|d| d.parent())
        .context("cannot locate the target directory")?;
    let afd = dir.join("afd");
    if !afd.exists() {
        bail!(
            "{} not found: build it first (cargo build --release --bin afd) or pass --afd",
            afd.display()
        );
    }
    Ok(afd)
}

fn cluster_flags(args: &Args) -> Vec<String> {
    if args.reference {
        vec!["--reference".into()]
    } else {
        vec!["--cards".into(), args.cards.to_string()]
    }
}

/// The median of `xs` (loadtest's, as `compare` reports it); NaN when empty.
fn median(xs: Vec<f64>) -> f64 {
    loadtest::stats::median(&xs).unwrap_or(f64::NAN)
}

/// Seconds `afd generate` takes for `max_tokens` tokens (median of `repeats` runs).
fn time_generate(
    afd: &PathBuf,
    args: &Args,
    prompt: &str,
    max_tokens: usize,
) -> anyhow::Result<f64> {
    let mut runs = Vec::new();
    for _ in 0..args.repeats.max(1) {
        let start = Instant::now();
        let out = Command::new(afd)
            .arg("generate")
            .arg("--model")
            .arg(&args.model)
            .args(cluster_flags(args))
            .args([
                "--prompt-ids",
                prompt,
                "--max-tokens",
                &max_tokens.to_string(),
                "--ignore-eos",
            ])
            .stderr(Stdio::null())
            .output()
            .context("running afd generate")?;
        let secs = start.elapsed().as_secs_f64();
        if !out.status.success() {
            bail!(
                "afd generate failed: {}",
                String::from_utf8_lossy(&out.stdout)
            );
        }
        runs.push(secs);
    }
    Ok(median(runs))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let afd = afd_binary(&args)?;
    let port = free_port()?;
    let base_url = format!("http://127.0.0.1:{port}");
    let max_c = args.concurrency.iter().copied().max().unwrap_or(1);
    eprintln!("starting afd serve on {base_url} ...");
    let child = Command::new(&afd)
        .arg("serve")
        .arg("--model")
        .arg(&args.model)
        .args(cluster_flags(&args))
        .args(["--attention-nodes", &args.attention_nodes.to_string()])
        .args([
            "--port",
            &port.to_string(),
            "--max-num-seqs",
            &max_c.max(1).to_string(),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting afd serve")?;
    let _serve = Serve(child);
    let client = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        if let Ok(r) = client.get(format!("{base_url}/health")).send().await
            && r.status().is_success()
        {
            break;
        }
        if Instant::now() > deadline {
            bail!("afd serve did not become healthy in 10 minutes");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Per concurrency: every repeat's result.
    let mut runs: Vec<(usize, Vec<loadtest::BenchmarkResult>)> =
        args.concurrency.iter().map(|&c| (c, Vec::new())).collect();
    for repeat in 0..args.repeats.max(1) {
        for (c, results) in runs.iter_mut() {
            let c = *c;
            let config = BenchmarkConfig {
                base_url: base_url.clone(),
                num_prompts: (c * args.rounds).max(8),
                max_concurrency: Some(c),
                ignore_eos: true,
                temperature: Some(0.0),
                prompts: PromptConfig {
                    source: PromptSource::TokenIds,
                    input_len: args.input_len,
                    prefix_len: 0,
                    output_len: args.output_len,
                    range_ratio: 0.0,
                    vocab_size: 256,
                },
                num_warmups: 1,
                seed: c as u64 + 1000 * repeat as u64,
                ..Default::default()
            };
            let r = loadtest::run_benchmark(&config).await?;
            if r.failed > 0 {
                bail!(
                    "{} requests failed at concurrency {c}: {:?}",
                    r.failed,
                    r.errors.first()
                );
            }
            eprintln!(
                "run {}/{}, concurrency {c:>3}: {:.1} output tok/s, mean TPOT {:.2} ms",
                repeat + 1,
                args.repeats.max(1),
                r.output_throughput,
                r.latency.tpot.mean_ms
            );
            results.push(r);
        }
    }
    let rows: Vec<Level> = runs
        .iter()
        .map(|(c, results)| Level {
            concurrency: *c,
            requests: results.iter().map(|r| r.completed).sum::<usize>() / results.len().max(1),
            throughput: median(results.iter().map(|r| r.output_throughput).collect()),
            tpot_ms: median(results.iter().map(|r| r.latency.tpot.mean_ms).collect()),
            ttft_ms: median(results.iter().map(|r| r.latency.ttft.mean_ms).collect()),
            spread: results
                .iter()
                .map(|r| r.output_throughput)
                .fold(f64::INFINITY, f64::min)
                ..=results
                    .iter()
                    .map(|r| r.output_throughput)
                    .fold(0.0, f64::max),
        })
        .collect();
    drop(_serve);

    // afd generate, same model, cards and prompt length: TPOT as the slope between two output
    // lengths, so start-up (loading, compiling, connecting the cards) and the warm-up of a fresh
    // process's QUIC connections cancel out, as they do for a server that is already running.
    let prompt: Vec<String> = (0..args.input_len)
        .map(|i| (32 + i % 90).to_string())
        .collect();
    let prompt = prompt.join(",");
    // The lengths differ by 4x the output so that the start-up's run-to-run spread (tens of
    // milliseconds) is small against the slope.
    let short = time_generate(&afd, &args, &prompt, 1 + args.output_len)?;
    let long = time_generate(&afd, &args, &prompt, 1 + 5 * args.output_len)?;
    let generate_tpot_ms = (long - short) / (4 * args.output_len) as f64 * 1e3;

    println!();
    println!(
        "model {} | {} | prompt {} tokens, output {} tokens (ignore_eos, greedy)",
        args.model.display(),
        if args.reference {
            "reference forward".to_string()
        } else {
            format!(
                "{} card(s), {} attention node(s), QUIC",
                args.cards, args.attention_nodes
            )
        },
        args.input_len,
        args.output_len
    );
    println!(
        "medians of {} interleaved runs per concurrency; TPOT of afd generate: median of {} runs per length",
        args.repeats.max(1),
        args.repeats.max(1)
    );
    println!(
        "{:>11} {:>9} {:>13} {:>19} {:>13} {:>13} {:>10}",
        "concurrency",
        "requests",
        "output tok/s",
        "runs min-max",
        "mean TPOT ms",
        "mean TTFT ms",
        "vs c=1"
    );
    let base = rows.first().map(|l| l.throughput).unwrap_or(1.0);
    for l in &rows {
        println!(
            "{:>11} {:>9} {:>13.1} {:>19} {:>13.2} {:>13.2} {:>9.2}x",
            l.concurrency,
            l.requests,
            l.throughput,
            format!("{:.0}-{:.0}", l.spread.start(), l.spread.end()),
            l.tpot_ms,
            l.ttft_ms,
            l.throughput / base
        );
    }
    let one = rows.first().filter(|l| l.concurrency == 1);
    if let (Some(one), Some(many)) = (one, rows.iter().find(|l| l.concurrency == 64)) {
        println!(
            "throughput at 64 / at 1: {:.2}x (goal: at least 8x)",
            many.throughput / one.throughput
        );
    }
    if let Some(one) = one {
        println!(
            "TPOT at concurrency 1: HTTP {:.2} ms vs afd generate {:.2} ms: {:+.1}% (goal: at most +10%)",
            one.tpot_ms,
            generate_tpot_ms,
            (one.tpot_ms / generate_tpot_ms - 1.0) * 100.0
        );
    }
    Ok(())
}
