//! `afd plan FILE`: what a deployment fits and how fast it runs on real hardware, from the
//! model's shape and the hardware profiles (no weights are read, nothing is started).

use std::path::PathBuf;

use anyhow::{Context, bail};
use deploy::deployment::Deployment;
use deploy::plan::plan_deployment;

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
