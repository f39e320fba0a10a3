//! Files: the result JSON (vLLM's naming scheme), the plots beside it, and for a sweep one
//! result per point plus a summary.

use std::path::{Path, PathBuf};

use crate::error::Error;
use crate::plot::{self, SweepPlot};
use crate::result::BenchmarkResult;
use crate::sweep::{SweepResult, format_value};

/// What to write besides the JSON.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutputOptions {
    /// Folder for every file; created if missing.
    pub result_dir: PathBuf,
    /// File name of a single run's JSON; `None` uses vLLM's
    /// `{label}-{rate}qps[-concurrency{c}]-{model}-{date}.json`.
    pub result_filename: Option<String>,
    /// Also draw the SVG plots.
    pub plots: bool,
}

impl Default for OutputOptions {
    fn default() -> Self {
        OutputOptions {
            result_dir: PathBuf::from("bench-results"),
            result_filename: None,
            plots: true,
        }
    }
}

/// vLLM's default result file name for `r`.
pub fn default_filename(r: &BenchmarkResult) -> String {
    let rate = if r.request_rate.is_infinite() {
        "inf".to_string()
    } else if r.request_rate.fract() == 0.0 {
        // Python prints floats with a decimal point (vLLM writes "4.0qps").
        format!("{:.1}", r.request_rate)
    } else {
        format!("{}", r.request_rate)
    };
    let concurrency = r
        .max_concurrency
        .map(|c| format!("-concurrency{c}"))
        .unwrap_or_default();
    let model = r.model_id.rsplit('/').next().unwrap_or(&r.model_id);
    sanitize(&format!(
        "{}-{rate}qps{concurrency}-{model}-{}.json",
        r.label, r.date
    ))
}

/// Keeps file names to safe characters.
fn sanitize(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect()
}

fn write_text(path: &Path, text: &str) -> Result<(), Error> {
    std::fs::write(path, text).map_err(|e| Error::output(path, e))
}

fn make_dir(dir: &Path) -> Result<(), Error> {
    std::fs::create_dir_all(dir).map_err(|e| Error::output(dir, e))
}

/// Writes one run's JSON (and plots); returns the paths written, JSON first.
pub fn save_result(r: &BenchmarkResult, options: &OutputOptions) -> Result<Vec<PathBuf>, Error> {
    let name = options
        .result_filename
        .clone()
        .unwrap_or_else(|| default_filename(r));
    save_named(r, &options.result_dir, &name, options.plots)
}

fn save_named(
    r: &BenchmarkResult,
    dir: &Path,
    name: &str,
    plots: bool,
) -> Result<Vec<PathBuf>, Error> {
    make_dir(dir)?;
    let json_path = dir.join(name);
    write_text(&json_path, &r.to_json_pretty())?;
    let mut written = vec![json_path];
    if plots {
        let stem = name.strip_suffix(".json").unwrap_or(name);
        let latency = dir.join(format!("{stem}.latency.svg"));
        plot::latency_distribution(r, &latency)?;
        let timeline = dir.join(format!("{stem}.timeline.svg"));
        plot::timeline(r, &timeline)?;
        written.extend([latency, timeline]);
    }
    Ok(written)
}

/// Writes every point's JSON, the summary JSON and the sweep plots; returns the paths,
/// summary first.
pub fn save_sweep(sweep: &SweepResult, options: &OutputOptions) -> Result<Vec<PathBuf>, Error> {
    make_dir(&options.result_dir)?;
    let Some(first) = sweep.points.first() else {
        return Ok(Vec::new());
    };
    let model = first
        .result
        .model_id
        .rsplit('/')
        .next()
        .unwrap_or(&first.result.model_id);
    let stem = sanitize(&format!(
        "{}-sweep-{model}-{}",
        first.result.label, first.result.date
    ));
    let mut point_files = Vec::new();
    let mut written = Vec::new();
    for point in &sweep.points {
        let name = format!(
            "{stem}-{}{}.json",
            sweep.parameter.field_name(),
            format_value(point.value)
        );
        written.extend(save_named(
            &point.result,
            &options.result_dir,
            &name,
            options.plots,
        )?);
        point_files.push(name);
    }
    let summary_path = options.result_dir.join(format!("{stem}-summary.json"));
    let summary = serde_json::to_string_pretty(&sweep.summary(&point_files))
        .map_err(|e| Error::output(&summary_path, e))?;
    write_text(&summary_path, &summary)?;
    written.insert(0, summary_path);
    if options.plots {
        for (kind, suffix) in [
            (SweepPlot::Tpot, "tpot"),
            (SweepPlot::Ttft, "ttft"),
            (SweepPlot::Throughput, "throughput"),
            (SweepPlot::Goodput, "goodput"),
        ] {
            let path = options.result_dir.join(format!("{stem}.{suffix}.svg"));
            plot::sweep(sweep, kind, &path)?;
            written.push(path);
        }
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_filename_follows_vllm() {
        let r = BenchmarkResult {
            label: "openai".into(),
            request_rate: 4.0,
            max_concurrency: Some(8),
            model_id: "org/My Model".into(),
            date: "20250101-000000".into(),
            ..BenchmarkResult::default()
        };
        assert_eq!(
            default_filename(&r),
            "openai-4.0qps-concurrency8-My_Model-20250101-000000.json"
        );
        let r = BenchmarkResult {
            request_rate: f64::INFINITY,
            max_concurrency: None,
            ..r
        };
        assert_eq!(
            default_filename(&r),
            "openai-infqps-My_Model-20250101-000000.json"
        );
    }
}
