//! The comparison as markdown: the two ratio matrices first (what a reader wants), then every
//! figure per concurrency and variant.

use std::fmt::Write as _;

use super::{AggregatePoint, Comparison};

/// A latency or rate with a precision that suits its size.
fn number(value: f64) -> String {
    if !value.is_finite() {
        "n/a".to_string()
    } else if value.abs() >= 100.0 {
        format!("{value:.0}")
    } else if value.abs() >= 10.0 {
        format!("{value:.1}")
    } else {
        format!("{value:.2}")
    }
}

fn optional(value: Option<f64>) -> String {
    value.map(number).unwrap_or_else(|| "-".to_string())
}

fn times(value: Option<f64>) -> String {
    value
        .map(|v| format!("{v:.2}x"))
        .unwrap_or_else(|| "-".to_string())
}

fn ratio_matrix(
    out: &mut String,
    c: &Comparison,
    heading: &str,
    pick: fn(&AggregatePoint) -> Option<f64>,
) {
    let _ = writeln!(out, "### {heading}\n");
    let header: Vec<String> = c.concurrencies.iter().map(|n| format!("c={n}")).collect();
    let _ = writeln!(out, "| variant | {} |", header.join(" | "));
    let _ = writeln!(out, "|---|{}", "---:|".repeat(c.concurrencies.len()));
    for v in &c.variants {
        let cells: Vec<String> = c
            .concurrencies
            .iter()
            .map(|&n| times(v.at(n).and_then(pick)))
            .collect();
        let _ = writeln!(out, "| {} | {} |", v.name, cells.join(" | "));
    }
    let _ = writeln!(out);
}

/// The markdown report of `c`, headed by `title`.
pub fn markdown(c: &Comparison, title: &str) -> String {
    let mut out = String::new();
    let runs: Vec<usize> = c
        .variants
        .iter()
        .flat_map(|v| v.points.iter().map(|p| p.runs))
        .collect();
    let (fewest, most) = (
        runs.iter().copied().min().unwrap_or(0),
        runs.iter().copied().max().unwrap_or(0),
    );
    let runs_text = if fewest == most {
        format!("{fewest}")
    } else {
        format!("{fewest} to {most}")
    };
    let _ = writeln!(out, "## {title}\n");
    let _ = writeln!(
        out,
        "Each figure is the median over {runs_text} run(s) per variant and concurrency; ratios are \
         against **{}** at the same concurrency.\n",
        c.baseline
    );
    ratio_matrix(
        &mut out,
        c,
        &format!(
            "Output throughput relative to {} (higher is better)",
            c.baseline
        ),
        |p| p.throughput_ratio,
    );
    ratio_matrix(
        &mut out,
        c,
        &format!("Median TPOT relative to {} (lower is better)", c.baseline),
        |p| p.tpot_ratio,
    );
    let _ = writeln!(out, "### All figures\n");
    let _ = writeln!(
        out,
        "| concurrency | variant | runs | TPOT median (ms) | TPOT p99 (ms) | TTFT median (ms) | \
         TTFT p99 (ms) | output tok/s | tok/s range | TPOT / {b} | tok/s / {b} | failed |",
        b = c.baseline
    );
    let _ = writeln!(
        out,
        "|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"
    );
    for &n in &c.concurrencies {
        for v in &c.variants {
            let Some(p) = v.at(n) else { continue };
            let (lo, hi) = p.output_throughput_range;
            let _ = writeln!(
                out,
                "| {n} | {} | {} | {} | {} | {} | {} | {} | {}-{} | {} | {} | {} |",
                v.name,
                p.runs,
                number(p.median_tpot_ms),
                optional(p.p99_tpot_ms),
                number(p.median_ttft_ms),
                optional(p.p99_ttft_ms),
                number(p.output_throughput),
                number(lo),
                number(hi),
                times(p.tpot_ratio),
                times(p.throughput_ratio),
                p.failed
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compare::tests::point;

    #[test]
    fn table_shows_ratios_and_figures() {
        let points = vec![
            point("mono", 1, 10.0, 100.0),
            point("afd", 1, 20.0, 50.0),
            point("mono", 16, 20.0, 400.0),
            point("afd", 16, 25.0, 600.0),
            point("hf", 16, 125.0, 160.0),
        ];
        let c = Comparison::new(&points, None).unwrap();
        let md = markdown(&c, "Test run");
        assert!(md.starts_with("## Test run\n"));
        assert!(md.contains("| variant | c=1 | c=16 |"), "{md}");
        // Throughput matrix: afd 0.5x at 1, 1.5x at 16; hf missing at 1, 0.4x at 16.
        assert!(md.contains("| afd | 0.50x | 1.50x |"), "{md}");
        assert!(md.contains("| hf | - | 0.40x |"), "{md}");
        // TPOT matrix: afd 2x at 1, 1.25x at 16.
        assert!(md.contains("| afd | 2.00x | 1.25x |"), "{md}");
        assert!(
            md.contains(
                "| 16 | hf | 1 | 125 | 250 | 375 | - | 160 | 160-160 | 6.25x | 0.40x | 0 |"
            ),
            "{md}"
        );
        assert!(md.contains("median over 1 run(s)"));
    }

    #[test]
    fn numbers_keep_sensible_precision() {
        assert_eq!(number(1234.56), "1235");
        assert_eq!(number(12.345), "12.3");
        assert_eq!(number(1.2345), "1.23");
        assert_eq!(number(f64::NAN), "n/a");
    }
}
