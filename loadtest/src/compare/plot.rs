//! Comparison plots (SVG, no fonts needed): one figure against concurrency, one line per
//! variant, concurrencies spaced evenly (they are usually powers of two).

use std::path::Path;

use plotters::prelude::*;

use super::{Comparison, Metric};
use crate::error::{Cause, Error};
use crate::plot::{category_label, draw_lines};

const FONT: &str = "sans-serif";

/// Line colours in variant order; they repeat after eight variants.
const PALETTE: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

/// Which figure to plot against concurrency.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ComparePlot {
    /// Median time per output token.
    Tpot,
    /// Output tokens per second.
    Throughput,
    /// Median time to first token.
    Ttft,
}

impl ComparePlot {
    /// The file name without `.svg`.
    pub fn file_stem(self) -> &'static str {
        match self {
            ComparePlot::Tpot => "tpot",
            ComparePlot::Throughput => "throughput",
            ComparePlot::Ttft => "ttft",
        }
    }

    fn metric(self) -> Metric {
        match self {
            ComparePlot::Tpot => Metric::MedianTpot,
            ComparePlot::Throughput => Metric::OutputThroughput,
            ComparePlot::Ttft => Metric::MedianTtft,
        }
    }

    fn texts(self) -> (&'static str, &'static str) {
        match self {
            ComparePlot::Tpot => ("Median time per output token", "TPOT (ms), lower is better"),
            ComparePlot::Throughput => ("Output throughput", "output tokens/s, higher is better"),
            ComparePlot::Ttft => ("Median time to first token", "TTFT (ms), lower is better"),
        }
    }
}

/// Draws `kind` for every variant of `comparison` into the SVG file `path`.
pub fn draw(
    comparison: &Comparison,
    kind: ComparePlot,
    title: &str,
    path: &Path,
) -> Result<(), Error> {
    draw_inner(comparison, kind, title, path).map_err(|e| Error::Plot {
        path: path.to_path_buf(),
        reason: e.to_string(),
        cause: Some(e),
    })
}

fn draw_inner(c: &Comparison, kind: ComparePlot, title: &str, path: &Path) -> Result<(), Cause> {
    let metric = kind.metric();
    let (caption, y_desc) = kind.texts();
    let n = c.concurrencies.len().max(1);
    let series: Vec<(String, Vec<(f64, f64)>)> = c
        .variants
        .iter()
        .map(|v| {
            let points = c
                .concurrencies
                .iter()
                .enumerate()
                .filter_map(|(i, &conc)| {
                    let value = v.at(conc).and_then(|p| p.get(metric))?;
                    value.is_finite().then_some((i as f64, value))
                })
                .collect();
            (v.name.clone(), points)
        })
        .collect();
    let highest = series
        .iter()
        .flat_map(|(_, pts)| pts.iter().map(|p| p.1))
        .fold(0.0_f64, f64::max);
    // Headroom for the legend above the highest line.
    let y_hi = if highest > 0.0 { highest * 1.35 } else { 1.0 };
    let root = SVGBackend::new(path, (960, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("{caption}: {title}"), (FONT, 20))
        .margin(16)
        .x_label_area_size(52)
        .y_label_area_size(72)
        .build_cartesian_2d(-0.4..(n as f64 - 0.6), 0.0..y_hi)?;
    let labels: Vec<String> = c.concurrencies.iter().map(|n| n.to_string()).collect();
    let label_of = |x: &f64| category_label(&labels, *x);
    let y_label = |y: &f64| {
        if y_hi >= 20.0 {
            format!("{y:.0}")
        } else {
            format!("{y:.1}")
        }
    };
    chart
        .configure_mesh()
        .x_labels(2 * n + 1)
        .x_label_formatter(&label_of)
        .y_label_formatter(&y_label)
        .light_line_style(WHITE)
        .disable_x_mesh()
        .x_desc("max concurrency (requests in flight; batch size for offline runs)")
        .y_desc(y_desc)
        .label_style((FONT, 14))
        .axis_desc_style((FONT, 15))
        .draw()?;
    let lines = series.into_iter().enumerate().map(|(i, (name, points))| {
        let label = if name == c.baseline {
            format!("{name} (baseline)")
        } else {
            name
        };
        (label, PALETTE[i % PALETTE.len()], points)
    });
    draw_lines(&mut chart, lines)?;
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compare::tests::point;

    #[test]
    fn plots_name_every_variant_and_concurrency() {
        let points = vec![
            point("mono", 1, 10.0, 100.0),
            point("afd-2cards", 1, 20.0, 50.0),
            point("mono", 16, 20.0, 400.0),
        ];
        let c = Comparison::new(&points, None).unwrap();
        let dir = tempfile::tempdir().unwrap();
        for kind in [
            ComparePlot::Tpot,
            ComparePlot::Throughput,
            ComparePlot::Ttft,
        ] {
            let path = dir.path().join(format!("{}.svg", kind.file_stem()));
            draw(&c, kind, "unit test", &path).unwrap();
            let svg = std::fs::read_to_string(&path).unwrap();
            assert!(svg.contains("mono (baseline)"), "{svg}");
            assert!(svg.contains("afd-2cards"));
            // plotters writes each text element's content on a line of its own.
            assert!(
                svg.lines().any(|l| l.trim() == "16"),
                "concurrency label missing"
            );
        }
    }
}
