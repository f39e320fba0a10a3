//! Sweeps: the same workload at several concurrencies or arrival rates, one `BenchmarkResult`
//! per point, plus a summary of the key numbers per point.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

use crate::config::BenchmarkConfig;
use crate::error::Error;
use crate::result::{BenchmarkResult, LatencyStats};
use crate::runner::{resolve_model, run_benchmark};

/// What a sweep varies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SweepParameter {
    /// `max_concurrency` (requests in flight).
    MaxConcurrency,
    /// `request_rate` (requests per second; `inf` allowed).
    RequestRate,
}

impl SweepParameter {
    /// The result field it sets.
    pub fn field_name(self) -> &'static str {
        match self {
            SweepParameter::MaxConcurrency => "max_concurrency",
            SweepParameter::RequestRate => "request_rate",
        }
    }

    /// Axis title with unit.
    pub fn axis_title(self) -> &'static str {
        match self {
            SweepParameter::MaxConcurrency => "max concurrency (requests in flight)",
            SweepParameter::RequestRate => "request rate (requests/s)",
        }
    }
}

/// A sweep: a parameter and its values, run in the order given.
#[derive(Debug, Clone, PartialEq)]
pub struct Sweep {
    /// What varies.
    pub parameter: SweepParameter,
    /// Its values (concurrencies are whole numbers; rates may be infinite).
    pub values: Vec<f64>,
}

impl FromStr for Sweep {
    type Err = String;
    /// `concurrency=1,2,4,8` or `rate=0.5,1,2,inf`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let usage = "write a sweep as concurrency=1,2,4,8 or rate=0.5,1,2,inf";
        let (name, list) = s
            .split_once('=')
            .ok_or_else(|| format!("'{s}' is not a sweep: {usage}"))?;
        let parameter = match name.trim() {
            "concurrency" | "max-concurrency" | "max_concurrency" => SweepParameter::MaxConcurrency,
            "rate" | "request-rate" | "request_rate" => SweepParameter::RequestRate,
            other => return Err(format!("cannot sweep '{other}': {usage}")),
        };
        let mut values = Vec::new();
        for item in list.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let value: f64 = item
                .parse()
                .map_err(|_| format!("'{item}' is not a number: {usage}"))?;
            let valid = match parameter {
                SweepParameter::MaxConcurrency => {
                    value.is_finite() && value >= 1.0 && value.fract() == 0.0
                }
                SweepParameter::RequestRate => value > 0.0,
            };
            if !valid {
                return Err(format!(
                    "'{item}' is not a valid {}: concurrencies are whole numbers >= 1, rates are > 0 or inf",
                    parameter.field_name()
                ));
            }
            values.push(value);
        }
        if values.is_empty() {
            return Err(format!("the sweep '{s}' lists no values: {usage}"));
        }
        Ok(Sweep { parameter, values })
    }
}

impl Sweep {
    /// `base` with the swept parameter set to `value`.
    pub fn config_for(&self, base: &BenchmarkConfig, value: f64) -> BenchmarkConfig {
        let mut config = base.clone();
        match self.parameter {
            SweepParameter::MaxConcurrency => config.max_concurrency = Some(value as usize),
            SweepParameter::RequestRate => config.request_rate = value,
        }
        config
    }
}

/// Formats a sweep value for labels and file names: `4`, `0.5`, `inf`.
pub fn format_value(value: f64) -> String {
    if value.is_infinite() {
        "inf".to_string()
    } else if value.fract() == 0.0 {
        format!("{}", value as i64)
    } else {
        format!("{value}")
    }
}

impl fmt::Display for Sweep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let values: Vec<String> = self.values.iter().map(|v| format_value(*v)).collect();
        write!(f, "{}={}", self.parameter.field_name(), values.join(","))
    }
}

/// One point of a sweep.
#[derive(Debug, Clone, PartialEq)]
pub struct SweepPoint {
    /// The swept parameter's value.
    pub value: f64,
    /// The run at that value.
    pub result: BenchmarkResult,
}

/// All points of a sweep.
#[derive(Debug, Clone, PartialEq)]
pub struct SweepResult {
    /// What varied.
    pub parameter: SweepParameter,
    /// One run per value, in order.
    pub points: Vec<SweepPoint>,
}

/// The key numbers of one point, for the sweep summary file.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SweepSummaryPoint {
    /// The swept value (`"inf"` for an infinite rate).
    pub value: String,
    /// Successful requests.
    pub completed: usize,
    /// Failed requests.
    pub failed: usize,
    /// Run duration, s.
    pub duration: f64,
    /// req/s.
    pub request_throughput: f64,
    /// Good req/s under the SLOs, if any.
    pub request_goodput: Option<f64>,
    /// Output tok/s.
    pub output_throughput: f64,
    /// Prompt + output tok/s.
    pub total_token_throughput: f64,
    /// Peak overlapping requests.
    pub max_concurrent_requests: usize,
    /// The `mean_/median_/std_/p<P>_` latency fields, ms.
    #[serde(flatten)]
    pub latency: LatencyStats,
    /// File name of the point's full result, once written.
    pub result_file: Option<String>,
}

/// The sweep summary file's content.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SweepSummary {
    /// `max_concurrency` or `request_rate`.
    pub sweep_parameter: String,
    /// Model measured.
    pub model_id: String,
    /// Server measured.
    pub base_url: String,
    /// `openai` or `openai-chat`.
    pub backend: String,
    /// When the sweep finished (UTC).
    pub date: String,
    /// One entry per point.
    pub points: Vec<SweepSummaryPoint>,
}

impl SweepResult {
    /// The summary, with `result_files[i]` naming point i's file when given.
    pub fn summary(&self, result_files: &[String]) -> SweepSummary {
        let first = self.points.first().map(|p| &p.result);
        SweepSummary {
            sweep_parameter: self.parameter.field_name().to_string(),
            model_id: first.map(|r| r.model_id.clone()).unwrap_or_default(),
            base_url: first.map(|r| r.base_url.clone()).unwrap_or_default(),
            backend: first.map(|r| r.backend.clone()).unwrap_or_default(),
            date: self
                .points
                .last()
                .map(|p| p.result.date.clone())
                .unwrap_or_default(),
            points: self
                .points
                .iter()
                .enumerate()
                .map(|(i, p)| SweepSummaryPoint {
                    value: format_value(p.value),
                    completed: p.result.completed,
                    failed: p.result.failed,
                    duration: p.result.duration,
                    request_throughput: p.result.request_throughput,
                    request_goodput: p.result.request_goodput,
                    output_throughput: p.result.output_throughput,
                    total_token_throughput: p.result.total_token_throughput,
                    max_concurrent_requests: p.result.max_concurrent_requests,
                    latency: p.result.latency.clone(),
                    result_file: result_files.get(i).cloned(),
                })
                .collect(),
        }
    }
}

/// Runs `sweep` over `base`, calling `on_point` after each point (for progress output).
/// The model is looked up once, so every point sends the same name.
pub async fn run_sweep(
    base: &BenchmarkConfig,
    sweep: &Sweep,
    mut on_point: impl FnMut(&SweepPoint),
) -> Result<SweepResult, Error> {
    let mut base = base.clone();
    base.model = Some(resolve_model(&base).await?);
    let mut points = Vec::with_capacity(sweep.values.len());
    for &value in &sweep.values {
        let result = run_benchmark(&sweep.config_for(&base, value)).await?;
        let point = SweepPoint { value, result };
        on_point(&point);
        points.push(point);
    }
    Ok(SweepResult {
        parameter: sweep.parameter,
        points,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sweeps() {
        let s: Sweep = "concurrency=1,2, 4".parse().unwrap();
        assert_eq!(s.parameter, SweepParameter::MaxConcurrency);
        assert_eq!(s.values, vec![1.0, 2.0, 4.0]);
        let r: Sweep = "rate=0.5,inf".parse().unwrap();
        assert_eq!(r.parameter, SweepParameter::RequestRate);
        assert!(r.values[1].is_infinite());
        assert_eq!(r.to_string(), "request_rate=0.5,inf");
        for bad in [
            "concurrency=0",
            "concurrency=1.5",
            "rate=0",
            "batch=1",
            "rate=",
            "rate",
        ] {
            assert!(bad.parse::<Sweep>().is_err(), "{bad} should be rejected");
        }
    }

    #[test]
    fn config_for_sets_only_the_swept_parameter() {
        let base = BenchmarkConfig::default();
        let s: Sweep = "concurrency=8".parse().unwrap();
        let c = s.config_for(&base, 8.0);
        assert_eq!(c.max_concurrency, Some(8));
        assert_eq!(c.request_rate, base.request_rate);
        let r: Sweep = "rate=3".parse().unwrap();
        assert_eq!(r.config_for(&base, 3.0).request_rate, 3.0);
    }
}
