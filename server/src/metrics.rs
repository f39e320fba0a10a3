//! Prometheus metrics with vLLM's names (`vllm:*`, every one labelled `model_name`), plus afd's
//! own (`afd_*`): per node, and the disaggregated path's hooks ([`router::AfdStats`]).
//!
//! Each server has its own recorder (no global one), so several servers can run in one process.
//! Per-request histograms are recorded as tokens arrive; gauges and counters owned by the
//! engines are read from the router's snapshot when `/metrics` is rendered.

use std::time::{Duration, Instant};

use metrics::{Counter, Gauge, Histogram, Key, Label, Level, Metadata, Recorder};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusRecorder};
use router::{AfdStats, BalanceWindow, ClockSnapshot, RouterStats};

static METADATA: Metadata<'static> =
    Metadata::new("afd::server", Level::INFO, Some(module_path!()));

const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
const REQUEST_LATENCY_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

const TTFT: &str = "vllm:time_to_first_token_seconds";
const ITL: &str = "vllm:inter_token_latency_seconds";
const TPOT: &str = "vllm:request_time_per_output_token_seconds";
const E2E: &str = "vllm:e2e_request_latency_seconds";
const QUEUE: &str = "vllm:request_queue_time_seconds";
const PREFILL: &str = "vllm:request_prefill_time_seconds";
const DECODE: &str = "vllm:request_decode_time_seconds";
const INFERENCE: &str = "vllm:request_inference_time_seconds";
const PROMPT_LEN: &str = "vllm:request_prompt_tokens";
const GEN_LEN: &str = "vllm:request_generation_tokens";
const PARAMS_N: &str = "vllm:request_params_n";
const PARAMS_MAX_TOKENS: &str = "vllm:request_params_max_tokens";
const BALANCEDNESS: &str = "afd_expert_balancedness_window";
const BALANCEDNESS_BUCKETS: &[f64] =
    &[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 1.0];
/// The window `afd_expert_balancedness` is computed over.
pub const BALANCE_WINDOW: Duration = Duration::from_secs(60);

/// 1, 2, 5, 10, 20, 50, ... up to `max`.
fn one_two_five(max: usize) -> Vec<f64> {
    let mut out = Vec::new();
    let mut scale = 1.0;
    'outer: loop {
        for m in [1.0, 2.0, 5.0] {
            let v = m * scale;
            if v > max as f64 {
                break 'outer;
            }
            out.push(v);
        }
        scale *= 10.0;
    }
    if out.is_empty() {
        out.push(1.0);
    }
    out
}

/// How a request ended, as `vllm:request_success_total` labels it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishedReason {
    /// A stop token or stop string.
    Stop,
    /// `max_tokens` or `max_model_len`.
    Length,
    /// The client went away or an error ended it.
    Abort,
}

impl FinishedReason {
    fn label(self) -> &'static str {
        match self {
            FinishedReason::Stop => "stop",
            FinishedReason::Length => "length",
            FinishedReason::Abort => "abort",
        }
    }
}

/// Timestamps of one sequence, for its histograms.
#[derive(Debug, Clone, Copy)]
pub struct SequenceTiming {
    /// When the frontend received the request.
    pub arrival: Instant,
    /// When it was first scheduled.
    pub first_scheduled: Option<Instant>,
    /// When its first token was produced.
    pub first_token: Option<Instant>,
    /// When its latest token was produced.
    pub last_token: Option<Instant>,
    /// Tokens generated.
    pub generated: usize,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// The request's `max_tokens`.
    pub max_tokens: usize,
}

/// The metrics of one server.
pub struct Metrics {
    recorder: PrometheusRecorder,
    model_name: String,
    ttft: Histogram,
    itl: Histogram,
    tpot: Histogram,
    e2e: Histogram,
    queue: Histogram,
    prefill: Histogram,
    decode: Histogram,
    inference: Histogram,
    prompt_len: Histogram,
    gen_len: Histogram,
    params_n: Histogram,
    params_max_tokens: Histogram,
    success: [Counter; 3],
    /// The cards' expert load as of earlier scrapes, for the balancedness over a window.
    balance: std::sync::Mutex<BalanceWindow>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics")
            .field("model_name", &self.model_name)
            .finish()
    }
}

impl Metrics {
    /// A registry for a server of `model_name` whose sequences hold at most `max_model_len`.
    pub fn new(model_name: &str, max_model_len: usize) -> Self {
        let lengths = one_two_five(max_model_len.max(1));
        let mut builder = PrometheusBuilder::new();
        let buckets: [(&str, &[f64]); 13] = [
            (BALANCEDNESS, BALANCEDNESS_BUCKETS),
            (TTFT, TTFT_BUCKETS),
            (ITL, ITL_BUCKETS),
            (TPOT, ITL_BUCKETS),
            (E2E, REQUEST_LATENCY_BUCKETS),
            (QUEUE, REQUEST_LATENCY_BUCKETS),
            (PREFILL, REQUEST_LATENCY_BUCKETS),
            (DECODE, REQUEST_LATENCY_BUCKETS),
            (INFERENCE, REQUEST_LATENCY_BUCKETS),
            (PROMPT_LEN, &lengths),
            (GEN_LEN, &lengths),
            (PARAMS_N, &[1.0, 2.0, 5.0, 10.0, 20.0]),
            (PARAMS_MAX_TOKENS, &lengths),
        ];
        for (name, values) in buckets {
            // Only fails on an empty list, and none is empty.
            builder = match builder.set_buckets_for_metric(Matcher::Full(name.into()), values) {
                Ok(b) => b,
                Err(e) => panic!("bucket list of {name}: {e}"),
            };
        }
        let recorder = builder.build_recorder();
        let m = |name: &'static str, help: &'static str| {
            recorder.describe_histogram(name.into(), None, help.into());
            recorder.register_histogram(
                &Key::from_parts(name, vec![Label::new("model_name", model_name.to_string())]),
                &METADATA,
            )
        };
        let ttft = m(TTFT, "Time to first token, from arrival at the frontend.");
        let itl = m(ITL, "Time between consecutive output tokens.");
        let tpot = m(TPOT, "Mean time per output token of each request.");
        let e2e = m(E2E, "Request latency, from arrival to the last token.");
        let queue = m(
            QUEUE,
            "Time requests spent waiting before their first step.",
        );
        let prefill = m(PREFILL, "Time from first scheduling to the first token.");
        let decode = m(DECODE, "Time from the first token to the last.");
        let inference = m(INFERENCE, "Time from first scheduling to the last token.");
        let prompt_len = m(PROMPT_LEN, "Prompt tokens per request.");
        let gen_len = m(GEN_LEN, "Generated tokens per request.");
        let params_n = m(PARAMS_N, "The n parameter of requests.");
        let params_max_tokens = m(PARAMS_MAX_TOKENS, "The max_tokens parameter of requests.");
        recorder.describe_histogram(
            BALANCEDNESS.into(),
            None,
            "Each MoE layer's balancedness over the window ending at each scrape (afd_expert_balancedness's values).".into(),
        );
        recorder.describe_counter(
            "vllm:request_success_total".into(),
            None,
            "Finished requests by finish reason.".into(),
        );
        let success = [
            FinishedReason::Stop,
            FinishedReason::Length,
            FinishedReason::Abort,
        ]
        .map(|r| {
            recorder.register_counter(
                &Key::from_parts(
                    "vllm:request_success_total",
                    vec![
                        Label::new("model_name", model_name.to_string()),
                        Label::new("finished_reason", r.label()),
                    ],
                ),
                &METADATA,
            )
        });
        for (name, help) in [
            (
                "vllm:num_requests_running",
                "Requests in the running set of a node.",
            ),
            (
                "vllm:num_requests_waiting",
                "Requests waiting to start or to resume.",
            ),
            (
                "vllm:kv_cache_usage_perc",
                "Fraction of KV-cache blocks in use (0 to 1).",
            ),
            (
                "afd_node_requests_running",
                "Running requests per attention node.",
            ),
            (
                "afd_node_requests_waiting",
                "Waiting requests per attention node.",
            ),
            (
                "afd_node_kv_cache_usage_perc",
                "KV-cache use per attention node (0 to 1).",
            ),
            (
                "afd_node_healthy",
                "1 while the attention node's last step succeeded.",
            ),
            (
                "afd_card_modeled_seconds",
                "Modeled busy time of each card so far.",
            ),
            (
                "afd_expert_balancedness",
                "Per MoE layer, the mean over cards of a card's expert tokens divided by the largest, over the last 60 s (vLLM's balancedness; 1 is perfectly even).",
            ),
            (
                "afd_card_up",
                "1 while the card is up, 0 while it is down or rejoining (per attention node).",
            ),
            (
                "afd_clock_time_dilation",
                "Wall seconds per modeled second (--clock modeled): every time the server reports is modeled time; clients measuring wall time divide by this.",
            ),
            (
                "afd_clock_dilation_settled",
                "1 once the dilation is fixed (--time-dilation auto measures the first steps first).",
            ),
            (
                "afd_clock_required_dilation",
                "The smallest dilation at which this host would have finished every step so far within its dilated modeled time.",
            ),
            (
                "afd_clock_modeled_step_seconds",
                "Modeled seconds of every step so far, over every attention node.",
            ),
        ] {
            recorder.describe_gauge(name.into(), None, help.into());
        }
        for (name, help) in [
            ("vllm:prompt_tokens_total", "Prompt tokens prefilled."),
            ("vllm:generation_tokens_total", "Tokens generated."),
            ("vllm:num_preemptions_total", "Preemptions by recompute."),
            (
                "vllm:prefix_cache_queries_total",
                "Prefix cache queries, in tokens: every token of each request admitted with prefix caching on.",
            ),
            (
                "vllm:prefix_cache_hits_total",
                "Prefix cache hits, in tokens: prompt tokens whose KV blocks were found cached and not computed again.",
            ),
            (
                "afd_computed_tokens_total",
                "Tokens computed, recomputation included.",
            ),
            ("afd_steps_total", "Steps run by the attention nodes."),
            (
                "afd_clock_late_steps_total",
                "Steps the host did not finish within their dilated modeled time (--clock modeled): their tokens came late.",
            ),
            ("afd_clock_steps_total", "Steps timed by the modeled clock."),
            (
                "afd_jetstream_bytes_total",
                "Bytes over JetStream per layer (both ways).",
            ),
            (
                "afd_expert_tokens_total",
                "Token-expert assignments routed to each card.",
            ),
            (
                "afd_request_errors_total",
                "Requests answered with an error, by type.",
            ),
            (
                "afd_card_failures_total",
                "Times the card went down, as an attention node saw it.",
            ),
            (
                "afd_card_rejoins_total",
                "Times the card came back and its shard was loaded again.",
            ),
        ] {
            recorder.describe_counter(name.into(), None, help.into());
        }
        Metrics {
            model_name: model_name.to_string(),
            ttft,
            itl,
            tpot,
            e2e,
            queue,
            prefill,
            decode,
            inference,
            prompt_len,
            gen_len,
            params_n,
            params_max_tokens,
            success,
            balance: std::sync::Mutex::new(BalanceWindow::new(BALANCE_WINDOW)),
            recorder,
        }
    }

    fn labels(&self, extra: &[(&'static str, String)]) -> Vec<Label> {
        let mut labels = vec![Label::new("model_name", self.model_name.clone())];
        labels.extend(extra.iter().map(|(k, v)| Label::new(*k, v.clone())));
        labels
    }

    fn gauge(&self, name: &'static str, extra: &[(&'static str, String)]) -> Gauge {
        self.recorder
            .register_gauge(&Key::from_parts(name, self.labels(extra)), &METADATA)
    }

    fn counter(&self, name: &'static str, extra: &[(&'static str, String)]) -> Counter {
        self.recorder
            .register_counter(&Key::from_parts(name, self.labels(extra)), &METADATA)
    }

    /// Records a request's parameters when it is admitted.
    pub fn request_params(&self, n: usize, max_tokens: usize) {
        self.params_n.record(n as f64);
        self.params_max_tokens.record(max_tokens as f64);
    }

    /// A sequence's first token.
    pub fn first_token(&self, t: &SequenceTiming) {
        if let Some(first) = t.first_token {
            self.ttft.record(secs(first - t.arrival));
            if let Some(s) = t.first_scheduled {
                self.queue
                    .record(secs(s.saturating_duration_since(t.arrival)));
                self.prefill
                    .record(secs(first.saturating_duration_since(s)));
            }
        }
    }

    /// The gap before a later token.
    pub fn inter_token(&self, gap: Duration) {
        self.itl.record(secs(gap));
    }

    /// A sequence ended (`now` is when its last output left the server).
    pub fn finished(&self, t: &SequenceTiming, reason: FinishedReason, now: Instant) {
        self.success[reason as usize].increment(1);
        self.e2e
            .record(secs(now.saturating_duration_since(t.arrival)));
        self.prompt_len.record(t.prompt_tokens as f64);
        self.gen_len.record(t.generated as f64);
        if let (Some(first), Some(last)) = (t.first_token, t.last_token) {
            self.decode
                .record(secs(last.saturating_duration_since(first)));
            if t.generated > 1 {
                self.tpot
                    .record(secs(last.saturating_duration_since(first)) / (t.generated - 1) as f64);
            }
            if let Some(s) = t.first_scheduled {
                self.inference
                    .record(secs(last.saturating_duration_since(s)));
            }
        }
    }

    /// A request answered with an error of `error_type`.
    pub fn error(&self, error_type: &str) {
        self.counter(
            "afd_request_errors_total",
            &[("type", error_type.to_string())],
        )
        .increment(1);
    }

    /// Records card `card`'s state as attention node `node` sees it.
    pub fn card(&self, node: usize, card: usize, up: bool, failures: u64, rejoins: u64) {
        let labels = [("node", node.to_string()), ("card", card.to_string())];
        self.gauge("afd_card_up", &labels)
            .set(if up { 1.0 } else { 0.0 });
        self.counter("afd_card_failures_total", &labels)
            .absolute(failures);
        self.counter("afd_card_rejoins_total", &labels)
            .absolute(rejoins);
    }

    /// The Prometheus text, with the engines' gauges and counters read from `stats` and the
    /// disaggregated path's from `afd`.
    pub fn render(
        &self,
        stats: &RouterStats,
        afd: Option<&AfdStats>,
        clock: &ClockSnapshot,
        block_size: usize,
    ) -> String {
        self.gauge("vllm:num_requests_running", &[])
            .set(stats.running() as f64);
        self.gauge("vllm:num_requests_waiting", &[])
            .set(stats.waiting() as f64);
        self.gauge("vllm:kv_cache_usage_perc", &[])
            .set(stats.kv_usage());
        self.counter("vllm:prompt_tokens_total", &[])
            .absolute(stats.sum(|s| s.prompt_tokens_total));
        self.counter("vllm:generation_tokens_total", &[])
            .absolute(stats.sum(|s| s.generation_tokens_total));
        self.counter("vllm:num_preemptions_total", &[])
            .absolute(stats.sum(|s| s.num_preemptions_total));
        self.counter("vllm:prefix_cache_queries_total", &[])
            .absolute(stats.sum(|s| s.prefix_cache_queries_total));
        self.counter("vllm:prefix_cache_hits_total", &[])
            .absolute(stats.sum(|s| s.prefix_cache_hits_total));
        self.counter("afd_computed_tokens_total", &[])
            .absolute(stats.sum(|s| s.computed_tokens_total));
        self.counter("afd_steps_total", &[])
            .absolute(stats.sum(|s| s.steps_total));
        let blocks: usize = stats
            .nodes
            .iter()
            .map(|n| n.scheduler.kv_blocks_total)
            .sum();
        self.gauge(
            "vllm:cache_config_info",
            &[
                ("block_size", block_size.to_string()),
                ("num_gpu_blocks", blocks.to_string()),
                ("num_attention_nodes", stats.nodes.len().to_string()),
            ],
        )
        .set(1.0);
        for (i, n) in stats.nodes.iter().enumerate() {
            let node = [("node", i.to_string())];
            self.gauge("afd_node_requests_running", &node)
                .set(n.scheduler.running as f64);
            self.gauge("afd_node_requests_waiting", &node).set(
                (n.not_started.max(n.scheduler.waiting_new) + n.scheduler.waiting_preempted) as f64,
            );
            self.gauge("afd_node_kv_cache_usage_perc", &node)
                .set(n.scheduler.kv_usage());
            self.gauge("afd_node_healthy", &node)
                .set(if n.healthy { 1.0 } else { 0.0 });
        }
        if let Some(afd) = afd {
            for (card, s) in afd.card_modeled_seconds.iter().enumerate() {
                self.gauge("afd_card_modeled_seconds", &[("card", card.to_string())])
                    .set(*s);
            }
            for (card, b) in afd.jetstream_bytes_per_card.iter().enumerate() {
                self.counter(
                    "afd_card_jetstream_bytes_total",
                    &[("card", card.to_string())],
                )
                .absolute(*b);
            }
            for (layer, b) in afd.jetstream_bytes_per_layer.iter().enumerate() {
                self.counter("afd_jetstream_bytes_total", &[("layer", layer.to_string())])
                    .absolute(*b);
            }
            for (card, t) in afd.expert_tokens_per_card.iter().enumerate() {
                self.counter("afd_expert_tokens_total", &[("card", card.to_string())])
                    .absolute(*t);
            }
            self.balancedness(&afd.expert_tokens_per_layer_card);
        }
        if clock.modeled {
            self.gauge("afd_clock_time_dilation", &[])
                .set(clock.dilation);
            self.gauge("afd_clock_dilation_settled", &[])
                .set(if clock.settled { 1.0 } else { 0.0 });
            self.counter("afd_clock_late_steps_total", &[])
                .absolute(clock.late_steps);
            self.counter("afd_clock_steps_total", &[])
                .absolute(clock.steps);
            self.gauge("afd_clock_required_dilation", &[])
                .set(clock.required_dilation);
            self.gauge("afd_clock_modeled_step_seconds", &[])
                .set(clock.modeled_step_seconds);
        }
        self.recorder.handle().render()
    }

    /// Per MoE layer, vLLM's balancedness of the cards' expert tokens over the last
    /// [`BALANCE_WINDOW`] (a gauge; a layer no token reached in the window keeps its last
    /// value), each window's value also observed into a histogram over every layer.
    fn balancedness(&self, per_layer_card: &[Vec<u64>]) {
        if per_layer_card.is_empty() {
            return;
        }
        let per_layer = self
            .balance
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .observe(Instant::now(), per_layer_card);
        let histogram = self
            .recorder
            .register_histogram(&Key::from_parts(BALANCEDNESS, self.labels(&[])), &METADATA);
        for (layer, b) in per_layer.iter().enumerate() {
            if let Some(b) = b {
                self.gauge("afd_expert_balancedness", &[("layer", layer.to_string())])
                    .set(*b);
                histogram.record(*b);
            }
        }
    }

    /// Folds recorded histogram samples into their buckets (call now and then, so samples do
    /// not pile up between scrapes).
    pub fn upkeep(&self) {
        self.recorder.handle().run_upkeep();
    }
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_vllm_names_with_buckets_and_labels() {
        let m = Metrics::new("tiny", 4096);
        let now = Instant::now();
        let t = SequenceTiming {
            arrival: now,
            first_scheduled: Some(now),
            first_token: Some(now + Duration::from_millis(30)),
            last_token: Some(now + Duration::from_millis(90)),
            generated: 4,
            prompt_tokens: 7,
            max_tokens: 4,
        };
        m.first_token(&t);
        m.inter_token(Duration::from_millis(20));
        m.finished(&t, FinishedReason::Length, now + Duration::from_millis(95));
        let text = m.render(&RouterStats::default(), None, &ClockSnapshot::default(), 16);
        assert!(
            text.contains(
                "vllm:time_to_first_token_seconds_bucket{model_name=\"tiny\",le=\"0.04\"} 1"
            ),
            "{text}"
        );
        assert!(text.contains("vllm:inter_token_latency_seconds_count{model_name=\"tiny\"} 1"));
        assert!(text.contains(
            "vllm:request_success_total{model_name=\"tiny\",finished_reason=\"length\"} 1"
        ));
        assert!(text.contains("vllm:num_requests_running{model_name=\"tiny\"} 0"));
        assert!(text.contains("# TYPE vllm:e2e_request_latency_seconds histogram"));
        assert_eq!(
            one_two_five(100),
            vec![1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0]
        );
    }

    #[test]
    fn afd_hooks_are_exported_when_filled() {
        let m = Metrics::new("tiny", 128);
        let afd = AfdStats {
            card_modeled_seconds: vec![0.5, 0.25],
            jetstream_bytes_per_card: vec![100, 200],
            jetstream_bytes_per_layer: vec![7],
            expert_tokens_per_card: vec![3, 4],
            expert_tokens_per_layer_card: vec![vec![1, 2], vec![], vec![2, 2]],
        };
        let render = || {
            m.render(
                &RouterStats::default(),
                Some(&afd),
                &ClockSnapshot::default(),
                16,
            )
        };
        let text = render();
        assert!(
            text.contains("afd_card_modeled_seconds{model_name=\"tiny\",card=\"1\"} 0.25"),
            "{text}"
        );
        assert!(
            text.contains("afd_card_jetstream_bytes_total{model_name=\"tiny\",card=\"0\"} 100")
        );
        assert!(text.contains("afd_jetstream_bytes_total{model_name=\"tiny\",layer=\"0\"} 7"));
        assert!(text.contains("afd_expert_tokens_total{model_name=\"tiny\",card=\"1\"} 4"));
        assert!(
            text.contains("afd_expert_balancedness{model_name=\"tiny\",layer=\"0\"} 0.75"),
            "{text}"
        );
        assert!(text.contains("afd_expert_balancedness{model_name=\"tiny\",layer=\"2\"} 1"));
        assert!(
            !text.contains("layer=\"1\"} "),
            "a dense layer has no balancedness"
        );
        m.upkeep();
        let text = render();
        assert!(
            text.contains(
                "afd_expert_balancedness_window_bucket{model_name=\"tiny\",le=\"0.8\"} 1"
            ),
            "the first window's 0.75 and 1.0 observed: {text}"
        );
        assert!(text.contains("afd_expert_balancedness_window_count{model_name=\"tiny\"} 2"));
    }

    #[test]
    fn two_servers_in_one_process_keep_separate_metrics() {
        let a = Metrics::new("a", 128);
        let b = Metrics::new("b", 128);
        a.request_params(1, 16);
        assert!(
            a.render(&RouterStats::default(), None, &ClockSnapshot::default(), 16)
                .contains("vllm:request_params_n_count{model_name=\"a\"} 1")
        );
        assert!(
            !b.render(&RouterStats::default(), None, &ClockSnapshot::default(), 16)
                .contains("model_name=\"a\"")
        );
    }
}
