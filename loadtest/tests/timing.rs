//! Timing accuracy against the scripted fake server: measured TTFT, TPOT, ITL, end-to-end
//! latency and throughput within 5% of the script. Delays are tens to hundreds of ms so that
//! scheduler noise on a loaded 2-core machine stays well inside the tolerance; the server
//! schedules chunks on absolute deadlines, and warm-ups open the connections beforehand so
//! TTFT does not include TCP setup.

mod common;

use std::time::Duration;

use common::{Script, config, start};
use loadtest::{BenchmarkConfig, run_benchmark};

fn assert_within(measured: f64, expected: f64, tolerance: f64, what: &str) {
    let off = measured / expected - 1.0;
    eprintln!(
        "{what}: measured {measured:.3}, scripted {expected:.3} ({:+.2}%)",
        off * 100.0
    );
    assert!(
        off.abs() <= tolerance,
        "{what}: measured {measured:.3}, scripted {expected:.3} ({:.1}% off, allowed {:.0}%)",
        off.abs() * 100.0,
        tolerance * 100.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn measures_scripted_ttft_tpot_itl_and_throughput() {
    let (ttft_ms, itl_ms, tokens) = (300.0, 40.0, 12usize);
    let server = start(Script {
        ttft: Duration::from_millis(300),
        itl: Duration::from_millis(40),
        ..Script::default()
    })
    .await;
    let cfg = BenchmarkConfig {
        max_concurrency: Some(4),
        num_warmups: 4,
        ..config(&server.base_url, 8, tokens)
    };
    let r = run_benchmark(&cfg).await.unwrap();
    assert_eq!((r.completed, r.failed), (8, 0), "errors: {:?}", r.errors);
    assert_eq!(r.model_id, "fake-model", "model comes from /v1/models");
    let e2el_ms = ttft_ms + (tokens - 1) as f64 * itl_ms;
    let l = &r.latency;
    assert_within(l.ttft.mean_ms, ttft_ms, 0.05, "mean TTFT");
    assert_within(l.ttft.median_ms, ttft_ms, 0.05, "median TTFT");
    assert_within(l.tpot.mean_ms, itl_ms, 0.05, "mean TPOT");
    assert_within(l.itl.mean_ms, itl_ms, 0.05, "mean ITL");
    assert_within(l.itl.median_ms, itl_ms, 0.05, "median ITL");
    assert_within(l.e2el.mean_ms, e2el_ms, 0.05, "mean E2EL");
    assert_eq!(r.output_lens, vec![tokens as u64; 8]);
    assert_eq!(r.total_output_tokens, 8 * tokens as u64);
    assert_eq!(r.total_input_tokens, 8 * 16);
    assert!(r.itls.iter().all(|gaps| gaps.len() == tokens - 1));
    // Throughput is totals over the measured duration ...
    let out = (8 * tokens) as f64;
    assert!((r.request_throughput - 8.0 / r.duration).abs() < 1e-9);
    assert!((r.output_throughput - out / r.duration).abs() < 1e-9);
    assert!((r.total_token_throughput - (out + 128.0) / r.duration).abs() < 1e-9);
    // ... and 8 requests, 4 at a time, take two request lifetimes.
    let expected_duration = 2.0 * e2el_ms / 1000.0;
    assert_within(r.duration, expected_duration, 0.05, "duration of two waves");
    assert_within(
        r.request_throughput,
        8.0 / expected_duration,
        0.05,
        "request throughput",
    );
    assert_within(
        r.output_throughput,
        out / expected_duration,
        0.05,
        "output throughput",
    );
    assert_eq!(r.max_concurrent_requests, 4);
    assert_eq!(r.request_goodput, None);

    // The requests had the shape vLLM's client sends.
    let bodies = server.request_bodies();
    assert_eq!(
        bodies.len(),
        4 + 8,
        "four warm-ups and eight measured requests"
    );
    for b in &bodies {
        assert_eq!(b["stream"], true);
        assert_eq!(b["stream_options"]["include_usage"], true);
        assert_eq!(b["ignore_eos"], true);
        assert_eq!(b["max_tokens"], tokens);
        assert_eq!(b["model"], "fake-model");
        let ids = b["prompt"].as_array().unwrap();
        assert_eq!(ids.len(), 16);
        assert!(ids.iter().all(|id| id.as_u64().unwrap() < 500));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_tokens_come_from_usage_not_from_chunks() {
    // Four tokens per chunk: 32 tokens arrive in 8 chunks 50 ms apart.
    let server = start(Script {
        ttft: Duration::from_millis(100),
        itl: Duration::from_millis(50),
        tokens_per_chunk: 4,
        ..Script::default()
    })
    .await;
    let cfg = BenchmarkConfig {
        num_warmups: 4,
        ..config(&server.base_url, 4, 32)
    };
    let r = run_benchmark(&cfg).await.unwrap();
    assert_eq!(r.completed, 4, "errors: {:?}", r.errors);
    assert_eq!(r.output_lens, vec![32; 4]);
    assert_eq!(r.outputs_without_usage, 0);
    assert!(r.itls.iter().all(|gaps| gaps.len() == 7));
    // TPOT spreads the 7 gaps over 31 tokens; ITL stays per chunk.
    assert_within(r.latency.tpot.mean_ms, 7.0 * 50.0 / 31.0, 0.05, "mean TPOT");
    assert_within(r.latency.itl.mean_ms, 50.0, 0.05, "mean ITL");
    assert_eq!(r.max_concurrent_requests, 4);
}
