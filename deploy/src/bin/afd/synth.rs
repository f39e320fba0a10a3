//! `afd synth`: write a random checkpoint in Hugging Face layout.

use std::path::PathBuf;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use model::Family;
use model::synth::{Preset, SynthFormat, SynthOptions, synthesize};

/// Write a random checkpoint (config, tokenizer, safetensors) of any preset size.
#[derive(Debug, clap::Args)]
pub struct SynthArgs {
    /// Model family: gpt-oss, mixtral or qwen3-moe.
    #[arg(long)]
    family: Family,
    /// Size: tiny, small, medium (a few hundred MB) or gpt-oss-20b (GPT-OSS only).
    #[arg(long, default_value = "tiny")]
    preset: Preset,
    /// Output folder (created if missing).
    #[arg(long)]
    out: PathBuf,
    /// Weight format: bf16, mxfp4 (GPT-OSS hub layout) or f32. Default: mxfp4 for gpt-oss-20b, else bf16.
    #[arg(long)]
    format: Option<SynthFormat>,
    /// Write only config.json and the tokenizer files (for shapes too big to write).
    #[arg(long)]
    config_only: bool,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

pub fn run(args: SynthArgs) -> anyhow::Result<()> {
    let options = SynthOptions {
        family: args.family,
        preset: args.preset,
        format: args.format,
        seed: args.seed,
        config_only: args.config_only,
    };
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:40}] {bytes}/{total_bytes} ({eta})")
            .context("progress bar template")?
            .progress_chars("=> "),
    );
    bar.set_message("writing weights");
    let report = synthesize(&args.out, &options, &mut |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    })
    .with_context(|| format!("synthesizing a checkpoint into {}", args.out.display()))?;
    bar.finish_and_clear();
    let c = &report.config;
    println!(
        "wrote {} ({} {}, {} layers, hidden {}, {} experts top-{}, {:.1}M parameters, {:.1} MB of weights)",
        report.dir.display(),
        c.family,
        model::synth::resolved_format(&options)?.name(),
        c.num_layers(),
        c.hidden_size,
        c.moe.map_or(0, |m| m.num_experts),
        c.moe.map_or(0, |m| m.top_k),
        report.parameters as f64 / 1e6,
        report.weight_bytes as f64 / 1e6,
    );
    Ok(())
}
