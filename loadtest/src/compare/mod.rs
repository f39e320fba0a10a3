//! Side-by-side comparison of variants (deployments, servers, settings) measured with the same
//! workload: result files grouped by variant and concurrency, repeated runs reduced to their
//! median, and every variant's figures as ratios against a baseline variant measured in the
//! same session (machines are noisy; ratios measured side by side travel better than absolute
//! numbers).
//!
//! - `read`: loads result files (afd-loadtest's or `vllm bench serve`'s JSON, a sweep summary,
//!   or folders of them) into [`MeasuredPoint`]s;
//! - this module: the I/O-free core, [`Comparison::new`] and the ratios;
//! - `table`: the markdown report; `plot`: SVG plots, one line per variant.

mod plot;
mod read;
mod table;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::error::Error;
use crate::stats::median;

pub use plot::{ComparePlot, draw as draw_plot};
pub use read::{InputSpec, read_inputs};
pub use table::markdown;

/// The figures of one measured run that a comparison uses (vLLM field names, ms and tok/s).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PointMetrics {
    /// Median time per output token, ms.
    pub median_tpot_ms: f64,
    /// 99th-percentile TPOT, ms, when the run reported it.
    pub p99_tpot_ms: Option<f64>,
    /// Median time to first token, ms.
    pub median_ttft_ms: f64,
    /// 99th-percentile TTFT, ms, when the run reported it.
    pub p99_ttft_ms: Option<f64>,
    /// Output tokens per second over the run.
    pub output_throughput: f64,
    /// Successful requests.
    pub completed: usize,
    /// Failed requests.
    pub failed: usize,
}

/// One run of one variant at one concurrency.
#[derive(Debug, Clone, PartialEq)]
pub struct MeasuredPoint {
    /// The variant's name (a label given on the command line, else the result's `label`).
    pub variant: String,
    /// Requests in flight (`max_concurrency`; the batch size of an offline run).
    pub concurrency: usize,
    /// The run's figures.
    pub metrics: PointMetrics,
    /// The file it came from, for messages.
    pub source: PathBuf,
}

/// A figure compared across variants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Metric {
    /// Median TPOT (lower is better).
    MedianTpot,
    /// p99 TPOT (lower is better).
    P99Tpot,
    /// Median TTFT (lower is better).
    MedianTtft,
    /// Output tokens per second (higher is better).
    OutputThroughput,
}

impl Metric {
    /// The figure in `m`, if the run reported it.
    pub fn of(self, m: &PointMetrics) -> Option<f64> {
        match self {
            Metric::MedianTpot => Some(m.median_tpot_ms),
            Metric::P99Tpot => m.p99_tpot_ms,
            Metric::MedianTtft => Some(m.median_ttft_ms),
            Metric::OutputThroughput => Some(m.output_throughput),
        }
    }
}

/// A variant at one concurrency: the median over its runs of every figure.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AggregatePoint {
    /// Requests in flight.
    pub concurrency: usize,
    /// Runs combined.
    pub runs: usize,
    /// Median over runs of the median TPOT, ms.
    pub median_tpot_ms: f64,
    /// Median over runs of the p99 TPOT, ms (runs that reported it).
    pub p99_tpot_ms: Option<f64>,
    /// Median over runs of the median TTFT, ms.
    pub median_ttft_ms: f64,
    /// Median over runs of the p99 TTFT, ms (runs that reported it).
    pub p99_ttft_ms: Option<f64>,
    /// Median over runs of the output throughput, tok/s.
    pub output_throughput: f64,
    /// Lowest and highest output throughput of the runs: the spread noise caused.
    pub output_throughput_range: (f64, f64),
    /// Successful requests, all runs together.
    pub completed: usize,
    /// Failed requests, all runs together.
    pub failed: usize,
    /// Median TPOT over the baseline's at this concurrency (below 1: faster per token).
    pub tpot_ratio: Option<f64>,
    /// Output throughput over the baseline's at this concurrency (above 1: more tok/s).
    pub throughput_ratio: Option<f64>,
}

impl AggregatePoint {
    /// The aggregated figure for `metric`.
    pub fn get(&self, metric: Metric) -> Option<f64> {
        match metric {
            Metric::MedianTpot => Some(self.median_tpot_ms),
            Metric::P99Tpot => self.p99_tpot_ms,
            Metric::MedianTtft => Some(self.median_ttft_ms),
            Metric::OutputThroughput => Some(self.output_throughput),
        }
    }
}

/// One variant's aggregated points, by ascending concurrency.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct VariantSeries {
    /// The variant's name.
    pub name: String,
    /// Its points.
    pub points: Vec<AggregatePoint>,
}

impl VariantSeries {
    /// The point at `concurrency`, if this variant was measured there.
    pub fn at(&self, concurrency: usize) -> Option<&AggregatePoint> {
        self.points.iter().find(|p| p.concurrency == concurrency)
    }
}

/// Every variant side by side; serialises as the `comparison.json` file.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Comparison {
    /// The variant the ratios are taken against.
    pub baseline: String,
    /// Every concurrency measured by any variant, ascending.
    pub concurrencies: Vec<usize>,
    /// Variants in the order they were first given.
    pub variants: Vec<VariantSeries>,
}

fn aggregate(concurrency: usize, runs: &[&PointMetrics]) -> AggregatePoint {
    let pick = |metric: Metric| -> Vec<f64> { runs.iter().filter_map(|m| metric.of(m)).collect() };
    let throughputs = pick(Metric::OutputThroughput);
    let lowest = throughputs.iter().copied().fold(f64::INFINITY, f64::min);
    let highest = throughputs
        .iter()
        .copied()
        .fold(f64::NEG_INFINITY, f64::max);
    AggregatePoint {
        concurrency,
        runs: runs.len(),
        median_tpot_ms: median(&pick(Metric::MedianTpot)).unwrap_or(0.0),
        p99_tpot_ms: median(&pick(Metric::P99Tpot)),
        median_ttft_ms: median(&pick(Metric::MedianTtft)).unwrap_or(0.0),
        p99_ttft_ms: median(
            &runs
                .iter()
                .filter_map(|m| m.p99_ttft_ms)
                .collect::<Vec<_>>(),
        ),
        output_throughput: median(&throughputs).unwrap_or(0.0),
        output_throughput_range: (lowest, highest),
        completed: runs.iter().map(|m| m.completed).sum(),
        failed: runs.iter().map(|m| m.failed).sum(),
        tpot_ratio: None,
        throughput_ratio: None,
    }
}

/// `a / b` when both are positive and finite.
fn ratio(a: f64, b: f64) -> Option<f64> {
    (a.is_finite() && b.is_finite() && a > 0.0 && b > 0.0).then(|| a / b)
}

impl Comparison {
    /// Groups `points` by variant (in the order variants first appear) and concurrency, takes
    /// the median over repeated runs, and the ratios against `baseline` (default: the first
    /// variant).
    pub fn new(points: &[MeasuredPoint], baseline: Option<&str>) -> Result<Self, Error> {
        let mut order: Vec<&str> = Vec::new();
        let mut groups: BTreeMap<(&str, usize), Vec<&PointMetrics>> = BTreeMap::new();
        for p in points {
            if !order.contains(&p.variant.as_str()) {
                order.push(&p.variant);
            }
            groups
                .entry((&p.variant, p.concurrency))
                .or_default()
                .push(&p.metrics);
        }
        let Some(first) = order.first() else {
            return Err(Error::Compare(
                "no results to compare: pass result JSON files or folders of them".into(),
            ));
        };
        let baseline = baseline.unwrap_or(first).to_string();
        if !order.contains(&baseline.as_str()) {
            return Err(Error::Compare(format!(
                "the baseline '{baseline}' is not among the variants ({}); name one of them with \
                 --baseline",
                order.join(", ")
            )));
        }
        let mut variants: Vec<VariantSeries> = order
            .iter()
            .map(|name| VariantSeries {
                name: name.to_string(),
                points: groups
                    .iter()
                    .filter(|((v, _), _)| v == name)
                    .map(|((_, c), runs)| aggregate(*c, runs))
                    .collect(),
            })
            .collect();
        let base = variants
            .iter()
            .find(|v| v.name == baseline)
            .cloned()
            .ok_or_else(|| Error::Compare(format!("baseline '{baseline}' vanished")))?;
        for variant in &mut variants {
            for point in &mut variant.points {
                if let Some(b) = base.at(point.concurrency) {
                    point.tpot_ratio = ratio(point.median_tpot_ms, b.median_tpot_ms);
                    point.throughput_ratio = ratio(point.output_throughput, b.output_throughput);
                }
            }
        }
        let mut concurrencies: Vec<usize> = groups.keys().map(|(_, c)| *c).collect();
        concurrencies.sort_unstable();
        concurrencies.dedup();
        Ok(Comparison {
            baseline,
            concurrencies,
            variants,
        })
    }

    /// The variant called `name`.
    pub fn variant(&self, name: &str) -> Option<&VariantSeries> {
        self.variants.iter().find(|v| v.name == name)
    }

    /// The comparison as pretty JSON.
    pub fn to_json_pretty(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }
}

/// What `write_comparison` produces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompareOutput {
    /// The markdown report.
    pub markdown: PathBuf,
    /// The aggregated figures and ratios as JSON.
    pub json: PathBuf,
    /// The SVG plots.
    pub plots: Vec<PathBuf>,
}

/// Writes `comparison.md`, `comparison.json`, `tpot.svg`, `throughput.svg` and `ttft.svg`
/// into `dir` (created if missing).
pub fn write_comparison(
    comparison: &Comparison,
    title: &str,
    dir: &Path,
) -> Result<CompareOutput, Error> {
    std::fs::create_dir_all(dir).map_err(|e| Error::output(dir, e))?;
    let markdown_path = dir.join("comparison.md");
    std::fs::write(&markdown_path, markdown(comparison, title))
        .map_err(|e| Error::output(&markdown_path, e))?;
    let json_path = dir.join("comparison.json");
    std::fs::write(&json_path, comparison.to_json_pretty())
        .map_err(|e| Error::output(&json_path, e))?;
    let mut plots = Vec::new();
    for kind in [
        ComparePlot::Tpot,
        ComparePlot::Throughput,
        ComparePlot::Ttft,
    ] {
        let path = dir.join(format!("{}.svg", kind.file_stem()));
        draw_plot(comparison, kind, title, &path)?;
        plots.push(path);
    }
    Ok(CompareOutput {
        markdown: markdown_path,
        json: json_path,
        plots,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn point(variant: &str, concurrency: usize, tpot: f64, tps: f64) -> MeasuredPoint {
        MeasuredPoint {
            variant: variant.into(),
            concurrency,
            metrics: PointMetrics {
                median_tpot_ms: tpot,
                p99_tpot_ms: Some(tpot * 2.0),
                median_ttft_ms: tpot * 3.0,
                p99_ttft_ms: None,
                output_throughput: tps,
                completed: 4,
                failed: 0,
            },
            source: PathBuf::from(format!("{variant}-{concurrency}.json")),
        }
    }

    #[test]
    fn repeats_reduce_to_their_median_and_ratios_use_the_baseline() {
        let points = vec![
            point("mono", 1, 10.0, 100.0),
            point("afd", 1, 30.0, 40.0),
            point("mono", 1, 14.0, 80.0),
            point("afd", 1, 20.0, 50.0),
            point("mono", 1, 12.0, 90.0),
            point("afd", 1, 25.0, 45.0),
            point("mono", 4, 20.0, 200.0),
            point("afd", 4, 40.0, 300.0),
        ];
        let c = Comparison::new(&points, None).unwrap();
        assert_eq!(c.baseline, "mono");
        assert_eq!(c.concurrencies, vec![1, 4]);
        let names: Vec<&str> = c.variants.iter().map(|v| v.name.as_str()).collect();
        assert_eq!(names, vec!["mono", "afd"]);
        let mono1 = c.variant("mono").unwrap().at(1).unwrap();
        assert_eq!(mono1.runs, 3);
        assert_eq!(mono1.median_tpot_ms, 12.0);
        assert_eq!(mono1.output_throughput, 90.0);
        assert_eq!(mono1.output_throughput_range, (80.0, 100.0));
        assert_eq!(mono1.p99_tpot_ms, Some(24.0));
        assert_eq!(mono1.p99_ttft_ms, None);
        assert_eq!(mono1.completed, 12);
        assert_eq!(mono1.tpot_ratio, Some(1.0));
        let afd1 = c.variant("afd").unwrap().at(1).unwrap();
        assert_eq!(afd1.median_tpot_ms, 25.0);
        assert_eq!(afd1.tpot_ratio, Some(25.0 / 12.0));
        assert_eq!(afd1.throughput_ratio, Some(45.0 / 90.0));
        let afd4 = c.variant("afd").unwrap().at(4).unwrap();
        assert_eq!(afd4.throughput_ratio, Some(1.5));
        assert_eq!(afd4.tpot_ratio, Some(2.0));
    }

    #[test]
    fn an_even_number_of_runs_interpolates() {
        let points = vec![point("a", 2, 10.0, 10.0), point("a", 2, 20.0, 30.0)];
        let c = Comparison::new(&points, None).unwrap();
        let p = c.variant("a").unwrap().at(2).unwrap();
        assert_eq!(p.median_tpot_ms, 15.0);
        assert_eq!(p.output_throughput, 20.0);
    }

    #[test]
    fn baseline_choice_and_missing_points() {
        let points = vec![
            point("mono", 1, 10.0, 100.0),
            point("afd", 1, 20.0, 50.0),
            point("afd", 16, 40.0, 400.0),
        ];
        let c = Comparison::new(&points, Some("afd")).unwrap();
        assert_eq!(c.baseline, "afd");
        assert_eq!(
            c.variant("mono").unwrap().at(1).unwrap().tpot_ratio,
            Some(0.5)
        );
        assert_eq!(
            c.variant("mono").unwrap().at(1).unwrap().throughput_ratio,
            Some(2.0)
        );
        // The baseline has no point where mono has none either; afd@16 has no partner but itself.
        assert!(c.variant("mono").unwrap().at(16).is_none());
        assert_eq!(
            c.variant("afd").unwrap().at(16).unwrap().tpot_ratio,
            Some(1.0)
        );

        let err = Comparison::new(&points, Some("gpu")).unwrap_err();
        assert!(err.to_string().contains("'gpu'") && err.to_string().contains("mono, afd"));
        assert!(Comparison::new(&[], None).is_err());
    }

    #[test]
    fn zero_figures_give_no_ratio() {
        let points = vec![point("mono", 1, 0.0, 0.0), point("afd", 1, 20.0, 50.0)];
        let c = Comparison::new(&points, None).unwrap();
        let afd = c.variant("afd").unwrap().at(1).unwrap();
        assert_eq!(afd.tpot_ratio, None);
        assert_eq!(afd.throughput_ratio, None);
    }
}
