//! Part (b): speed on a GPT-OSS-20B-shaped checkpoint. The attention node's own work per layer
//! and per decode step (attention, the copy of the rows to dispatch, the combine of partial
//! sums; the cards' replies are zeros of the right shape, so only the node is timed) at each
//! batch and a fixed context, then the GPU-only baseline's TPOT at batch 1; `afd plan`'s
//! prediction for the same shape and batch on the GPU's profile beside each figure.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::Tensor;
use deploy::deployment::Deployment;
use deploy::plan::plan_deployment;
use gpu_attention::device::inputs::{MbInputs, SpanInput};
use gpu_attention::device::{DeviceCompute, DeviceMonolithicNode};
use gpu_attention::dispatch::{ExpertPlacement, plan_dispatch};
use gpu_attention::kv_cache::KvCacheConfig;
use model::ModelWeights;
use model::config::FfnKind;
use model::forward::rope::Rope;
use model::sampling::SamplingParams;
use model::weights::{ExpertFilter, LoadOptions};
use step::{AttentionNode, SampleRequest, StepBatch, StepEntry};

use super::Args;

const BLOCK: usize = 16;

/// Median of `v` (loadtest's statistics, numpy's interpolation); NaN when empty.
fn median(v: Vec<f64>) -> f64 {
    loadtest::stats::median(&v).unwrap_or(f64::NAN)
}

fn token(i: usize, p: usize, vocab: usize) -> u32 {
    ((i * 7919 + p * 104_729) % vocab.max(1)) as u32
}

/// The planner's prediction for `file` (a shipped deployment) at this batch and context.
struct Planned {
    /// The attention device's kernels per layer, all micro-batches (ms).
    device_per_layer_ms: f64,
    /// Decode step (ms).
    step_ms: f64,
    /// Embedding lookup (ms).
    embedding_ms: f64,
}

fn planned(args: &Args, file: &str, cards: usize, batch: usize) -> Result<Planned> {
    let path = args.deployments.join(file);
    let mut d = Deployment::load(&path)?;
    d.attention.profile = args.profile.clone();
    d.attention.max_num_seqs = batch.max(d.attention.max_num_seqs);
    d.cards.count = cards;
    d.workload.batch = batch;
    d.workload.input_len = args.context;
    d.workload.output_len = 0;
    let plan = plan_deployment(&d).with_context(|| format!("planning {}", path.display()))?;
    let p = plan
        .predicted
        .with_context(|| format!("{} predicts nothing: {:?}", path.display(), plan.problems))?;
    Ok(Planned {
        device_per_layer_ms: p.breakdown.device_per_layer * 1e3,
        step_ms: p.step_ms,
        embedding_ms: p.breakdown.embedding_seconds * 1e3,
    })
}

/// Contiguous blocks of experts per card, as the cards' default placement.
fn placement(weights: &ModelWeights, cards: usize) -> Result<ExpertPlacement> {
    let cfg = &weights.config;
    let experts = cfg.moe.map_or(0, |m| m.num_experts);
    let per = experts.div_ceil(cards.max(1));
    let moe: Vec<bool> = cfg.layers.iter().map(|l| l.ffn == FfnKind::Moe).collect();
    let card_experts: Vec<Vec<Vec<u32>>> = (0..cards)
        .map(|c| {
            moe.iter()
                .map(|&m| {
                    if m {
                        ((c * per).min(experts) as u32..((c + 1) * per).min(experts) as u32)
                            .collect()
                    } else {
                        Vec::new()
                    }
                })
                .collect()
        })
        .collect();
    Ok(ExpertPlacement::new(
        cfg.num_layers(),
        experts,
        &moe,
        &card_experts,
    )?)
}

/// The node's timed work: every layer of a decode step for the micro-batches `mbs`.
struct NodeBench<'a> {
    compute: &'a DeviceCompute,
    placement: &'a ExpertPlacement,
    rope: Rope,
    hidden: usize,
    vocab: usize,
    blocks_per_seq: usize,
}

impl NodeBench<'_> {
    fn tables(&self, i: usize) -> Vec<u32> {
        ((i * self.blocks_per_seq) as u32..((i + 1) * self.blocks_per_seq) as u32).collect()
    }

    fn inputs(&self, seqs: &[usize], past: usize, len: usize) -> Result<(Tensor, MbInputs)> {
        let tables: Vec<Vec<u32>> = seqs.iter().map(|&i| self.tables(i)).collect();
        let tokens: Vec<Vec<u32>> = seqs
            .iter()
            .map(|&i| {
                (past..past + len)
                    .map(|p| token(i, p, self.vocab))
                    .collect()
            })
            .collect();
        let spans: Vec<SpanInput<'_>> = tokens
            .iter()
            .zip(&tables)
            .map(|(t, table)| SpanInput {
                tokens: t,
                past,
                table,
            })
            .collect();
        let positions: Vec<usize> = seqs.iter().flat_map(|_| past..past + len).collect();
        Ok(self
            .compute
            .prepare(&spans, &self.rope.tables(&positions))?)
    }

    /// One layer of one micro-batch: attention, the rows to dispatch, zeros back combined.
    fn layer(&self, layer: usize, x: &mut Tensor, inputs: &MbInputs, past: usize) -> Result<()> {
        let ffn = self.compute.attention(layer, x, inputs)?;
        let (tokens, partials) = match &ffn.routing {
            Some(routing) => {
                let keys = vec![past as u64; inputs.rows];
                let plan = plan_dispatch(routing, layer, self.placement, &keys);
                let rows: Vec<u32> = plan
                    .cards
                    .iter()
                    .flat_map(|c| c.rows.iter().map(|&r| r as u32))
                    .collect();
                let zeros = vec![0f32; rows.len() * self.hidden];
                (rows, zeros)
            }
            None => (
                (0..inputs.rows as u32).collect(),
                vec![0f32; inputs.rows * self.hidden],
            ),
        };
        self.compute.add_partials(x, tokens, partials)?;
        Ok(())
    }

    /// A decode step of `batch` sequences at `past`: (seconds in the layers, whole step).
    fn decode_step(&self, batch: usize, past: usize) -> Result<(f64, f64)> {
        let started = Instant::now();
        let seqs: Vec<usize> = (0..batch).collect();
        let halves: Vec<&[usize]> = if batch >= 2 {
            let (a, b) = seqs.split_at(batch / 2);
            vec![a, b]
        } else {
            vec![&seqs[..]]
        };
        let mut mbs = halves
            .iter()
            .map(|s| self.inputs(s, past, 1))
            .collect::<Result<Vec<_>>>()?;
        let layers_started = Instant::now();
        for layer in 0..self.compute.layers() {
            for (x, inputs) in &mut mbs {
                self.layer(layer, x, inputs, past)?;
            }
        }
        let layers = layers_started.elapsed().as_secs_f64();
        for (x, inputs) in &mbs {
            let rows: Vec<u32> = (0..inputs.rows as u32).collect();
            self.compute.final_rows(x, &rows)?;
        }
        Ok((layers, started.elapsed().as_secs_f64()))
    }
}

/// Runs part (b).
pub fn run(args: &Args, checkpoint: &Path) -> Result<()> {
    println!(
        "-- (b) speed on {} (context {}, {} decode steps per batch, median), profile {}",
        checkpoint.display(),
        args.context,
        args.steps,
        args.profile
    );
    let dev = args
        .device
        .open()?
        .context("the speed part runs on a device: --device cuda (or candle-cpu)")?;
    let started = Instant::now();
    let weights = ModelWeights::load_with(
        checkpoint,
        &LoadOptions {
            experts: ExpertFilter::None,
            ..LoadOptions::default()
        },
    )
    .with_context(|| format!("loading {}", checkpoint.display()))?;
    let cfg = weights.config.clone();
    let max_batch = args.batches.iter().copied().max().unwrap_or(1);
    let blocks_per_seq = (args.context + args.steps + 4).div_ceil(BLOCK);
    let kv = KvCacheConfig {
        block_size: BLOCK,
        memory_bytes: max_batch * blocks_per_seq * BLOCK * KvCacheConfig::bytes_per_token(&cfg),
        gpu_memory_utilization: None,
    };
    let compute = DeviceCompute::new(&weights, &kv, &dev)?;
    println!(
        "attention weights on {}: {:.2} GiB; KV cache {} blocks of {BLOCK}; loaded in {:.1} s",
        args.device,
        compute.weight_bytes() as f64 / (1u64 << 30) as f64,
        compute.capacity().num_blocks,
        started.elapsed().as_secs_f64()
    );
    let bench = NodeBench {
        compute: &compute,
        placement: &placement(&weights, args.bench_cards)?,
        rope: Rope::new(&cfg),
        hidden: cfg.hidden_size,
        vocab: cfg.vocab_size,
        blocks_per_seq,
    };
    let prefill = Instant::now();
    for i in 0..max_batch {
        let (mut x, inputs) = bench.inputs(&[i], 0, args.context)?;
        for layer in 0..compute.layers() {
            compute.attention(layer, &mut x, &inputs)?;
        }
    }
    println!(
        "prefilled {max_batch} sequences of {} tokens in {:.1} s",
        args.context,
        prefill.elapsed().as_secs_f64()
    );
    println!(
        "{:>6} {:>12} {:>12} {:>7} {:>12} {:>12} {:>7}",
        "batch", "layer ms", "planned", "ratio", "step ms", "planned", "ratio"
    );
    let layers = compute.layers() as f64;
    for &batch in &args.batches {
        // Two warm-up steps (module loading, allocator), then the timed ones.
        for _ in 0..2 {
            bench.decode_step(batch, args.context)?;
        }
        let mut per_layer = Vec::new();
        let mut per_step = Vec::new();
        for s in 0..args.steps {
            let (l, t) = bench.decode_step(batch, args.context + s)?;
            per_layer.push(l / layers * 1e3);
            per_step.push(t * 1e3);
        }
        let (layer_ms, step_ms) = (median(per_layer), median(per_step));
        let p = planned(
            args,
            "gpt-oss-20b-1xh100-8cards.toml",
            args.bench_cards,
            batch,
        )?;
        let planned_step = p.device_per_layer_ms * layers + p.embedding_ms;
        println!(
            "{batch:>6} {layer_ms:>12.3} {:>12.3} {:>7.2} {step_ms:>12.3} {planned_step:>12.3} {:>7.2}",
            p.device_per_layer_ms,
            layer_ms / p.device_per_layer_ms,
            step_ms / planned_step
        );
    }
    println!(
        "(node's own work: attention, the rows to dispatch copied out, partial sums copied in and \
         added; planned: the planner's attention-device kernels of the same step on {} with {} \
         cards)",
        args.profile, args.bench_cards
    );
    drop(compute);
    if args.no_baseline {
        return Ok(());
    }
    baseline(args, checkpoint)
}

/// The GPU-only baseline's TPOT at batch 1 and the context, against the planner's one GPU alone.
fn baseline(args: &Args, checkpoint: &Path) -> Result<()> {
    let started = Instant::now();
    let weights = ModelWeights::load(checkpoint)?;
    let cfg = weights.config.clone();
    let blocks = (args.context + args.steps + 4).div_ceil(BLOCK);
    let kv = KvCacheConfig {
        block_size: BLOCK,
        memory_bytes: blocks * BLOCK * KvCacheConfig::bytes_per_token(&cfg),
        gpu_memory_utilization: None,
    };
    let mut node = DeviceMonolithicNode::new(&weights, &kv, args.device)?;
    drop(weights);
    println!(
        "GPU-only baseline: the whole model on {}: {:.2} GiB of weights, loaded in {:.1} s",
        args.device,
        node.weight_bytes() as f64 / (1u64 << 30) as f64,
        started.elapsed().as_secs_f64()
    );
    let request = SampleRequest {
        params: SamplingParams::greedy(),
        penalties: Default::default(),
        logprobs: false,
        top_logprobs: 0,
        allowed: None,
    };
    let entry = |tokens: Vec<u32>, start: usize| StepEntry {
        seq: 1,
        tokens,
        start,
        prompt_len: args.context,
        block_table: (0..blocks as u32).collect(),
        sample: Some(request.clone()),
        cached_prefix: Vec::new(),
        prompt_logprobs: None,
    };
    let prompt: Vec<u32> = (0..args.context)
        .map(|p| token(1, p, cfg.vocab_size))
        .collect();
    let mut next = node.step(&StepBatch {
        entries: vec![entry(prompt, 0)],
    })?;
    let mut times = Vec::new();
    for s in 0..args.steps + 2 {
        let t = next.sampled.first().map_or(0, |s| s.token);
        let started = Instant::now();
        next = node.step(&StepBatch {
            entries: vec![entry(vec![t], args.context + s)],
        })?;
        if s >= 2 {
            times.push(started.elapsed().as_secs_f64() * 1e3);
        }
    }
    let tpot = median(times);
    let p = planned(args, "gpt-oss-20b-1xh100.toml", 0, 1)?;
    println!(
        "GPU-only baseline TPOT at batch 1, context {}: {tpot:.3} ms, planned {:.3} ms (ratio {:.2})",
        args.context,
        p.step_ms,
        tpot / p.step_ms
    );
    Ok(())
}

/// The shipped deployment files (the planner's seed deployments).
pub fn default_deployments() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deployments")
}
