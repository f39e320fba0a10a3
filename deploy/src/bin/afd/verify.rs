//! `afd verify`: the disaggregated pipeline against the monolithic reference on a set of
//! prompts: token agreement and the largest logit difference.

use std::path::PathBuf;

use anyhow::{Context, bail};
use deploy::cluster::EmbeddedCluster;
use model::WeightFormat;
use model::forward::{LogitsFor, ReferenceModel, SeqChunk};
use model::generate::GenerationRequest;
use model::sampling::{SamplingParams, argmax};
use step::AttentionNode;

use crate::cluster_args::ClusterArgs;

/// Compare the disaggregated path (`--cards N`) with the reference forward, greedy.
#[derive(Debug, clap::Args)]
pub struct VerifyArgs {
    /// Checkpoint folder.
    #[arg(long)]
    model: PathBuf,
    /// Number of prompts (random token ids, lengths from 1 up).
    #[arg(long, default_value_t = 6)]
    prompts: usize,
    /// Tokens generated per prompt.
    #[arg(long, default_value_t = 16)]
    max_tokens: usize,
    /// Seed of the prompts.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Exit non-zero unless every token agrees.
    #[arg(long)]
    require_exact: bool,
    #[command(flatten)]
    cluster: ClusterArgs,
}

fn prompts(count: usize, vocab: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut s = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    (0..count)
        .map(|i| {
            let len = 1 + i * i * 3;
            (0..len)
                .map(|_| {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    (s % vocab as u64) as u32
                })
                .collect()
        })
        .collect()
}

/// Greedy tokens and the logits that chose them, from the reference.
fn reference(
    model: &mut ReferenceModel,
    prompt: &[u32],
    max_tokens: usize,
) -> anyhow::Result<(Vec<u32>, Vec<Vec<f32>>)> {
    let seq = 0;
    let mut tokens = Vec::new();
    let mut all_logits = Vec::new();
    let mut next = prompt.to_vec();
    for _ in 0..max_tokens {
        let logits = model
            .forward(&[SeqChunk { seq, tokens: next }], LogitsFor::LastToken)?
            .remove(0);
        let t = argmax(&logits);
        tokens.push(t);
        all_logits.push(logits);
        next = vec![t];
    }
    model.free(seq);
    Ok((tokens, all_logits))
}

impl VerifyArgs {
    /// Compute threads for this process's attention side (0: every core).
    pub fn compute_threads(&self) -> usize {
        self.cluster.compute_threads()
    }
}

pub fn run(args: VerifyArgs) -> anyhow::Result<()> {
    // The reference rounds as the cards do, so that bf16 activations are compared like for like.
    let weights = args
        .cluster
        .config(args.model.clone())
        .load_weights(model::weights::ExpertFilter::All)
        .with_context(|| format!("loading {}", args.model.display()))?;
    let cfg = weights.config.clone();
    let stored = match &weights.layers.iter().find_map(|l| match &l.ffn {
        model::weights::FfnWeights::Moe(m) => m
            .experts
            .iter()
            .flatten()
            .next()
            .map(|e| e.gate.weight.format()),
        model::weights::FfnWeights::Dense(d) => Some(d.gate.weight.format()),
    }) {
        Some(f) => *f,
        None => WeightFormat::F32,
    };
    let mut reference_model = ReferenceModel::new(weights)?;
    let config = args.cluster.config(args.model.clone());
    let (mut cluster, mut node) = {
        let mut c = EmbeddedCluster::start(&config, &mut |_| {}).context("starting the cards")?;
        let node = c.take_nodes().pop().context("no attention node")?;
        (c, node)
    };
    node.collect_logits(true);
    println!(
        "family {}, checkpoint weights {stored}, card format {}, {} cards over {}, {} on the wire",
        cfg.family,
        config.weight_format,
        config.cards,
        format!("{:?}", config.transport).to_lowercase(),
        format!("{:?}", config.node.wire_dtype).to_lowercase()
    );
    println!(
        "{:>6} {:>6} {:>10} {:>14}",
        "prompt", "length", "agreement", "max |dlogit|"
    );
    let (mut agree, mut total, mut identical, mut worst) = (0usize, 0usize, 0usize, 0f32);
    for (i, prompt) in prompts(args.prompts, cfg.vocab_size, args.seed)
        .iter()
        .enumerate()
    {
        let (ref_tokens, ref_logits) = reference(&mut reference_model, prompt, args.max_tokens)?;
        let request = GenerationRequest {
            prompt: prompt.clone(),
            max_tokens: args.max_tokens,
            sampling: SamplingParams::greedy(),
            stop_token_ids: vec![],
        };
        // Prompts longer than a step go in chunks, as the server prefills them.
        let got = gpu_attention::driver::generate_in_chunks(
            &mut node,
            std::slice::from_ref(&request),
            1000 + i as u64,
            config.node.max_tokens,
        )?
        .remove(0);
        let logits = node.take_logits();
        // Logits are comparable while both sides have seen the same tokens.
        let mut same_prefix = true;
        let mut max_diff = 0f32;
        let mut matched = 0;
        for (s, (a, b)) in ref_tokens.iter().zip(&got.output_ids).enumerate() {
            if same_prefix && let Some((_, l)) = logits.get(s) {
                let d = ref_logits[s]
                    .iter()
                    .zip(l)
                    .map(|(x, y)| (x - y).abs())
                    .fold(0f32, f32::max);
                max_diff = max_diff.max(d);
            }
            if a == b {
                matched += 1;
            } else {
                same_prefix = false;
            }
        }
        agree += matched;
        total += ref_tokens.len();
        identical += usize::from(matched == ref_tokens.len());
        worst = worst.max(max_diff);
        println!(
            "{i:>6} {:>6} {:>6}/{:<3} {max_diff:>14.3e}",
            prompt.len(),
            matched,
            ref_tokens.len()
        );
    }
    node.free(&[])?;
    println!(
        "{identical}/{} sequences identical, {agree}/{total} tokens agree ({:.1}%), largest logit difference {worst:.3e}",
        args.prompts,
        100.0 * agree as f64 / total.max(1) as f64
    );
    drop(node);
    drop(cluster.take_nodes());
    if args.require_exact && agree != total {
        bail!(
            "{} of {total} tokens differ from the reference",
            total - agree
        );
    }
    Ok(())
}
