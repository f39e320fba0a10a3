//! The result of one run, serialised with `vllm bench serve`'s field names and units:
//! per-request arrays in seconds (`ttfts`, `itls`, `latencies`, `start_times`), summary
//! fields in milliseconds (`mean_ttft_ms`, `p99_tpot_ms`, ...), `request_rate` as a number
//! or the string `"inf"`. Fields after vLLM's are afd-loadtest additions.

use serde::Serialize;
use serde::ser::{SerializeMap, Serializer};

use crate::metrics::BenchmarkMetrics;
use crate::stats::{MetricSummary, percentile_word};

/// The four latency summaries; serialises flat as `mean_<m>_ms`, `median_<m>_ms`,
/// `std_<m>_ms`, `p<P>_<m>_ms` for m in ttft, tpot, itl, e2el.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LatencyStats {
    /// Time to first token.
    pub ttft: MetricSummary,
    /// Time per output token, first token excluded.
    pub tpot: MetricSummary,
    /// Inter-token latency (per chunk).
    pub itl: MetricSummary,
    /// End-to-end latency.
    pub e2el: MetricSummary,
}

impl LatencyStats {
    /// `(vLLM metric name, summary)` in vLLM's order.
    pub fn named(&self) -> [(&'static str, &MetricSummary); 4] {
        [
            ("ttft", &self.ttft),
            ("tpot", &self.tpot),
            ("itl", &self.itl),
            ("e2el", &self.e2el),
        ]
    }
}

impl Serialize for LatencyStats {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(None)?;
        for (name, s) in self.named() {
            map.serialize_entry(&format!("mean_{name}_ms"), &s.mean_ms)?;
            map.serialize_entry(&format!("median_{name}_ms"), &s.median_ms)?;
            map.serialize_entry(&format!("std_{name}_ms"), &s.std_ms)?;
            for (p, v) in &s.percentiles_ms {
                map.serialize_entry(&format!("p{}_{name}_ms", percentile_word(*p)), v)?;
            }
        }
        map.end()
    }
}

/// One failure reason and how many requests failed with it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FailureReason {
    /// The reason, as recorded in `errors`.
    pub reason: String,
    /// How many requests.
    pub count: usize,
}

/// The workload as configured (afd-loadtest addition, for reproducing a run).
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct WorkloadInfo {
    /// `token-ids`, `random-words` or `file:<path>`.
    pub prompt_source: String,
    /// Configured prompt length (after the shared prefix).
    pub input_len: usize,
    /// Tokens of the prefix every prompt shares (0: none).
    pub prefix_len: usize,
    /// Configured output length.
    pub output_len: usize,
    /// Length spread.
    pub range_ratio: f64,
    /// Whether `ignore_eos` was sent.
    pub ignore_eos: bool,
    /// Seed of prompts and arrivals.
    pub seed: u64,
    /// Warm-up requests before measuring.
    pub num_warmups: usize,
    /// Goodput SLOs as `metric:ms`.
    pub goodput: Vec<String>,
}

/// One run's result. Serialise it with `serde_json` to get the vLLM-compatible file.
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct BenchmarkResult {
    /// Run time, UTC, `YYYYMMDD-HHMMSS` (vLLM's format; vLLM writes local time).
    pub date: String,
    /// `openai` (completions) or `openai-chat`.
    pub endpoint_type: String,
    /// Same as `endpoint_type` (vLLM writes both).
    pub backend: String,
    /// The run's label.
    pub label: String,
    /// Model name sent.
    pub model_id: String,
    /// The server tokenizes, so this is the model name.
    pub tokenizer_id: String,
    /// Requests configured.
    pub num_prompts: usize,
    /// Configured arrival rate, `"inf"` for all at once.
    #[serde(serialize_with = "number_or_inf")]
    pub request_rate: f64,
    /// Configured burstiness.
    #[serde(serialize_with = "number_or_inf")]
    pub burstiness: f64,
    /// Configured concurrency cap.
    pub max_concurrency: Option<usize>,
    /// Seconds from the first send to the last request's end.
    pub duration: f64,
    /// Successful requests.
    pub completed: usize,
    /// Failed requests.
    pub failed: usize,
    /// Prompt tokens of successful requests.
    pub total_input_tokens: u64,
    /// Output tokens of successful requests (from usage).
    pub total_output_tokens: u64,
    /// Requests per second.
    pub request_throughput: f64,
    /// Requests meeting every SLO per second; null without `--goodput`.
    pub request_goodput: Option<f64>,
    /// Output tokens per second.
    pub output_throughput: f64,
    /// Prompt plus output tokens per second.
    pub total_token_throughput: f64,
    /// Peak token chunks in one second.
    pub max_output_tokens_per_s: f64,
    /// Peak overlapping successful requests.
    pub max_concurrent_requests: usize,
    /// Prompt tokens per request (server's count when reported).
    pub input_lens: Vec<usize>,
    /// Output tokens per request (0 for failures).
    pub output_lens: Vec<u64>,
    /// Seconds to first token per request (0 for failures).
    pub ttfts: Vec<f64>,
    /// Inter-chunk gaps in seconds per request.
    pub itls: Vec<Vec<f64>>,
    /// End-to-end seconds per request (0 for failures).
    pub latencies: Vec<f64>,
    /// Send time per request, seconds after the run started (vLLM: a perf_counter value).
    pub start_times: Vec<f64>,
    /// Seconds each request waited for a concurrency slot.
    pub queue_times: Vec<f64>,
    /// Generated text per request.
    pub generated_texts: Vec<String>,
    /// Failure reason per request, empty on success.
    pub errors: Vec<String>,
    /// `mean_/median_/std_/p<P>_` fields of ttft, tpot, itl, e2el, in ms.
    #[serde(flatten)]
    pub latency: LatencyStats,
    /// Server root measured.
    pub base_url: String,
    /// Requests actually sent (fewer than `num_prompts` when the duration limit hit).
    pub num_requests_sent: usize,
    /// Requests sent a second time, on a fresh connection, because the kept-alive connection
    /// they went out on failed before any byte of the answer arrived (the server closed it).
    pub retried_requests: usize,
    /// Requests that met every SLO; null without `--goodput`.
    pub good_requests: Option<usize>,
    /// Successful requests whose stream carried no usage (token chunks were counted instead).
    pub outputs_without_usage: usize,
    /// Failure reasons with counts, most frequent first.
    pub failure_reasons: Vec<FailureReason>,
    /// `[seconds, requests in flight]` after every change, failures included.
    pub concurrency_over_time: Vec<(f64, usize)>,
    /// Token chunks received in each second of the run.
    pub output_chunks_per_second: Vec<f64>,
    /// The configured workload.
    pub workload: WorkloadInfo,
    /// What the times measure, when not a server's wall clock: an emulation's modeled time,
    /// or a server's dilated clock with the times divided back (afd-loadtest addition).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub time_base: Option<TimeBase>,
    /// What the runner that made the result adds (an emulation: the deployment, its profiles,
    /// the step breakdown), as JSON (afd-loadtest addition).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub emulation: Option<serde_json::Value>,
}

/// What a result's times measure, when not a server's wall clock.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TimeBase {
    /// `modeled` (an emulation in virtual time) or `dilated` (a server whose modeled clock
    /// runs `dilation` times slower than the wall; every time was divided by it).
    pub clock: String,
    /// The server's time dilation the times were divided by (1 for an emulation).
    pub dilation: f64,
    /// In words, for the report.
    pub note: String,
}

fn number_or_inf<S: Serializer>(value: &f64, serializer: S) -> Result<S::Ok, S::Error> {
    if value.is_infinite() {
        serializer.serialize_str("inf")
    } else {
        serializer.serialize_f64(*value)
    }
}

impl BenchmarkResult {
    /// Copies the metrics into the result's fields.
    pub(crate) fn fill_metrics(&mut self, m: &BenchmarkMetrics) {
        self.completed = m.completed;
        self.failed = m.failed;
        self.total_input_tokens = m.total_input;
        self.total_output_tokens = m.total_output;
        self.request_throughput = m.request_throughput;
        self.request_goodput = m.request_goodput;
        self.output_throughput = m.output_throughput;
        self.total_token_throughput = m.total_token_throughput;
        self.max_output_tokens_per_s = m.max_output_tokens_per_s;
        self.max_concurrent_requests = m.max_concurrent_requests;
        self.output_lens = m.output_lens.clone();
        self.latency = LatencyStats {
            ttft: m.ttft.clone(),
            tpot: m.tpot.clone(),
            itl: m.itl.clone(),
            e2el: m.e2el.clone(),
        };
        self.good_requests = m.good_requests;
        self.outputs_without_usage = m.outputs_without_usage;
        self.failure_reasons = m
            .failure_reasons
            .iter()
            .map(|(reason, count)| FailureReason {
                reason: reason.clone(),
                count: *count,
            })
            .collect();
        self.concurrency_over_time = m.concurrency_over_time.clone();
        self.output_chunks_per_second = m.output_chunks_per_second.clone();
    }

    /// The result as pretty JSON.
    pub fn to_json_pretty(&self) -> String {
        // Serialising plain data with string keys cannot fail; keep a readable fallback anyway.
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }
}

/// The current UTC time as `YYYYMMDD-HHMMSS`.
pub fn utc_timestamp() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    format_utc(secs)
}

/// `YYYYMMDD-HHMMSS` of a Unix time (proleptic Gregorian, UTC).
pub fn format_utc(unix_secs: u64) -> String {
    let days = (unix_secs / 86_400) as i64;
    let rem = unix_secs % 86_400;
    let (h, min, s) = (rem / 3600, (rem % 3600) / 60, rem % 60);
    // Days to civil date (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}{m:02}{d:02}-{h:02}{min:02}{s:02}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_format_known_dates() {
        assert_eq!(format_utc(0), "19700101-000000");
        // 2024-02-29 12:34:56 UTC
        assert_eq!(format_utc(1_709_210_096), "20240229-123456");
    }

    #[test]
    fn latency_fields_are_flat_with_vllm_names() {
        let stats = LatencyStats {
            ttft: MetricSummary::from_seconds(&[0.1], &[99.0, 99.9]),
            ..LatencyStats::default()
        };
        let v = serde_json::to_value(&stats).unwrap();
        assert_eq!(v["mean_ttft_ms"], 100.0);
        assert_eq!(v["p99_ttft_ms"], 100.0);
        assert_eq!(v["p99.9_ttft_ms"], 100.0);
        assert!(v.get("std_e2el_ms").is_some());
        assert!(v.get("p99_e2el_ms").is_none());
    }
}
