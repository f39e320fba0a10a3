//! The seed's figures on deployment files: [`planner::seed`]'s rows and calibration, applied to
//! the files in `deploy/deployments/`.

use corsair_ffn::compiler::StoredFormats;
use model::ModelConfig;
use planner::Profiles;
pub use planner::seed::{Calibration, Metric, SEED_ROWS, SeedRow};

use crate::deployment::Deployment;
use crate::error::Result;

/// Applies a row's workload overrides.
pub fn apply(row: &SeedRow, d: &mut Deployment) {
    if let Some((input_len, output_len)) = row.workload {
        d.workload.input_len = input_len;
        d.workload.output_len = output_len;
    }
}

/// Fits both calibrated constants: `fixed_ns` on the AFD row (`afd`), then the MXFP4
/// efficiency on the GPU-alone row (`alone`), starting from `profiles`.
pub fn calibrate(
    afd: &Deployment,
    alone: &Deployment,
    config: &ModelConfig,
    stored: &StoredFormats,
    profiles: &Profiles,
) -> Result<Calibration> {
    Ok(planner::seed::calibrate(
        &super::target(afd),
        &super::target(alone),
        config,
        stored,
        profiles,
    )?)
}
