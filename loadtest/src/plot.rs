//! SVG plots drawn with plotters' SVG backend, whose text is left to the SVG viewer: no font
//! files or fontconfig are needed, so plots work on any machine.
//!
//! - one run: the latency distribution (CDFs of TTFT, TPOT, ITL, E2EL with median and p99
//!   marked) and a timeline (requests in flight, output tokens per second);
//! - a sweep: TPOT, TTFT and throughput against the swept concurrency or rate.

use std::path::Path;

use plotters::coord::Shift;
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

use crate::error::{Cause, Error};
use crate::result::BenchmarkResult;
use crate::stats::{MetricSummary, percentile_sorted};
use crate::sweep::{SweepResult, format_value};

type DrawResult = Result<(), Cause>;
type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;

const FONT: &str = "sans-serif";
const DARK_GREEN: RGBColor = RGBColor(0, 130, 60);
const ORANGE: RGBColor = RGBColor(230, 120, 0);

fn plot_error(path: &Path, e: Cause) -> Error {
    Error::Plot {
        path: path.to_path_buf(),
        reason: e.to_string(),
        cause: Some(e),
    }
}

/// A value range with some headroom that is never empty.
fn padded_range(values: impl Iterator<Item = f64>, from_zero: bool) -> (f64, f64) {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in values.filter(|v| v.is_finite()) {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    if from_zero {
        lo = lo.min(0.0);
    }
    let span = (hi - lo).max(hi.abs() * 0.1).max(1e-3);
    (
        if from_zero { lo } else { lo - 0.05 * span },
        hi + 0.08 * span,
    )
}

/// Per-request TPOT in seconds of the successful requests with more than one output token.
fn tpots_of(r: &BenchmarkResult) -> Vec<f64> {
    (0..r.errors.len())
        .filter(|&i| r.errors[i].is_empty() && r.output_lens.get(i).is_some_and(|&n| n > 1))
        .map(|i| (r.latencies[i] - r.ttfts[i]) / (r.output_lens[i] - 1) as f64)
        .collect()
}

/// Writes the latency-distribution plot of one run.
pub fn latency_distribution(result: &BenchmarkResult, path: &Path) -> Result<(), Error> {
    draw_latency_distribution(result, path).map_err(|e| plot_error(path, e))
}

fn draw_latency_distribution(r: &BenchmarkResult, path: &Path) -> DrawResult {
    let ok = |i: &usize| r.errors[*i].is_empty();
    let ms = |xs: Vec<f64>| xs.into_iter().map(|x| x * 1000.0).collect::<Vec<_>>();
    let ttft = ms((0..r.errors.len()).filter(ok).map(|i| r.ttfts[i]).collect());
    let e2el = ms((0..r.errors.len())
        .filter(ok)
        .map(|i| r.latencies[i])
        .collect());
    let itl = ms(r.itls.iter().flatten().copied().collect());
    let tpot = ms(tpots_of(r));
    let root = SVGBackend::new(path, (1200, 860)).into_drawing_area();
    root.fill(&WHITE)?;
    let title = format!(
        "Latency distribution: {}, {} ({} requests ok, {} failed)",
        r.model_id,
        load_description(r),
        r.completed,
        r.failed
    );
    let body = root.titled(&title, (FONT, 24))?;
    let panels = body.split_evenly((2, 2));
    let specs = [
        (
            "Time to first token",
            "TTFT (ms)",
            "fraction of requests",
            &ttft,
            &r.latency.ttft,
        ),
        (
            "Time per output token",
            "TPOT (ms)",
            "fraction of requests",
            &tpot,
            &r.latency.tpot,
        ),
        (
            "Inter-token latency",
            "ITL (ms)",
            "fraction of chunk gaps",
            &itl,
            &r.latency.itl,
        ),
        (
            "End-to-end latency",
            "E2EL (ms)",
            "fraction of requests",
            &e2el,
            &r.latency.e2el,
        ),
    ];
    for (panel, (caption, x_desc, y_desc, values, summary)) in panels.iter().zip(specs) {
        draw_cdf(panel, caption, x_desc, y_desc, values, summary)?;
    }
    root.present()?;
    Ok(())
}

fn load_description(r: &BenchmarkResult) -> String {
    let rate = if r.request_rate.is_finite() {
        format!("{} req/s", format_value(r.request_rate))
    } else {
        "all requests at once".to_string()
    };
    match r.max_concurrency {
        Some(c) => format!("{rate}, max concurrency {c}"),
        None => rate,
    }
}

fn draw_cdf(
    area: &Area<'_>,
    caption: &str,
    x_desc: &str,
    y_desc: &str,
    values_ms: &[f64],
    summary: &MetricSummary,
) -> DrawResult {
    let mut sorted = values_ms.to_vec();
    sorted.sort_by(f64::total_cmp);
    let (x_lo, x_hi) = padded_range(sorted.iter().copied(), false);
    let mut chart = ChartBuilder::on(area)
        .caption(caption, (FONT, 20))
        .margin(12)
        .x_label_area_size(48)
        .y_label_area_size(64)
        .build_cartesian_2d(x_lo..x_hi, 0.0..1.05)?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .label_style((FONT, 14))
        .axis_desc_style((FONT, 16))
        .draw()?;
    if sorted.is_empty() {
        chart.draw_series(std::iter::once(Text::new(
            "no samples",
            (x_lo + 0.4 * (x_hi - x_lo), 0.5),
            (FONT, 18),
        )))?;
        return Ok(());
    }
    let n = sorted.len() as f64;
    let mut points = Vec::with_capacity(sorted.len() * 2 + 1);
    points.push((sorted[0], 0.0));
    for (i, &v) in sorted.iter().enumerate() {
        points.push((v, i as f64 / n));
        points.push((v, (i + 1) as f64 / n));
    }
    chart
        .draw_series(LineSeries::new(points, BLUE.stroke_width(2)))?
        .label(format!("CDF ({} samples)", sorted.len()))
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE.stroke_width(2)));
    let median = percentile_sorted(&sorted, 50.0);
    let p99 = percentile_sorted(&sorted, 99.0);
    let mean = summary.mean_ms;
    for (value, name, color) in [
        (mean, "mean", DARK_GREEN),
        (median, "median", ORANGE),
        (p99, "p99", RED),
    ] {
        chart
            .draw_series(LineSeries::new(
                vec![(value, 0.0), (value, 1.0)],
                color.stroke_width(1),
            ))?
            .label(format!("{name} {value:.1} ms"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .label_font((FONT, 14))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    Ok(())
}

/// Writes the timeline plot of one run: requests in flight and output tokens per second.
pub fn timeline(result: &BenchmarkResult, path: &Path) -> Result<(), Error> {
    draw_timeline(result, path).map_err(|e| plot_error(path, e))
}

fn draw_timeline(r: &BenchmarkResult, path: &Path) -> DrawResult {
    let root = SVGBackend::new(path, (1200, 800)).into_drawing_area();
    root.fill(&WHITE)?;
    let body = root.titled(
        &format!("Timeline: {}, {}", r.model_id, load_description(r)),
        (FONT, 24),
    )?;
    let (top, bottom) = body.split_vertically(400);
    let t_end = r.duration.max(1e-3);

    let mut steps = Vec::new();
    let mut level = 0usize;
    for &(t, n) in &r.concurrency_over_time {
        steps.push((t, level as f64));
        steps.push((t, n as f64));
        level = n;
    }
    steps.push((t_end, level as f64));
    // Headroom above the peak keeps the legend off the line.
    let y_hi = steps.iter().map(|p| p.1).fold(0.0, f64::max) * 1.3 + 1.0;
    let mut chart = ChartBuilder::on(&top)
        .caption("Requests in flight", (FONT, 20))
        .margin(12)
        .x_label_area_size(48)
        .y_label_area_size(64)
        .build_cartesian_2d(0.0..t_end, 0.0..y_hi)?;
    chart
        .configure_mesh()
        .x_desc("time since start (s)")
        .y_desc("requests in flight")
        .y_label_formatter(&|v| format!("{v:.0}"))
        .label_style((FONT, 14))
        .axis_desc_style((FONT, 16))
        .draw()?;
    chart
        .draw_series(LineSeries::new(steps, BLUE.stroke_width(2)))?
        .label(format!(
            "in flight (peak of successful: {})",
            r.max_concurrent_requests
        ))
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE.stroke_width(2)));
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .label_font((FONT, 14))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;

    let counts = &r.output_chunks_per_second;
    let c_hi = counts.iter().copied().fold(0.0, f64::max) * 1.3 + 1.0;
    let last_busy = counts.iter().rposition(|&c| c > 0.0).map_or(0, |i| i + 1);
    let x_hi = (last_busy as f64).max(t_end);
    let mut chart = ChartBuilder::on(&bottom)
        .caption("Output tokens per second", (FONT, 20))
        .margin(12)
        .x_label_area_size(48)
        .y_label_area_size(64)
        .build_cartesian_2d(0.0..x_hi, 0.0..c_hi)?;
    chart
        .configure_mesh()
        .x_desc("second since the first request (s)")
        .y_desc("token chunks per second")
        .label_style((FONT, 14))
        .axis_desc_style((FONT, 16))
        .draw()?;
    chart
        .draw_series(counts.iter().take(last_busy).enumerate().map(|(i, &c)| {
            Rectangle::new(
                [(i as f64, 0.0), (i as f64 + 1.0, c)],
                BLUE.mix(0.45).filled(),
            )
        }))?
        .label(format!(
            "chunks received (peak {:.0}/s)",
            r.max_output_tokens_per_s
        ))
        .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 20, y + 5)], BLUE.mix(0.45).filled()));
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .label_font((FONT, 14))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

/// Which sweep plot to draw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SweepPlot {
    /// Mean, median and tail TPOT against the swept parameter.
    Tpot,
    /// Mean, median and tail TTFT against the swept parameter.
    Ttft,
    /// Output and total token throughput against the swept parameter.
    Throughput,
    /// Requests served per second and goodput (requests meeting every SLO per second) against
    /// the swept parameter, with the offered rate in a rate sweep: where the curves part is
    /// where queueing starts.
    Goodput,
}

/// Writes one sweep plot.
pub fn sweep(sweep: &SweepResult, kind: SweepPlot, path: &Path) -> Result<(), Error> {
    draw_sweep(sweep, kind, path).map_err(|e| plot_error(path, e))
}

fn draw_sweep(sweep: &SweepResult, kind: SweepPlot, path: &Path) -> DrawResult {
    let labels: Vec<String> = sweep.points.iter().map(|p| format_value(p.value)).collect();
    let tail = sweep
        .points
        .first()
        .and_then(|p| p.result.latency.tpot.percentiles_ms.last().map(|(p, _)| *p));
    type Series = (String, RGBColor, Vec<f64>);
    let latency_series = |pick: fn(&BenchmarkResult) -> &MetricSummary, short: &str| {
        let mut series: Vec<Series> = vec![
            (
                format!("mean {short}"),
                BLUE,
                sweep
                    .points
                    .iter()
                    .map(|p| pick(&p.result).mean_ms)
                    .collect(),
            ),
            (
                format!("median {short}"),
                ORANGE,
                sweep
                    .points
                    .iter()
                    .map(|p| pick(&p.result).median_ms)
                    .collect(),
            ),
        ];
        if let Some(q) = tail {
            series.push((
                format!("p{} {short}", crate::stats::percentile_word(q)),
                RED,
                sweep
                    .points
                    .iter()
                    .map(|p| pick(&p.result).percentile(q).unwrap_or(0.0))
                    .collect(),
            ));
        }
        series
    };
    let (caption, y_desc, series) = match kind {
        SweepPlot::Tpot => (
            "Time per output token",
            "TPOT (ms)",
            latency_series(|r| &r.latency.tpot, "TPOT"),
        ),
        SweepPlot::Ttft => (
            "Time to first token",
            "TTFT (ms)",
            latency_series(|r| &r.latency.ttft, "TTFT"),
        ),
        SweepPlot::Throughput => (
            "Throughput",
            "throughput (tokens/s)",
            vec![
                (
                    "output tokens/s".to_string(),
                    BLUE,
                    sweep
                        .points
                        .iter()
                        .map(|p| p.result.output_throughput)
                        .collect(),
                ),
                (
                    "total (prompt + output) tokens/s".to_string(),
                    DARK_GREEN,
                    sweep
                        .points
                        .iter()
                        .map(|p| p.result.total_token_throughput)
                        .collect(),
                ),
            ],
        ),
        SweepPlot::Goodput => {
            let mut series: Vec<Series> = vec![(
                "served req/s".to_string(),
                BLUE,
                sweep
                    .points
                    .iter()
                    .map(|p| p.result.request_throughput)
                    .collect(),
            )];
            if sweep
                .points
                .iter()
                .any(|p| p.result.request_goodput.is_some())
            {
                series.push((
                    "goodput req/s (every SLO met)".to_string(),
                    DARK_GREEN,
                    sweep
                        .points
                        .iter()
                        .map(|p| p.result.request_goodput.unwrap_or(0.0))
                        .collect(),
                ));
            }
            if sweep.parameter == crate::sweep::SweepParameter::RequestRate
                && sweep.points.iter().all(|p| p.value.is_finite())
            {
                series.push((
                    "offered req/s".to_string(),
                    ORANGE,
                    sweep.points.iter().map(|p| p.value).collect(),
                ));
            }
            ("Requests served and goodput", "requests/s", series)
        }
    };
    let model = sweep
        .points
        .first()
        .map(|p| p.result.model_id.as_str())
        .unwrap_or("");
    let root = SVGBackend::new(path, (1000, 640)).into_drawing_area();
    root.fill(&WHITE)?;
    let n = labels.len().max(1);
    let (_, y_hi) = padded_range(series.iter().flat_map(|s| s.2.iter().copied()), true);
    // Room for the legend above the highest point.
    let y_hi = y_hi * 1.2;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("{caption} vs {} ({model})", sweep.parameter.field_name()),
            (FONT, 22),
        )
        .margin(16)
        .x_label_area_size(52)
        .y_label_area_size(72)
        .build_cartesian_2d(-0.5..(n as f64 - 0.5), 0.0..y_hi.max(1e-3))?;
    let label_of = |x: &f64| category_label(&labels, *x);
    chart
        .configure_mesh()
        .x_labels(2 * n + 1)
        .x_label_formatter(&label_of)
        .disable_x_mesh()
        .x_desc(sweep.parameter.axis_title())
        .y_desc(y_desc)
        .label_style((FONT, 14))
        .axis_desc_style((FONT, 16))
        .draw()?;
    let lines = series.into_iter().map(|(name, color, values)| {
        let points: Vec<(f64, f64)> = values
            .iter()
            .enumerate()
            .map(|(i, &v)| (i as f64, v))
            .collect();
        (name.to_string(), color, points)
    });
    draw_lines(&mut chart, lines)?;
    root.present()?;
    Ok(())
}

/// The label of category axis position `x` (categories sit at 0, 1, 2, ...); empty between them.
pub(crate) fn category_label(labels: &[String], x: f64) -> String {
    let i = x.round();
    if (x - i).abs() < 1e-6 && i >= 0.0 && (i as usize) < labels.len() {
        labels[i as usize].clone()
    } else {
        String::new()
    }
}

/// Draws each series as a line with a dot per point and a legend entry, then the legend box in
/// the upper left.
pub(crate) fn draw_lines<'a>(
    chart: &mut ChartContext<'a, SVGBackend<'a>, Cartesian2d<RangedCoordf64, RangedCoordf64>>,
    series: impl IntoIterator<Item = (String, RGBColor, Vec<(f64, f64)>)>,
) -> DrawResult {
    for (name, color, points) in series {
        chart
            .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))?
            .label(name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        chart.draw_series(
            points
                .into_iter()
                .map(move |p| Circle::new(p, 4, color.filled())),
        )?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font((FONT, 14))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_never_empty() {
        assert_eq!(padded_range(std::iter::empty(), true), (0.0, 1.0));
        let (lo, hi) = padded_range([5.0, 5.0].into_iter(), false);
        assert!(lo < 5.0 && hi > 5.0);
        let (lo, hi) = padded_range([2.0, 4.0].into_iter(), true);
        assert_eq!(lo, 0.0);
        assert!(hi > 4.0);
    }

    #[test]
    fn empty_result_still_plots() {
        let dir = tempfile::tempdir().unwrap();
        let r = BenchmarkResult::default();
        let path = dir.path().join("lat.svg");
        latency_distribution(&r, &path).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.contains("no samples") && svg.contains("TTFT (ms)"));
        let path = dir.path().join("tl.svg");
        timeline(&r, &path).unwrap();
        assert!(
            std::fs::read_to_string(&path)
                .unwrap()
                .contains("requests in flight")
        );
    }
}
