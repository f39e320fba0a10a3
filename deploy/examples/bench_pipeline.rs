//! TPOT of the disaggregated pipeline (4 cards, QUIC and in-process) against the monolithic
//! reference on the same checkpoint, at batch 1 and 32, and micro-batch overlap on against off,
//! side by side in one run. Prints the cards' modeled Corsair time per step beside the wall time.
//!
//! Overlap is measured twice: with every thread free to run anywhere, and partitioned, where
//! the attention node computes on CPU 0 and the cards on CPU 1 (a child process of this
//! benchmark, pinned), as they would on separate devices. On a small host the unpartitioned cards and node
//! share every core, so hiding one behind the other gains little there by construction.
//!
//! ```sh
//! cargo run --release --bin afd -- synth --family gpt-oss --preset medium --format mxfp4 --out /tmp/gpt-oss-medium
//! cargo run --release -p deploy --example bench_pipeline -- /tmp/gpt-oss-medium
//! ```

use std::path::{Path, PathBuf};
use std::time::Instant;

use deploy::cluster::{ClusterConfig, EmbeddedCluster, TransportKind};
use gpu_attention::kv_cache::KvCacheConfig;
use gpu_attention::{DisaggregatedNode, MicroBatches, MonolithicNode};
use model::sampling::SamplingParams;
use model::{ModelWeights, ReferenceModel};
use step::{AttentionNode, KvCapacity, SampleRequest, StepBatch, StepEntry};

const PROMPT: usize = 32;
const STEPS: usize = 12;

/// Prefills `batch` sequences, then times `STEPS` decode steps; `decode_started` runs between.
fn tpot<N: AttentionNode>(
    node: &mut N,
    batch: usize,
    decode_started: &mut dyn FnMut(&mut N),
) -> f64 {
    let bs = node.kv_capacity().block_size;
    let blocks = (PROMPT + STEPS + 1).div_ceil(bs);
    let request = SampleRequest {
        params: SamplingParams::greedy(),
        penalties: Default::default(),
        logprobs: false,
        top_logprobs: 0,
        allowed: None,
    };
    let entry = |i: usize, tokens: Vec<u32>, start: usize| StepEntry {
        seq: i as u64,
        tokens,
        start,
        prompt_len: PROMPT,
        block_table: ((i * blocks) as u32..((i + 1) * blocks) as u32).collect(),
        sample: Some(request.clone()),
        cached_prefix: Vec::new(),
        prompt_logprobs: None,
    };
    let prompts: Vec<StepEntry> = (0..batch)
        .map(|i| {
            entry(
                i,
                (0..PROMPT as u32)
                    .map(|t| (t * 31 + i as u32 * 7) % 300)
                    .collect(),
                0,
            )
        })
        .collect();
    let mut last: Vec<u32> = node
        .step(&StepBatch { entries: prompts })
        .expect("prefill")
        .sampled
        .iter()
        .map(|t| t.token)
        .collect();
    decode_started(node);
    let start = Instant::now();
    for s in 0..STEPS {
        let entries = (0..batch)
            .map(|i| entry(i, vec![last[i]], PROMPT + s))
            .collect();
        last = node
            .step(&StepBatch { entries })
            .expect("decode")
            .sampled
            .iter()
            .map(|t| t.token)
            .collect();
    }
    let t = start.elapsed().as_secs_f64() / STEPS as f64;
    node.free(&(0..batch as u64).collect::<Vec<_>>())
        .expect("free");
    t
}

struct Afd {
    cluster: EmbeddedCluster,
    node: DisaggregatedNode,
}

fn afd(model: &Path, transport: TransportKind, micro_batches: MicroBatches) -> Afd {
    afd_on(model, transport, micro_batches, 0, false)
}

/// A 4-card cluster whose card threads run on the CPUs of `card_cpu_mask` (0: anywhere).
/// With `trace`, the node records its spans.
fn afd_on(
    model: &Path,
    transport: TransportKind,
    micro_batches: MicroBatches,
    card_cpu_mask: u64,
    trace: bool,
) -> Afd {
    let mut config = ClusterConfig::new(model, 4);
    config.card_cpu_mask = card_cpu_mask;
    config.node.trace = trace;
    config.transport = transport;
    config.node.micro_batches = micro_batches;
    config.node.max_tokens = 32 * PROMPT;
    config.node.kv = KvCacheConfig {
        block_size: 16,
        memory_bytes: 256 << 20,
        gpu_memory_utilization: None,
    };
    let mut cluster = EmbeddedCluster::start(&config, &mut |_| {}).expect("start the cluster");
    let node = cluster.take_nodes().remove(0);
    Afd { cluster, node }
}

/// Modeled Corsair seconds per decode step: the slowest card's (cards run in parallel).
fn modeled_per_step(cluster: &EmbeddedCluster, before: &[f64]) -> f64 {
    cluster
        .card_stats()
        .iter()
        .zip(before)
        .map(|(s, b)| (s.modeled_seconds - b) / STEPS as f64)
        .fold(0.0, f64::max)
}

/// CPU seconds the card worker threads of this process have run so far (Linux: from each
/// thread's `schedstat`); `None` where that cannot be read.
fn card_cpu_seconds() -> Option<f64> {
    let mut total = 0.0;
    for task in std::fs::read_dir("/proc/self/task").ok()? {
        let dir = task.ok()?.path();
        let name = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        if !name.starts_with("card-") {
            continue;
        }
        // The first field is the nanoseconds the thread has run.
        let stat = std::fs::read_to_string(dir.join("schedstat")).ok()?;
        total += stat.split_whitespace().next()?.parse::<f64>().ok()? / 1e9;
    }
    Some(total)
}

fn modeled(cluster: &EmbeddedCluster) -> Vec<f64> {
    cluster
        .card_stats()
        .iter()
        .map(|s| s.modeled_seconds)
        .collect()
}

/// Best (lowest) of `ROUNDS` measurements.
fn best(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::INFINITY, f64::min)
}

const ROUNDS: usize = 3;
/// Rounds of the partitioned overlap run: its ratio compares two figures 15-25% apart on a
/// shared host, so it takes the best of more rounds.
const PARTITIONED_ROUNDS: usize = 5;

/// The partitioned overlap run (the child process): this thread and the compute pool on CPU
/// 0, the cards on CPU 1. Without overlap a step is the node's busy time A, its wait for the
/// experts C and the LM head L; with it, at best max(A, C) + L: the printed bound
/// (A + C + L) / (max(A, C) + L) is what any overlap could give on this checkpoint and batch.
fn partitioned(model: &Path) {
    // One compute thread for the node's tensor work, on CPU 0.
    rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .start_handler(|_| corsair_ffn::host_cpus::pin_to_mask(0b01, 0))
        .build_global()
        .expect("the node's compute pool");
    let mut on = afd_on(model, TransportKind::Quic, MicroBatches::Two, 0b10, false);
    let mut off = afd_on(model, TransportKind::Quic, MicroBatches::One, 0b10, true);
    // Pinned after the clusters start, so that the endpoints' idle drivers (see
    // `jetstream::EndpointRuntime`) stay free to run on either CPU.
    corsair_ffn::host_cpus::pin_to_mask(0b01, 0);
    for batch in [8usize, 32] {
        let (mut a, mut b) = (vec![], vec![]);
        let (mut cards_on, mut cards_off) = (vec![], vec![]);
        let mut spans = Vec::new();
        // The cards' CPU time per decode step of the run `tpot` just finished.
        let per_step = |before: Option<f64>| Some((card_cpu_seconds()? - before?) / STEPS as f64);
        for _ in 0..PARTITIONED_ROUNDS {
            let mut before = None;
            a.push(tpot(&mut on.node, batch, &mut |_| {
                before = card_cpu_seconds()
            }));
            cards_on.extend(per_step(before));
            b.push(tpot(&mut off.node, batch, &mut |n| {
                drop(n.take_trace());
                before = card_cpu_seconds();
            }));
            cards_off.extend(per_step(before));
            spans = off.node.take_trace();
        }
        let (a, b) = (best(&a), best(&b));
        // Node busy (attention, dispatch), waiting for expert results, and the LM head (sent
        // after the last layer, so nothing of the node's is left to hide it behind).
        let sum = |pick: &dyn Fn(&str) -> bool| -> f64 {
            spans
                .iter()
                .filter(|s| pick(s.name))
                .map(|s| s.duration_us)
                .sum()
        };
        let busy = sum(&|n| n == "attention" || n == "dispatch");
        let wait = sum(&|n| n == "wait+combine");
        let lm = sum(&|n| n.starts_with("lm-head"));
        let total = busy + wait + lm;
        println!(
            "batch {batch:>2}: partitioned (node on CPU 0, cards on CPU 1; best of {PARTITIONED_ROUNDS} rounds) overlap on {:7.2} ms/step, off {:7.2} ms/step: \
             overlap gives {:.2}x the throughput; without overlap a step is {:.0}% node work, {:.0}% wait for experts, \
             {:.0}% LM head: bound {:.2}x",
            a * 1e3,
            b * 1e3,
            b / a,
            busy / total * 100.0,
            wait / total * 100.0,
            lm / total * 100.0,
            total / (busy.max(wait) + lm)
        );
        if !cards_on.is_empty() && !cards_off.is_empty() {
            // Each micro-batch makes every card pass over its experts' weights again: the
            // simulator's cost of overlap, which Corsair's SRAM-resident weights do not pay.
            println!(
                "batch {batch:>2}: partitioned cards' CPU time per step (all cards): overlap on {:.2} ms, off {:.2} ms",
                best(&cards_on) * 1e3,
                best(&cards_off) * 1e3
            );
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let model: PathBuf = args
        .get(1)
        .expect("usage: bench_pipeline CHECKPOINT_DIR (a medium GPT-OSS synthetic checkpoint)")
        .into();
    if args.get(2).map(String::as_str) == Some("--partitioned") {
        // SAFETY: first thing in main, before any thread is started.
        unsafe { std::env::set_var("RAYON_NUM_THREADS", "1") };
        partitioned(&model);
        return;
    }
    // SAFETY: first thing in main, before any thread is started.
    unsafe { deploy::process::set_compute_threads(0) };
    let weights = ModelWeights::load(&model).expect("load the checkpoint");
    let capacity = KvCacheConfig {
        block_size: 16,
        memory_bytes: 256 << 20,
        gpu_memory_utilization: None,
    }
    .capacity(&weights.config);
    let capacity = KvCapacity {
        block_size: capacity.block_size,
        num_blocks: capacity.num_blocks,
    };
    let mut mono = MonolithicNode::new(ReferenceModel::new(weights).expect("reference"), capacity);
    let mut quic = afd(&model, TransportKind::Quic, MicroBatches::Two);
    let mut inproc = afd(&model, TransportKind::Inproc, MicroBatches::Two);
    let mut no_overlap = afd(&model, TransportKind::Quic, MicroBatches::One);
    println!(
        "checkpoint {}; 4 cards; prompt {PROMPT} tokens; {STEPS} decode steps per point; best of {ROUNDS} interleaved rounds",
        model.display()
    );
    for batch in [1usize, 32] {
        let (mut m, mut q, mut i, mut off, mut modeled_ms) =
            (vec![], vec![], vec![], vec![], vec![]);
        // Interleave so that machine noise hits every configuration alike.
        for _ in 0..ROUNDS {
            m.push(tpot(&mut mono, batch, &mut |_| {}));
            let mut before = Vec::new();
            q.push(tpot(&mut quic.node, batch, &mut |_| {
                before = modeled(&quic.cluster)
            }));
            modeled_ms.push(modeled_per_step(&quic.cluster, &before) * 1e3);
            i.push(tpot(&mut inproc.node, batch, &mut |_| {}));
            off.push(tpot(&mut no_overlap.node, batch, &mut |_| {}));
        }
        let (m, q, i, off) = (best(&m), best(&q), best(&i), best(&off));
        println!(
            "batch {batch:>2}: TPOT monolithic {:7.2} ms | AFD quic {:7.2} ms ({:.2}x) | AFD inproc {:7.2} ms ({:.2}x) | \
             cards' modeled Corsair time {:.3} ms/step",
            m * 1e3,
            q * 1e3,
            q / m,
            i * 1e3,
            i / m,
            modeled_ms[0]
        );
        println!(
            "batch {batch:>2}: quic overlap on {:7.2} ms/step, off {:7.2} ms/step: overlap gives {:.2}x the throughput",
            q * 1e3,
            off * 1e3,
            off / q
        );
    }
    if std::thread::available_parallelism().map_or(1, |n| n.get()) < 2 {
        println!("partitioned overlap: skipped (needs 2 CPUs)");
        return;
    }
    // Drop this process's clusters first so the child has the machine to itself.
    drop((quic, inproc, no_overlap, mono));
    let exe = std::env::current_exe().expect("this benchmark's path");
    let status = std::process::Command::new(exe)
        .arg(&model)
        .arg("--partitioned")
        .status()
        .expect("start the partitioned run");
    assert!(status.success(), "the partitioned run failed: {status}");
}
