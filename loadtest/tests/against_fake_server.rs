//! afd-loadtest against a scripted fake OpenAI server on loopback: goodput, failures, the
//! JSON fields, endpoints, prompt sources, arrivals, sweeps, and clear errors (never a panic).
//! The timing accuracy tests are in `timing.rs`, a binary of their own so that no other test
//! competes with them for the CPU.

mod common;

use std::time::Duration;

use common::{Script, closed_port_url, config, start};
use loadtest::{
    BenchmarkConfig, EndpointKind, Error, OutputOptions, PromptSource, Sweep, run_benchmark,
    run_sweep, save_sweep,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn goodput_counts_requests_meeting_every_slo() {
    // Every 4th request is slow to start: 400 ms instead of 100 ms.
    let server = start(Script {
        ttft: Duration::from_millis(100),
        itl: Duration::from_millis(30),
        slow_every: Some((4, Duration::from_millis(400))),
        ..Script::default()
    })
    .await;
    let base = config(&server.base_url, 8, 4);
    let ttft_slo = BenchmarkConfig {
        goodput: vec!["ttft:250".parse().unwrap()],
        ..base.clone()
    };
    let r = run_benchmark(&ttft_slo).await.unwrap();
    assert_eq!(r.completed, 8);
    assert_eq!(r.good_requests, Some(6));
    assert!((r.request_goodput.unwrap() - 6.0 / r.duration).abs() < 1e-9);

    // A TPOT bound below the scripted 30 ms: nobody meets both.
    let both = BenchmarkConfig {
        goodput: vec!["ttft:250".parse().unwrap(), "tpot:15".parse().unwrap()],
        ..base
    };
    let r = run_benchmark(&both).await.unwrap();
    assert_eq!(r.good_requests, Some(0));
    assert_eq!(r.request_goodput, Some(0.0));
    assert_eq!(r.workload.goodput, vec!["ttft:250", "tpot:15"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_are_counted_with_their_reasons() {
    // Requests 3, 6, 9 get HTTP 500; 5 and 10 break off with an error event.
    let server = start(Script {
        ttft: Duration::from_millis(30),
        itl: Duration::from_millis(10),
        http_error_every: Some((3, 500)),
        stream_error_every: Some(5),
        ..Script::default()
    })
    .await;
    let cfg = BenchmarkConfig {
        max_concurrency: Some(1),
        ..config(&server.base_url, 10, 4)
    };
    let r = run_benchmark(&cfg).await.unwrap();
    assert_eq!((r.completed, r.failed), (5, 5));
    let http = r.errors.iter().filter(|e| e.contains("HTTP 500")).count();
    let stream = r
        .errors
        .iter()
        .filter(|e| e.contains("error in the stream") && e.contains("scripted stream failure"))
        .count();
    assert_eq!((http, stream), (3, 2), "errors: {:?}", r.errors);
    assert!(
        r.errors
            .iter()
            .filter(|e| e.contains("HTTP 500"))
            .all(|e| e.contains("scripted failure"))
    );
    assert_eq!(r.failure_reasons.iter().map(|f| f.count).sum::<usize>(), 5);
    assert_eq!(r.total_output_tokens, 5 * 4);
    assert!(r.output_lens.iter().filter(|&&n| n == 0).count() == 5);
    assert!((r.request_throughput - 5.0 / r.duration).abs() < 1e-9);
    // Failed requests report zero latencies, like vLLM.
    for (i, e) in r.errors.iter().enumerate() {
        if !e.is_empty() {
            assert_eq!(r.ttfts[i], 0.0);
            assert!(r.itls[i].is_empty());
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn result_json_has_every_vllm_field_in_vllm_units() {
    let server = start(Script::default()).await;
    let cfg = BenchmarkConfig {
        goodput: vec!["e2el:5000".parse().unwrap()],
        percentiles: vec![90.0, 99.0, 99.9],
        ..config(&server.base_url, 4, 4)
    };
    let r = run_benchmark(&cfg).await.unwrap();
    let v: serde_json::Value = serde_json::from_str(&r.to_json_pretty()).unwrap();
    let mut fields: Vec<String> = [
        "date",
        "endpoint_type",
        "backend",
        "label",
        "model_id",
        "tokenizer_id",
        "num_prompts",
        "request_rate",
        "burstiness",
        "max_concurrency",
        "duration",
        "completed",
        "failed",
        "total_input_tokens",
        "total_output_tokens",
        "request_throughput",
        "request_goodput",
        "output_throughput",
        "total_token_throughput",
        "max_output_tokens_per_s",
        "max_concurrent_requests",
        "input_lens",
        "output_lens",
        "ttfts",
        "itls",
        "latencies",
        "start_times",
        "queue_times",
        "generated_texts",
        "errors",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for m in ["ttft", "tpot", "itl", "e2el"] {
        for stat in ["mean", "median", "std", "p90", "p99", "p99.9"] {
            fields.push(format!("{stat}_{m}_ms"));
        }
    }
    for f in &fields {
        assert!(v.get(f).is_some(), "result JSON lacks vLLM field {f}");
    }
    assert_eq!(v["request_rate"], "inf");
    assert_eq!(v["backend"], "openai");
    assert_eq!(v["endpoint_type"], "openai");
    assert_eq!(v["max_concurrency"], serde_json::Value::Null);
    assert_eq!(v["num_prompts"], 4);
    assert_eq!(v["completed"], 4);
    assert!(v["request_goodput"].as_f64().unwrap() > 0.0);
    // Per-request arrays in seconds, summaries in milliseconds.
    let ttft0 = v["ttfts"][0].as_f64().unwrap();
    assert!(ttft0 > 0.05 && ttft0 < 0.5, "ttfts are seconds: {ttft0}");
    let mean_ms = v["mean_ttft_ms"].as_f64().unwrap();
    assert!(
        mean_ms > 50.0 && mean_ms < 500.0,
        "mean_ttft_ms is ms: {mean_ms}"
    );
    for array in [
        "input_lens",
        "output_lens",
        "ttfts",
        "itls",
        "start_times",
        "generated_texts",
        "errors",
    ] {
        assert_eq!(v[array].as_array().unwrap().len(), 4, "{array}");
    }
    assert_eq!(v["generated_texts"][0], "tok tok tok tok ");
    assert_eq!(v["errors"][0], "");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_endpoint_sends_content_parts_and_reads_deltas() {
    let server = start(Script {
        ttft: Duration::from_millis(100),
        itl: Duration::from_millis(20),
        ..Script::default()
    })
    .await;
    let cfg = BenchmarkConfig {
        endpoint: EndpointKind::Chat,
        model: Some("fake-model".into()),
        ..config(&server.base_url, 3, 5)
    };
    let r = run_benchmark(&cfg).await.unwrap();
    assert_eq!(r.completed, 3, "errors: {:?}", r.errors);
    assert_eq!(r.backend, "openai-chat");
    assert_eq!(r.output_lens, vec![5; 3]);
    assert_eq!(
        r.input_lens,
        vec![16; 3],
        "prompt length from the server's usage"
    );
    assert_eq!(r.generated_texts[0], "tok ".repeat(5));
    let body = &server.request_bodies()[0];
    assert_eq!(body["messages"][0]["role"], "user");
    assert_eq!(body["messages"][0]["content"][0]["type"], "text");
    assert_eq!(body["max_completion_tokens"], 5);
    assert!(body.get("max_tokens").is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_file_prompts_are_sent_as_text() {
    let server = start(Script::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("prompts.txt");
    std::fs::write(&file, "first prompt here\nsecond one\n").unwrap();
    let mut cfg = config(&server.base_url, 3, 2);
    cfg.prompts.source = PromptSource::File(file);
    let r = run_benchmark(&cfg).await.unwrap();
    assert_eq!(r.completed, 3);
    let prompts: Vec<String> = server
        .request_bodies()
        .iter()
        .map(|b| b["prompt"].as_str().unwrap().to_string())
        .collect();
    let mut sorted = prompts.clone();
    sorted.sort();
    assert_eq!(
        sorted,
        vec!["first prompt here", "first prompt here", "second one"]
    );
    assert_eq!(
        r.workload.prompt_source,
        format!("file:{}", dir.path().join("prompts.txt").display())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_server_gives_clear_errors() {
    let url = closed_port_url();
    // No model given: the lookup fails and says where and why.
    let err = run_benchmark(&config(&url, 2, 2)).await.unwrap_err();
    assert!(matches!(err, Error::ModelLookup { .. }), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("/v1/models") && text.contains("could not connect"),
        "{text}"
    );

    // Model given, one warm-up: the warm-up failure stops the run.
    let cfg = BenchmarkConfig {
        model: Some("m".into()),
        num_warmups: 1,
        ..config(&url, 2, 2)
    };
    let text = run_benchmark(&cfg).await.unwrap_err().to_string();
    assert!(
        text.contains("warm-up") && text.contains("could not connect"),
        "{text}"
    );

    // No warm-up: the run completes and every request carries the reason.
    let cfg = BenchmarkConfig {
        model: Some("m".into()),
        ..config(&url, 3, 2)
    };
    let r = run_benchmark(&cfg).await.unwrap();
    assert_eq!((r.completed, r.failed), (0, 3));
    assert!(
        r.errors.iter().all(|e| e.contains("could not connect")),
        "{:?}",
        r.errors
    );
    assert_eq!(r.failure_reasons.len(), 1);
    assert_eq!(r.request_throughput, 0.0);
    assert_eq!(r.latency.ttft.mean_ms, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn error_answering_server_gives_clear_errors() {
    let server = start(Script {
        http_error_every: Some((1, 404)),
        models_status: 503,
        ..Script::default()
    })
    .await;
    let text = run_benchmark(&config(&server.base_url, 2, 2))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        text.contains("HTTP 503") && text.contains("models are unavailable"),
        "{text}"
    );

    let cfg = BenchmarkConfig {
        model: Some("fake-model".into()),
        num_warmups: 2,
        ..config(&server.base_url, 2, 2)
    };
    let err = run_benchmark(&cfg).await.unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(err, Error::WarmupFailed { attempted: 2, .. }),
        "{text}"
    );
    assert!(
        text.contains("HTTP 404 Not Found") && text.contains("scripted failure"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn arrivals_follow_the_rate_and_the_duration_limit_stops_sending() {
    let server = start(Script {
        ttft: Duration::from_millis(20),
        itl: Duration::from_millis(5),
        ..Script::default()
    })
    .await;
    // 10 requests at 20 req/s: arrivals are normalised to end at 10/20 = 0.5 s.
    let cfg = BenchmarkConfig {
        request_rate: 20.0,
        seed: 3,
        ..config(&server.base_url, 10, 2)
    };
    let r = run_benchmark(&cfg).await.unwrap();
    assert_eq!(r.completed, 10);
    let last = r.start_times.iter().copied().fold(0.0, f64::max);
    assert!((0.45..0.75).contains(&last), "last send at {last} s");
    assert_eq!(r.request_rate, 20.0);

    // 200 requests at 20 req/s would take 10 s; the limit stops sending after 0.5 s.
    let cfg = BenchmarkConfig {
        request_rate: 20.0,
        max_duration: Some(Duration::from_millis(500)),
        ..config(&server.base_url, 200, 2)
    };
    let r = run_benchmark(&cfg).await.unwrap();
    assert!(
        r.num_requests_sent > 0 && r.num_requests_sent < 40,
        "sent {}",
        r.num_requests_sent
    );
    assert_eq!(r.completed, r.num_requests_sent);
    assert_eq!(r.num_prompts, 200);
    assert!(r.duration < 2.0, "duration {}", r.duration);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sweep_writes_one_result_per_point_a_summary_and_plots() {
    let server = start(Script {
        ttft: Duration::from_millis(20),
        itl: Duration::from_millis(10),
        ..Script::default()
    })
    .await;
    let sweep: Sweep = "concurrency=1,2,4".parse().unwrap();
    let mut seen = Vec::new();
    let result = run_sweep(&config(&server.base_url, 4, 4), &sweep, |p| {
        seen.push(p.value)
    })
    .await
    .unwrap();
    assert_eq!(seen, vec![1.0, 2.0, 4.0]);
    let peaks: Vec<usize> = result
        .points
        .iter()
        .map(|p| p.result.max_concurrent_requests)
        .collect();
    assert_eq!(peaks, vec![1, 2, 4]);
    assert!(result.points.iter().all(|p| p.result.completed == 4));

    let dir = tempfile::tempdir().unwrap();
    let options = OutputOptions {
        result_dir: dir.path().to_path_buf(),
        ..OutputOptions::default()
    };
    let written = save_sweep(&result, &options).unwrap();
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&written[0]).unwrap()).unwrap();
    assert_eq!(summary["sweep_parameter"], "max_concurrency");
    let points = summary["points"].as_array().unwrap();
    assert_eq!(points.len(), 3);
    assert_eq!(points[2]["value"], "4");
    for p in points {
        let file = dir.path().join(p["result_file"].as_str().unwrap());
        let point: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(file).unwrap()).unwrap();
        assert_eq!(point["completed"], 4);
        assert!(p["mean_tpot_ms"].as_f64().unwrap() > 0.0);
    }
    let svgs: Vec<_> = written
        .iter()
        .filter(|p| p.extension().is_some_and(|e| e == "svg"))
        .collect();
    // Latency and timeline per point, then TPOT, TTFT, throughput and goodput for the sweep.
    assert_eq!(svgs.len(), 3 * 2 + 4);
    let tpot_plot = written
        .iter()
        .find(|p| p.to_string_lossy().ends_with(".tpot.svg"))
        .unwrap();
    let svg = std::fs::read_to_string(tpot_plot).unwrap();
    assert!(
        svg.contains("TPOT (ms)") && svg.contains("max concurrency") && svg.contains("mean TPOT")
    );
}
