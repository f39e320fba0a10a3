//! The seed's GPT-OSS-20B figures (seed 004, `docs/reference/hardware.md`) the system model must
//! reproduce, and the fit of its two calibrated constants, each on one named figure.
//!
//! Calibrated (both in the device profile, `calibrated = [...]`):
//! - `kernels.fixed_ns`, the fixed cost of one GPU kernel, fitted on "1x H100 + 8 cards: TPOT
//!   1.28 ms" (that row involves no MXFP4 kernel on the GPU, so it fixes this constant alone);
//! - `kernels.mxfp4_moe_bandwidth_efficiency`, the HBM bandwidth fraction of the GPU's MXFP4
//!   expert kernels, fitted on "1x H100 alone: TPOT 2.59 ms" with the first constant fixed.
//!
//! The batch-64 rows are then predictions.

use model::ModelConfig;
use serde::{Deserialize, Serialize};

use corsair_ffn::compiler::StoredFormats;

use super::Target;
use super::{Plan, Profiles, plan};
use crate::error::{Error, Result};

/// What a seed figure measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Metric {
    /// `predicted.tpot_ms`.
    TpotMs,
    /// `predicted.step_ms`.
    StepMs,
    /// `predicted.output_tokens_per_s`.
    OutputTokensPerS,
}

impl Metric {
    /// The metric's value in a plan.
    pub fn of(self, plan: &Plan) -> Option<f64> {
        let p = plan.predicted.as_ref()?;
        Some(match self {
            Metric::TpotMs => p.tpot_ms,
            Metric::StepMs => p.step_ms,
            Metric::OutputTokensPerS => p.output_tokens_per_s,
        })
    }
}

/// One seed figure and the deployment file that models it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SeedRow {
    /// The setup in the seed's words.
    pub setup: &'static str,
    /// The deployment file in `deploy/deployments/`.
    pub file: &'static str,
    /// Workload overrides (`input_len`, `output_len`) applied to the file, if any.
    pub workload: Option<(usize, usize)>,
    /// What is compared.
    pub metric: Metric,
    /// The seed's figure.
    pub figure: f64,
    /// The constant fitted on this row, if any.
    pub calibrates: Option<&'static str>,
}

/// The seed's figures, in the order of `docs/reference/hardware.md`.
pub const SEED_ROWS: [SeedRow; 4] = [
    SeedRow {
        setup: "GPT-OSS-20B, 1x H100 alone, batch 1, 1K context: TPOT",
        file: "gpt-oss-20b-1xh100.toml",
        workload: None,
        metric: Metric::TpotMs,
        figure: 2.59,
        calibrates: Some("kernels.mxfp4_moe_bandwidth_efficiency"),
    },
    SeedRow {
        setup: "GPT-OSS-20B, 1x H100 + 8 Corsair cards, batch 1, 1K context: TPOT",
        file: "gpt-oss-20b-1xh100-8cards.toml",
        workload: None,
        metric: Metric::TpotMs,
        figure: 1.28,
        calibrates: Some("kernels.fixed_ns"),
    },
    SeedRow {
        setup: "batch 64: 2x H100 (32 users each) + 8 cards, context 129: decode step",
        file: "gpt-oss-20b-2xh100-8cards-batch64.toml",
        workload: None,
        metric: Metric::StepMs,
        figure: 2.46,
        calibrates: None,
    },
    SeedRow {
        setup: "batch 64: 2x H100 + 8 cards, 1K in / 1K out: output tokens/s",
        file: "gpt-oss-20b-2xh100-8cards-batch64.toml",
        workload: Some((1024, 1024)),
        metric: Metric::OutputTokensPerS,
        figure: 20413.0,
        calibrates: None,
    },
];

/// Applies a row's workload overrides.
pub fn apply(row: &SeedRow, d: &mut Target) {
    if let Some((input_len, output_len)) = row.workload {
        d.workload.input_len = input_len;
        d.workload.output_len = output_len;
    }
}

/// The two calibrated constants.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    /// `kernels.fixed_ns`.
    pub fixed_ns: f64,
    /// `kernels.mxfp4_moe_bandwidth_efficiency`.
    pub mxfp4_moe_bandwidth_efficiency: f64,
}

/// Solves `f(x) = target` for an increasing or decreasing `f` on `[lo, hi]` by bisection.
fn solve(mut lo: f64, mut hi: f64, target: f64, f: impl Fn(f64) -> Result<f64>) -> Result<f64> {
    let (flo, fhi) = (f(lo)? - target, f(hi)? - target);
    if flo.signum() == fhi.signum() {
        return Err(Error::Config(format!(
            "cannot calibrate: the figure {target} is outside what the model gives on [{lo}, {hi}]"
        )));
    }
    let rising = fhi > flo;
    for _ in 0..60 {
        let mid = 0.5 * (lo + hi);
        if (f(mid)? - target > 0.0) == rising {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    Ok(0.5 * (lo + hi))
}

/// Fits both constants: `fixed_ns` on the AFD row (`afd`), then the MXFP4 efficiency on the
/// GPU-alone row (`alone`), starting from `profiles`.
pub fn calibrate(
    afd: &Target,
    alone: &Target,
    config: &ModelConfig,
    stored: &StoredFormats,
    profiles: &Profiles,
) -> Result<Calibration> {
    let value = |d: &Target, p: &Profiles, row: &SeedRow| -> Result<f64> {
        row.metric
            .of(&plan(d, config, stored, p)?)
            .ok_or_else(|| Error::Config(format!("{}: no prediction", row.file)))
    };
    let [alone_row, afd_row, ..] = SEED_ROWS;
    let with = |fixed_ns: f64, efficiency: Option<f64>| {
        let mut p = profiles.clone();
        p.device.kernels.fixed_ns = fixed_ns;
        if let Some(e) = efficiency {
            p.device.kernels.mxfp4_moe_bandwidth_efficiency = e;
        }
        p
    };
    let fixed_ns = solve(0.0, 50_000.0, afd_row.figure, |x| {
        value(afd, &with(x, None), &afd_row)
    })?;
    let efficiency = solve(0.01, 1.0, alone_row.figure, |x| {
        value(alone, &with(fixed_ns, Some(x)), &alone_row)
    })?;
    Ok(Calibration {
        fixed_ns,
        mxfp4_moe_bandwidth_efficiency: efficiency,
    })
}
