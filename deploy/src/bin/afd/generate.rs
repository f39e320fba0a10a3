//! `afd generate`: one prompt in, one JSON object out, through the disaggregated pipeline
//! (`--cards N`) or the monolithic reference (`--reference`).

use std::path::PathBuf;

use anyhow::{Context, bail};
use deploy::cluster::EmbeddedCluster;
use gpu_attention::device::DeviceMonolithicNode;
use model::generate::{Generation, GenerationRequest, generate};
use model::sampling::SamplingParams;
use model::{ModelTokenizer, ReferenceModel};

use crate::cluster_args::ClusterArgs;

/// Generate a continuation of one prompt and print `{prompt_ids, output_ids, text}` as JSON.
#[derive(Debug, clap::Args)]
pub struct GenerateArgs {
    /// Checkpoint folder (Hugging Face layout).
    #[arg(long)]
    model: PathBuf,
    /// Run the monolithic reference forward (the whole model in this process) instead of the
    /// disaggregated pipeline; with --device cuda, the whole model on the GPU.
    #[arg(long)]
    reference: bool,
    /// Prompt as comma-separated token ids.
    #[arg(
        long,
        value_delimiter = ',',
        conflicts_with = "prompt",
        required_unless_present = "prompt"
    )]
    prompt_ids: Vec<u32>,
    /// Prompt as text (needs the checkpoint's tokenizer.json).
    #[arg(long)]
    prompt: Option<String>,
    /// Tokens to generate.
    #[arg(long, default_value_t = 16)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus sampling mass.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Keep only the k most probable tokens (0: off).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Drop tokens below this fraction of the most probable one's probability.
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// Seed for sampling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Keep generating after an end-of-sequence token.
    #[arg(long)]
    ignore_eos: bool,
    /// Sequences decoded side by side, each the prompt with its own seed (`--seed`, plus one
    /// for each further sequence): one batch, as a server steps concurrent requests, to time
    /// or --trace batched steps. Prints one JSON object per sequence, one per line.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=256))]
    num_seqs: u32,
    /// Write a Chrome trace of the attention node's per-layer spans and, beside them, each
    /// card's messages (waiting for a CPU turn, computing, with the worker's CPU time) to this
    /// file (with --cards; open it in chrome://tracing or ui.perfetto.dev).
    #[arg(long, conflicts_with = "reference")]
    trace: Option<PathBuf>,
    #[command(flatten)]
    cluster: ClusterArgs,
}

impl GenerateArgs {
    /// Compute threads for this process's attention side (0: every core).
    pub fn compute_threads(&self) -> usize {
        if self.reference {
            0
        } else {
            self.cluster.compute_threads()
        }
    }
}

pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    if !(0.0..=2.0).contains(&args.temperature)
        || !(0.0..=1.0).contains(&args.top_p)
        || args.top_p == 0.0
    {
        bail!("--temperature must be in [0, 2] and --top-p in (0, 1]");
    }
    if !(0.0..=1.0).contains(&args.min_p) {
        bail!("--min-p must be in [0, 1]");
    }
    let tokenizer = ModelTokenizer::load(&args.model);
    let prompt_ids = match &args.prompt {
        Some(text) => tokenizer
            .as_ref()
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .encode(text, true)
            .context("tokenizing --prompt")?,
        None => args.prompt_ids.clone(),
    };
    let config = model::ModelConfig::from_file(&args.model.join("config.json"))
        .with_context(|| format!("reading the checkpoint in {}", args.model.display()))?;
    let stop_token_ids = match (&tokenizer, args.ignore_eos) {
        (_, true) => Vec::new(),
        (Ok(t), false) => t.eos_token_ids.clone(),
        (Err(_), false) => config.eos_token_ids.clone(),
    };
    let request = GenerationRequest {
        prompt: prompt_ids.clone(),
        max_tokens: args.max_tokens,
        sampling: SamplingParams {
            temperature: args.temperature,
            top_p: args.top_p,
            top_k: args.top_k,
            min_p: args.min_p,
            seed: args.seed,
        },
        stop_token_ids,
    };
    let requests: Vec<GenerationRequest> = (0..u64::from(args.num_seqs))
        .map(|i| GenerationRequest {
            sampling: SamplingParams {
                seed: request.sampling.seed.wrapping_add(i),
                ..request.sampling
            },
            ..request.clone()
        })
        .collect();
    // This thread steps the model: make it a worker of the compute pool, as a server's engine is.
    let generations = step::compute::on_own_pool("afd-compute", || {
        if args.reference {
            let weights = args
                .cluster
                .config(args.model.clone())
                .load_weights(model::weights::ExpertFilter::All)
                .with_context(|| format!("loading the checkpoint in {}", args.model.display()))?;
            let device = args.cluster.node.device;
            crate::cluster_args::check_device_numerics(device, args.cluster.node.activation_dtype)?;
            if device.is_host() {
                let mut model = ReferenceModel::new(weights)?;
                Ok(generate(&mut model, &requests, 0)?)
            } else {
                let kv = args.cluster.config(args.model.clone()).node.kv;
                let mut node = DeviceMonolithicNode::new(&weights, &kv, device)
                    .with_context(|| format!("the whole model on {device}"))?;
                Ok(gpu_attention::driver::generate(&mut node, &requests, 0)?)
            }
        } else {
            disaggregated(&args, &requests)
        }
    })?;
    if generations.len() != requests.len() {
        bail!(
            "the generator returned {} sequences for {} requests",
            generations.len(),
            requests.len()
        );
    }
    for generation in generations {
        let text = match &tokenizer {
            Ok(t) => Some(t.decode(&generation.output_ids, false)?),
            Err(_) => None,
        };
        let out = serde_json::json!({
            "prompt_ids": prompt_ids,
            "output_ids": generation.output_ids,
            "text": text,
            "finish_reason": generation.finish_reason,
        });
        println!("{out}");
    }
    Ok(())
}

fn disaggregated(
    args: &GenerateArgs,
    requests: &[GenerationRequest],
) -> anyhow::Result<Vec<Generation>> {
    let mut config = args.cluster.config(args.model.clone());
    // Spans are kept only when they will be written: a node records them until taken.
    config.node.trace = args.trace.is_some();
    let mut cluster = EmbeddedCluster::start(&config, &mut |_| {}).with_context(|| {
        format!(
            "starting {} cards for {}",
            config.cards,
            args.model.display()
        )
    })?;
    let mut node = cluster
        .take_nodes()
        .pop()
        .context("the cluster started no attention node")?;
    // Prompts longer than a step go in chunks, as the server prefills them.
    let result =
        gpu_attention::driver::generate_in_chunks(&mut node, requests, 0, config.node.max_tokens)
            .context("generating through the cards")?;
    if let Some(path) = &args.trace {
        // The node's spans, and the cards' messages beside them on the same clock.
        let stats = cluster.card_stats();
        let per_card: Vec<String> = stats
            .iter()
            .map(|s| format!("{:.0}", s.compute_seconds * 1e3))
            .collect();
        eprintln!(
            "the cards computed for {:.0} ms in all over {} messages (per card, ms: {})",
            stats.iter().map(|s| s.compute_seconds).sum::<f64>() * 1e3,
            stats.iter().map(|s| s.messages).sum::<u64>(),
            per_card.join(" ")
        );
        let json = deploy::timeline::run_trace(
            &node.take_trace(),
            node.trace_origin(),
            &cluster.take_card_spans(),
        );
        std::fs::write(path, serde_json::to_string(&json)?)
            .with_context(|| format!("writing the trace to {}", path.display()))?;
        eprintln!(
            "wrote a Chrome trace to {} (open it in chrome://tracing or ui.perfetto.dev)",
            path.display()
        );
    }
    Ok(result)
}
