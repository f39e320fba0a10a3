//! `afd plan FILE`: what a deployment fits and how fast it runs on real hardware, from the
//! model's shape and the hardware profiles (no weights are read, nothing is started).

use std::path::PathBuf;

use anyhow::{Context, bail};
use deploy::deployment::Deployment;
use deploy::plan::{plan_deployment, plan_deployment_by_load};

use crate::overrides::DeploymentOverrides;

/// Plan a deployment file: per card SRAM needed against available (and spills), the attention
/// device's memory, and predicted TPOT, decode step and throughput. Flags override the file.
#[derive(Debug, clap::Args)]
pub struct PlanArgs {
    /// The deployment file (TOML; see docs/PLANNING.md).
    file: PathBuf,
    /// Print one JSON object instead of the report.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    overrides: DeploymentOverrides,
    /// Override `workload.batch` (sequences over all nodes).
    #[arg(long)]
    batch: Option<usize>,
    /// Override `workload.input_len` (the context of the predicted decode step).
    #[arg(long)]
    input_len: Option<usize>,
    /// Override `workload.output_len` (0: one decode step at input_len).
    #[arg(long)]
    output_len: Option<usize>,
    /// Also place the experts by the load this routing record measured (`afd serve
    /// --record-routing FILE`, `afd emulate --routing model --record-routing FILE`): the
    /// balancedness and the cards' modeled decode step with the file's placement and by load.
    /// Default: the file's `cards.expert_load` where it sets `placement = "load"`.
    #[arg(long, value_name = "FILE")]
    expert_load: Option<PathBuf>,
    /// With --expert-load: extra copies per MoE layer, each to the expert with the most load
    /// per copy (vLLM's name).
    #[arg(long, default_value_t = 0, requires = "expert_load")]
    num_redundant_experts: usize,
    /// With --expert-load: the cards form this many equal groups, each expert's copies inside
    /// one (default: the file's `cards.groups`).
    #[arg(long, requires = "expert_load")]
    card_groups: Option<usize>,
}

impl PlanArgs {
    fn apply(&self, d: &mut Deployment) {
        self.overrides.apply(d);
        let set = |slot: &mut usize, v: Option<usize>| {
            if let Some(v) = v {
                *slot = v;
            }
        };
        set(&mut d.workload.batch, self.batch);
        set(&mut d.workload.input_len, self.input_len);
        set(&mut d.workload.output_len, self.output_len);
        if let Some(groups) = self.card_groups {
            d.cards.groups = groups;
        }
    }
}

pub fn run(args: PlanArgs) -> anyhow::Result<()> {
    let mut d = Deployment::load(&args.file)?;
    args.apply(&mut d);
    d.validate()
        .with_context(|| format!("{} with the flags given", args.file.display()))?;
    let plan = plan_deployment(&d)?;
    // The flag, or the file's own `placement = "load"` (reported beside the contiguous plan).
    let load = match (&args.expert_load, &d.cards.expert_load) {
        (Some(record), _) => Some((record.clone(), args.num_redundant_experts)),
        (None, Some(record)) => Some((record.clone(), d.cards.num_redundant_experts)),
        (None, None) => None,
    };
    let by_load = match &load {
        Some((record, redundant)) => Some(plan_deployment_by_load(&d, record, *redundant)?),
        None => None,
    };
    if args.json {
        let mut json = serde_json::to_value(&plan)?;
        if let (Some(by_load), Some(object)) = (&by_load, json.as_object_mut()) {
            object.insert("placement_by_load".into(), serde_json::to_value(by_load)?);
        }
        println!("{}", serde_json::to_string_pretty(&json)?);
    } else {
        println!("{plan}");
        if let Some(by_load) = &by_load {
            println!("{by_load}");
        }
    }
    if let Some(by_load) = by_load.as_ref().filter(|p| !p.fits) {
        bail!(
            "the placement by load of {} does not fit: {} (fewer --num-redundant-experts, or \
             more cards)",
            args.file.display(),
            by_load.problems.join("; ")
        );
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
