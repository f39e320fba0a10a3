//! `afd plan FILE`: what a deployment fits and how fast it runs on real hardware, from the
//! model's shape and the hardware profiles (no weights are read, nothing is started).

use std::path::PathBuf;

use anyhow::{Context, bail};
use deploy::deployment::{Deployment, MicroBatchSetting};
use deploy::plan::plan_deployment;
use gpu_attention::MicroBatches;

/// Plan a deployment file: per card SRAM needed against available (and spills), the attention
/// device's memory, and predicted TPOT, decode step and throughput. Flags override the file.
#[derive(Debug, clap::Args)]
pub struct PlanArgs {
    /// The deployment file (TOML; see docs/PLANNING.md).
    file: PathBuf,
    /// Print one JSON object instead of the report.
    #[arg(long)]
    json: bool,
    /// Override `cards.count` (0: the attention device alone).
    #[arg(long)]
    cards: Option<usize>,
    /// Override `attention.nodes`.
    #[arg(long)]
    attention_nodes: Option<usize>,
    /// Override `attention.profile` (h100, h200 or a profile file).
    #[arg(long)]
    profile: Option<String>,
    /// Override `attention.max_num_seqs`.
    #[arg(long)]
    max_num_seqs: Option<usize>,
    /// Override `attention.max_model_len`.
    #[arg(long)]
    max_model_len: Option<usize>,
    /// Override `model.format` (as-stored, bf16, mxfp4, mxint8).
    #[arg(long)]
    format: Option<corsair_ffn::FormatChoice>,
    /// Override `cards.allow_spill`.
    #[arg(long)]
    allow_spill: Option<bool>,
    /// Override `cards.replicate_experts` (auto, true or false).
    #[arg(long)]
    replicate_experts: Option<planner::ReplicateExperts>,
    /// Override `overlap.micro_batches` (1, 2 or auto).
    #[arg(long)]
    micro_batches: Option<MicroBatches>,
    /// Override `workload.batch` (sequences over all nodes).
    #[arg(long)]
    batch: Option<usize>,
    /// Override `workload.input_len` (the context of the predicted decode step).
    #[arg(long)]
    input_len: Option<usize>,
    /// Override `workload.output_len` (0: one decode step at input_len).
    #[arg(long)]
    output_len: Option<usize>,
}

impl PlanArgs {
    fn apply(&self, d: &mut Deployment) {
        let set = |slot: &mut usize, v: Option<usize>| {
            if let Some(v) = v {
                *slot = v;
            }
        };
        set(&mut d.cards.count, self.cards);
        set(&mut d.attention.nodes, self.attention_nodes);
        set(&mut d.attention.max_num_seqs, self.max_num_seqs);
        set(&mut d.attention.max_model_len, self.max_model_len);
        set(&mut d.workload.batch, self.batch);
        set(&mut d.workload.input_len, self.input_len);
        set(&mut d.workload.output_len, self.output_len);
        if let Some(profile) = &self.profile {
            d.attention.profile = profile.clone();
        }
        if let Some(f) = self.format {
            d.model.format = f;
        }
        if let Some(s) = self.allow_spill {
            d.cards.allow_spill = s;
        }
        if let Some(r) = self.replicate_experts {
            d.cards.replicate_experts = r;
        }
        if let Some(m) = self.micro_batches {
            d.overlap.micro_batches = MicroBatchSetting(m);
        }
    }
}

pub fn run(args: PlanArgs) -> anyhow::Result<()> {
    let mut d = Deployment::load(&args.file)?;
    args.apply(&mut d);
    d.validate()
        .with_context(|| format!("{} with the flags given", args.file.display()))?;
    let plan = plan_deployment(&d)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&plan)?);
    } else {
        println!("{plan}");
    }
    if !plan.fits {
        bail!(
            "{} does not fit: {}",
            args.file.display(),
            plan.problems.join("; ")
        );
    }
    Ok(())
}
