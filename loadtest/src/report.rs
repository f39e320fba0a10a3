//! Readable text: the console summary in `vllm bench serve`'s layout (so the two read the
//! same), the failure reasons, and a one-row-per-point table for sweeps. Pure string building.

use std::fmt::Write as _;

use crate::result::BenchmarkResult;
use crate::stats::{MetricSummary, percentile_word};
use crate::sweep::{SweepResult, format_value};

const WIDTH: usize = 50;

/// `title` centred in a 50-wide rule, as Python's `"{s:{c}^{n}}"` does in vLLM.
fn centered(title: &str, fill: char) -> String {
    let pad = WIDTH.saturating_sub(title.chars().count());
    let left = pad / 2;
    format!(
        "{}{}{}",
        fill.to_string().repeat(left),
        title,
        fill.to_string().repeat(pad - left)
    )
}

fn row(out: &mut String, label: &str, value: impl std::fmt::Display) {
    let _ = writeln!(out, "{label:<40} {value:<10}");
}

/// The summary table of one run.
pub fn format_result(r: &BenchmarkResult) -> String {
    let mut out = centered(" Serving Benchmark Result ", '=');
    out.push('\n');
    if let Some(t) = &r.time_base {
        let _ = writeln!(out, "Times: {}", t.note);
    }
    row(&mut out, "Successful requests:", r.completed);
    row(&mut out, "Failed requests:", r.failed);
    if let Some(c) = r.max_concurrency {
        row(&mut out, "Maximum request concurrency:", c);
    }
    if r.request_rate.is_finite() {
        row(
            &mut out,
            "Request rate configured (RPS):",
            format!("{:.2}", r.request_rate),
        );
    }
    row(
        &mut out,
        "Benchmark duration (s):",
        format!("{:.2}", r.duration),
    );
    row(&mut out, "Total input tokens:", r.total_input_tokens);
    row(&mut out, "Total generated tokens:", r.total_output_tokens);
    row(
        &mut out,
        "Request throughput (req/s):",
        format!("{:.2}", r.request_throughput),
    );
    if let (Some(goodput), Some(good)) = (r.request_goodput, r.good_requests) {
        let detail = format!(
            "{goodput:.2}  ({good} requests met {})",
            r.workload.goodput.join(" ")
        );
        row(&mut out, "Request goodput (req/s):", detail);
    }
    row(
        &mut out,
        "Output token throughput (tok/s):",
        format!("{:.2}", r.output_throughput),
    );
    row(
        &mut out,
        "Peak output token throughput (tok/s):",
        format!("{:.2}", r.max_output_tokens_per_s),
    );
    row(
        &mut out,
        "Peak concurrent requests:",
        r.max_concurrent_requests,
    );
    row(
        &mut out,
        "Total Token throughput (tok/s):",
        format!("{:.2}", r.total_token_throughput),
    );
    let sections = [
        ("Time to First Token", "TTFT", &r.latency.ttft),
        (
            "Time per Output Token (excl. 1st token)",
            "TPOT",
            &r.latency.tpot,
        ),
        ("Inter-token Latency", "ITL", &r.latency.itl),
        ("End-to-end Latency", "E2EL", &r.latency.e2el),
    ];
    for (title, short, summary) in sections {
        out.push_str(&format_section(title, short, summary));
    }
    if r.outputs_without_usage > 0 {
        let _ = writeln!(
            out,
            "Note: {} successful request(s) carried no usage; their output length is the number \
             of stream chunks.",
            r.outputs_without_usage
        );
    }
    if r.retried_requests > 0 {
        let _ = writeln!(
            out,
            "Note: {} request(s) were sent again on a fresh connection: the kept-alive one they \
             went out on closed before any byte of the answer arrived.",
            r.retried_requests
        );
    }
    if !r.failure_reasons.is_empty() {
        out.push_str(&centered("Failures", '-'));
        out.push('\n');
        for f in &r.failure_reasons {
            let _ = writeln!(out, "{:>6} x {}", f.count, f.reason);
        }
    }
    out.push_str(&"=".repeat(WIDTH));
    out.push('\n');
    out
}

fn format_section(title: &str, short: &str, s: &MetricSummary) -> String {
    let mut out = centered(title, '-');
    out.push('\n');
    row(
        &mut out,
        &format!("Mean {short} (ms):"),
        format!("{:.2}", s.mean_ms),
    );
    row(
        &mut out,
        &format!("Median {short} (ms):"),
        format!("{:.2}", s.median_ms),
    );
    row(
        &mut out,
        &format!("Std {short} (ms):"),
        format!("{:.2}", s.std_ms),
    );
    for (p, v) in &s.percentiles_ms {
        let label = format!("P{} {short} (ms):", percentile_word(*p));
        row(&mut out, &label, format!("{v:.2}"));
    }
    out
}

/// One row per sweep point: the swept value, counts, throughputs and latency percentiles.
pub fn format_sweep(sweep: &SweepResult) -> String {
    let param = sweep.parameter.field_name();
    let last_p = sweep
        .points
        .first()
        .and_then(|p| p.result.latency.tpot.percentiles_ms.last().map(|(p, _)| *p));
    let p_name = last_p
        .map(|p| format!("p{}", percentile_word(p)))
        .unwrap_or_default();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{param:>16} {:>6} {:>6} {:>9} {:>10} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "ok",
        "failed",
        "req/s",
        "out tok/s",
        "goodput",
        "TTFT mean",
        format!("TTFT {p_name}"),
        "TPOT mean",
        format!("TPOT {p_name}"),
        "ITL mean",
        "E2EL mean",
    );
    for point in &sweep.points {
        let r = &point.result;
        let pct = |s: &MetricSummary| last_p.and_then(|p| s.percentile(p)).unwrap_or(0.0);
        let goodput = r
            .request_goodput
            .map(|g| format!("{g:.2}"))
            .unwrap_or_else(|| "-".into());
        let _ = writeln!(
            out,
            "{:>16} {:>6} {:>6} {:>9.2} {:>10.2} {:>10} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2}",
            format_value(point.value),
            r.completed,
            r.failed,
            r.request_throughput,
            r.output_throughput,
            goodput,
            r.latency.ttft.mean_ms,
            pct(&r.latency.ttft),
            r.latency.tpot.mean_ms,
            pct(&r.latency.tpot),
            r.latency.itl.mean_ms,
            r.latency.e2el.mean_ms,
        );
    }
    out.push_str("(latencies in ms)\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::result::FailureReason;

    #[test]
    fn table_has_vllm_headers_and_failures() {
        let r = BenchmarkResult {
            completed: 3,
            failed: 1,
            request_rate: f64::INFINITY,
            latency: crate::result::LatencyStats {
                tpot: MetricSummary::from_seconds(&[0.05], &[99.0]),
                ..Default::default()
            },
            failure_reasons: vec![FailureReason {
                reason: "HTTP 500 Internal Server Error".into(),
                count: 1,
            }],
            ..BenchmarkResult::default()
        };
        let t = format_result(&r);
        for needle in [
            "Serving Benchmark Result",
            "Successful requests:",
            "Benchmark duration (s):",
            "Total generated tokens:",
            "Output token throughput (tok/s):",
            "Time per Output Token (excl. 1st token)",
            "P99 TPOT (ms):",
            "     1 x HTTP 500 Internal Server Error",
        ] {
            assert!(t.contains(needle), "missing {needle:?} in\n{t}");
        }
        assert!(!t.contains("Request rate configured"));
        assert!(t.contains("Mean TPOT (ms):                          50.00"));
    }
}
