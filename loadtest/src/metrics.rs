//! vLLM `bench serve`'s `calculate_metrics`, from a list of request outcomes. Pure.
//!
//! - Only successful requests count toward tokens, latencies and throughput; failed ones get
//!   output length 0.
//! - output length = `usage.completion_tokens`; when a server sends no usage, the number of
//!   token chunks stands in (vLLM would re-tokenize the text; this client has no tokenizer)
//!   and `outputs_without_usage` says how often that happened.
//! - TPOT = (latency - TTFT) / (output_len - 1), only for output_len > 1; for goodput a
//!   one-token request has TPOT 0.
//! - throughput = totals / run duration; goodput = requests meeting every SLO / duration.
//! - `max_output_tokens_per_s`: most token chunks in any one-second bucket from the first send;
//!   `max_concurrent_requests`: exact peak of overlapping [send, last token) intervals.

use std::collections::BTreeMap;

use crate::config::{SloMetric, SloTarget};
use crate::record::RequestOutcome;
use crate::stats::MetricSummary;

/// Everything `calculate_metrics` derives from one run.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BenchmarkMetrics {
    /// Successful requests.
    pub completed: usize,
    /// Failed requests.
    pub failed: usize,
    /// Prompt tokens of successful requests.
    pub total_input: u64,
    /// Output tokens of successful requests.
    pub total_output: u64,
    /// completed / duration (req/s).
    pub request_throughput: f64,
    /// Requests meeting every SLO / duration (req/s); `None` without SLOs.
    pub request_goodput: Option<f64>,
    /// How many requests met every SLO; `None` without SLOs.
    pub good_requests: Option<usize>,
    /// total_output / duration (tok/s).
    pub output_throughput: f64,
    /// (total_input + total_output) / duration (tok/s).
    pub total_token_throughput: f64,
    /// Time to first token.
    pub ttft: MetricSummary,
    /// Time per output token after the first.
    pub tpot: MetricSummary,
    /// Inter-token (inter-chunk) latency.
    pub itl: MetricSummary,
    /// End-to-end latency.
    pub e2el: MetricSummary,
    /// Peak token chunks in a one-second bucket.
    pub max_output_tokens_per_s: f64,
    /// Peak number of overlapping successful requests.
    pub max_concurrent_requests: usize,
    /// Output length of every request in order (0 for failures).
    pub output_lens: Vec<u64>,
    /// Successful requests whose stream carried no usage.
    pub outputs_without_usage: usize,
    /// Distinct failure reasons with their counts, most frequent first.
    pub failure_reasons: Vec<(String, usize)>,
    /// Requests in flight (sent, not yet ended; failures included) after each change, as
    /// `(seconds since the run started, count)`.
    pub concurrency_over_time: Vec<(f64, usize)>,
    /// Token chunks received in each second of the run, counted from the first send.
    pub output_chunks_per_second: Vec<f64>,
}

/// Computes the metrics of `outcomes` over a run of `duration_s` seconds.
pub fn calculate_metrics(
    outcomes: &[RequestOutcome],
    duration_s: f64,
    percentiles: &[f64],
    slos: &[SloTarget],
) -> BenchmarkMetrics {
    let mut m = BenchmarkMetrics::default();
    let mut ttfts = Vec::new();
    let mut tpots = Vec::new();
    let mut e2els = Vec::new();
    let mut itls = Vec::new();
    let mut good = 0usize;
    for o in outcomes {
        if !o.success {
            m.failed += 1;
            m.output_lens.push(0);
            continue;
        }
        let output_len = match o.usage_completion_tokens {
            Some(n) if n > 0 => n,
            _ => {
                m.outputs_without_usage += 1;
                o.content_chunks as u64
            }
        };
        m.output_lens.push(output_len);
        m.completed += 1;
        m.total_input += o.prompt_len() as u64;
        let tpot = if output_len > 1 {
            let t = (o.latency - o.ttft) / (output_len - 1) as f64;
            tpots.push(t);
            t
        } else {
            0.0
        };
        ttfts.push(o.ttft);
        e2els.push(o.latency);
        itls.extend_from_slice(&o.itl);
        let meets = |slo: &SloTarget| {
            let value = match slo.metric {
                SloMetric::Ttft => o.ttft,
                SloMetric::Tpot => tpot,
                SloMetric::E2el => o.latency,
            };
            value <= slo.limit_ms / 1000.0
        };
        if slos.iter().all(meets) {
            good += 1;
        }
    }
    m.total_output = m.output_lens.iter().sum();
    let per_s = |x: f64| {
        if duration_s > 0.0 {
            x / duration_s
        } else {
            0.0
        }
    };
    m.request_throughput = per_s(m.completed as f64);
    m.output_throughput = per_s(m.total_output as f64);
    m.total_token_throughput = per_s((m.total_input + m.total_output) as f64);
    if !slos.is_empty() {
        m.good_requests = Some(good);
        m.request_goodput = Some(per_s(good as f64));
    }
    m.ttft = MetricSummary::from_seconds(&ttfts, percentiles);
    m.tpot = MetricSummary::from_seconds(&tpots, percentiles);
    m.itl = MetricSummary::from_seconds(&itls, percentiles);
    m.e2el = MetricSummary::from_seconds(&e2els, percentiles);
    m.output_chunks_per_second = chunks_per_second(outcomes);
    m.max_output_tokens_per_s = m
        .output_chunks_per_second
        .iter()
        .copied()
        .fold(0.0, f64::max);
    m.max_concurrent_requests = peak_overlap(
        outcomes
            .iter()
            .filter(|o| o.success)
            .map(|o| (o.start_time, o.start_time + o.latency)),
    );
    m.failure_reasons = failure_reasons(outcomes);
    m.concurrency_over_time = in_flight_steps(outcomes);
    m
}

/// Token chunks per one-second bucket, buckets counted from the first successful send
/// (vLLM's `tokens_per_second`).
fn chunks_per_second(outcomes: &[RequestOutcome]) -> Vec<f64> {
    let ok: Vec<&RequestOutcome> = outcomes.iter().filter(|o| o.success).collect();
    let Some(t0) = ok.iter().map(|o| o.start_time).min_by(f64::total_cmp) else {
        return Vec::new();
    };
    let t_end = ok
        .iter()
        .map(|o| o.start_time + o.latency)
        .fold(t0, f64::max);
    let buckets = (t_end - t0).ceil() as usize + 1;
    let mut counts = vec![0.0; buckets];
    for o in ok {
        let mut t = o.start_time + o.ttft;
        let mut add = |t: f64| {
            let b = (t - t0).floor();
            if b >= 0.0 && (b as usize) < buckets {
                counts[b as usize] += 1.0;
            }
        };
        add(t);
        for gap in &o.itl {
            t += gap;
            add(t);
        }
    }
    counts
}

/// Peak number of overlapping half-open intervals `[start, end)`.
pub fn peak_overlap(intervals: impl Iterator<Item = (f64, f64)>) -> usize {
    let mut events: Vec<(f64, i32)> = Vec::new();
    for (start, end) in intervals {
        events.push((start, 1));
        events.push((end, -1));
    }
    // At equal times an end comes before a start: the intervals are half-open.
    events.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let mut level = 0i64;
    let mut peak = 0i64;
    for (_, delta) in events {
        level += i64::from(delta);
        peak = peak.max(level);
    }
    peak as usize
}

/// In-flight count after each send and each end, all requests included.
fn in_flight_steps(outcomes: &[RequestOutcome]) -> Vec<(f64, usize)> {
    let mut events: Vec<(f64, i32)> = Vec::new();
    for o in outcomes {
        events.push((o.start_time, 1));
        events.push((o.end_time.max(o.start_time), -1));
    }
    events.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let mut level = 0i64;
    let mut steps: Vec<(f64, usize)> = vec![(0.0, 0)];
    for (t, delta) in events {
        level += i64::from(delta);
        let point = (t, level.max(0) as usize);
        match steps.last_mut() {
            Some(last) if last.0 == t => *last = point,
            _ => steps.push(point),
        }
    }
    steps
}

fn failure_reasons(outcomes: &[RequestOutcome]) -> Vec<(String, usize)> {
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for o in outcomes.iter().filter(|o| !o.success) {
        *counts.entry(o.error.as_str()).or_default() += 1;
    }
    let mut reasons: Vec<(String, usize)> = counts
        .into_iter()
        .map(|(reason, n)| (reason.to_string(), n))
        .collect();
    reasons.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    reasons
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A successful request sent at `start` with first chunk after `ttft` and `chunks - 1`
    /// further chunks every `gap` seconds, reporting `tokens` output tokens.
    fn ok(start: f64, ttft: f64, gap: f64, chunks: usize, tokens: Option<u64>) -> RequestOutcome {
        let itl = vec![gap; chunks - 1];
        let latency = ttft + gap * (chunks - 1) as f64;
        RequestOutcome {
            success: true,
            ttft,
            itl,
            latency,
            usage_completion_tokens: tokens,
            usage_prompt_tokens: Some(10),
            client_prompt_len: 10,
            start_time: start,
            end_time: start + latency,
            content_chunks: chunks,
            ..RequestOutcome::default()
        }
    }

    #[test]
    fn vllm_definitions() {
        let outcomes = vec![
            ok(0.0, 0.1, 0.02, 11, Some(11)),
            // Two tokens per chunk: TPOT uses usage, ITL uses chunks.
            ok(0.0, 0.3, 0.04, 6, Some(11)),
            RequestOutcome::failed(0.0, 0.01, 10, "HTTP 500".into()),
        ];
        let slos = ["ttft:200".parse().unwrap()];
        let m = calculate_metrics(&outcomes, 2.0, &[99.0], &slos);
        assert_eq!((m.completed, m.failed), (2, 1));
        assert_eq!(m.output_lens, vec![11, 11, 0]);
        assert_eq!((m.total_input, m.total_output), (20, 22));
        assert!((m.request_throughput - 1.0).abs() < 1e-12);
        assert!((m.output_throughput - 11.0).abs() < 1e-12);
        assert!((m.total_token_throughput - 21.0).abs() < 1e-12);
        // TPOT: (0.1 + 10*0.02 - 0.1)/10 = 20 ms; (0.3 + 5*0.04 - 0.3)/10 = 20 ms.
        assert!((m.tpot.mean_ms - 20.0).abs() < 1e-9);
        // ITL: ten gaps of 20 ms and five of 40 ms.
        assert!((m.itl.mean_ms - (10.0 * 20.0 + 5.0 * 40.0) / 15.0).abs() < 1e-9);
        assert!((m.ttft.mean_ms - 200.0).abs() < 1e-9);
        assert_eq!(m.good_requests, Some(1));
        assert!((m.request_goodput.unwrap() - 0.5).abs() < 1e-12);
        assert_eq!(m.max_concurrent_requests, 2);
        assert_eq!(m.failure_reasons, vec![("HTTP 500".to_string(), 1)]);
        // All 11 + 6 chunks fall in the first second.
        assert_eq!(m.max_output_tokens_per_s, 17.0);
    }

    #[test]
    fn one_token_requests_have_no_tpot_but_meet_tpot_slos() {
        let outcomes = vec![ok(0.0, 0.1, 0.0, 1, Some(1))];
        let slos = ["tpot:1".parse().unwrap()];
        let m = calculate_metrics(&outcomes, 1.0, &[50.0], &slos);
        assert_eq!(m.tpot.mean_ms, 0.0);
        assert_eq!(m.good_requests, Some(1));
    }

    #[test]
    fn missing_usage_falls_back_to_chunks_and_is_counted() {
        let m = calculate_metrics(&[ok(0.0, 0.1, 0.1, 4, None)], 1.0, &[], &[]);
        assert_eq!(m.output_lens, vec![4]);
        assert_eq!(m.outputs_without_usage, 1);
        assert_eq!(m.request_goodput, None);
    }

    #[test]
    fn peak_overlap_is_half_open() {
        assert_eq!(peak_overlap([(0.0, 1.0), (1.0, 2.0)].into_iter()), 1);
        assert_eq!(
            peak_overlap([(0.0, 1.5), (1.0, 2.0), (1.2, 1.3)].into_iter()),
            3
        );
        assert_eq!(peak_overlap(std::iter::empty()), 0);
    }

    #[test]
    fn in_flight_steps_track_every_request() {
        let outcomes = vec![
            ok(0.0, 0.1, 0.1, 2, Some(2)),
            RequestOutcome::failed(0.05, 0.1, 1, "x".into()),
        ];
        let m = calculate_metrics(&outcomes, 1.0, &[], &[]);
        assert_eq!(
            m.concurrency_over_time,
            vec![(0.0, 1), (0.05, 2), (0.1, 1), (0.2, 0)]
        );
    }

    #[test]
    fn chunks_are_bucketed_per_second() {
        let outcomes = vec![ok(0.0, 0.5, 0.4, 4, Some(4))]; // chunks at 0.5, 0.9, 1.3, 1.7
        let m = calculate_metrics(&outcomes, 2.0, &[], &[]);
        assert_eq!(m.output_chunks_per_second[..2], [2.0, 2.0]);
        assert_eq!(m.max_output_tokens_per_s, 2.0);
    }
}
