//! `afd emulate` end to end: the seed's four GPT-OSS-20B figures through an emulated load test
//! (uniform routing), within 15% of the seed and 2% of `afd plan`; the step model the planner
//! applies to its uniform batch is the emulation's, on every shipped deployment file; the
//! bundled model's own routing, recorded and replayed; a rate sweep and a sizing table from
//! one command each. And `afd serve --clock modeled`: the bundled model served on a modeled
//! clock, dilated; every answer says the dilation; afd-loadtest divides by it and then
//! measures what `afd emulate` computes for the same deployment and workload; `/metrics` counts
//! the steps and the late ones; the official `openai` Python client streams from it (skipped,
//! saying so, where the package is missing).

mod common;

use std::path::Path;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::{AFD, Proc, afd_ok, deployments, free_port, wait_healthy};
use deploy::deployment::Deployment;
use serde_json::Value;
use step::{SampleRequest, StepBatch, StepEntry};

/// `afd emulate FILE ARGS` with its result written to `dir/result.json`, read back.
fn emulate(file: &Path, dir: &Path, args: &[&str]) -> Value {
    afd_ok(|c| {
        c.arg("emulate")
            .arg(file)
            .args(args)
            .args([
                "--no-progress",
                "--no-plots",
                "--result-filename",
                "result.json",
            ])
            .arg("--result-dir")
            .arg(dir)
    });
    let text = std::fs::read_to_string(dir.join("result.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn plan(file: &Path, args: &[&str]) -> Value {
    let out = afd_ok(|c| c.arg("plan").arg(file).arg("--json").args(args));
    serde_json::from_slice(&out).unwrap()
}

fn close(what: &str, got: f64, want: f64, within: f64) -> String {
    let error = (got - want) / want;
    assert!(
        error.abs() <= within,
        "{what}: {got:.4} against {want:.4} ({:+.1}%, allowed {:.0}%)",
        100.0 * error,
        100.0 * within
    );
    format!(
        "{what}: {got:.4} against {want:.4} ({:+.1}%)\n",
        100.0 * error
    )
}

#[test]
fn the_seed_figures_come_out_of_an_emulated_load_test() {
    let dir = tempfile::tempdir().unwrap();
    let mut table = String::new();
    // Batch 1 at a 1K context: the mean TPOT of requests sent one at a time.
    for (file, seed) in [
        ("gpt-oss-20b-1xh100.toml", 2.59),
        ("gpt-oss-20b-1xh100-8cards.toml", 1.28),
    ] {
        let path = deployments().join(file);
        let r = emulate(
            &path,
            dir.path(),
            &[
                "--num-prompts",
                "4",
                "--max-concurrency",
                "1",
                "--input-len",
                "1024",
                "--output-len",
                "16",
                "--ignore-eos",
            ],
        );
        assert_eq!(r["completed"], 4);
        assert_eq!(r["time_base"]["clock"], "modeled");
        let tpot = r["mean_tpot_ms"].as_f64().unwrap();
        let planned = plan(&path, &[])["predicted"]["tpot_ms"].as_f64().unwrap();
        table += &close(&format!("{file} TPOT vs seed"), tpot, seed, 0.15);
        table += &close(&format!("{file} TPOT vs plan"), tpot, planned, 0.02);
    }
    // Batch 64 over two H100s at context 129: a decode step of the full batch.
    let two = deployments().join("gpt-oss-20b-2xh100-8cards-batch64.toml");
    let r = emulate(
        &two,
        dir.path(),
        &[
            "--num-prompts",
            "64",
            "--max-concurrency",
            "64",
            "--input-len",
            "128",
            "--output-len",
            "8",
            "--ignore-eos",
        ],
    );
    let full = &r["emulation"]["steps"]["full_batch_decode"];
    assert_eq!(full["tokens"].as_f64(), Some(32.0), "{full}");
    let step = full["step_ms"].as_f64().unwrap();
    let planned = plan(&two, &[])["predicted"]["step_ms"].as_f64().unwrap();
    table += &close("batch-64 decode step vs seed", step, 2.46, 0.15);
    table += &close("batch-64 decode step vs plan", step, planned, 0.02);
    // 1K in / 1K out at batch 64: output tokens per second over the whole run.
    let r = emulate(
        &two,
        dir.path(),
        &[
            "--num-prompts",
            "64",
            "--max-concurrency",
            "64",
            "--input-len",
            "1024",
            "--output-len",
            "1024",
            "--ignore-eos",
        ],
    );
    let rate = r["output_throughput"].as_f64().unwrap();
    let planned = plan(&two, &["--input-len", "1024", "--output-len", "1024"])["predicted"]
        ["output_tokens_per_s"]
        .as_f64()
        .unwrap();
    table += &close("1K/1K output tok/s vs seed", rate, 20413.0, 0.15);
    table += &close("1K/1K output tok/s vs plan", rate, planned, 0.02);
    eprintln!("{table}");
}

/// The planner's prediction of a decode step is the emulation's step model applied to the
/// planner's uniform batch: equal on every shipped deployment file.
#[test]
fn the_plan_is_the_step_model_on_a_uniform_batch_for_every_shipped_file() {
    for file in &common::shipped_deployments() {
        let mut d = Deployment::load(file).unwrap();
        d.workload.output_len = 0;
        let (config, stored) = deploy::plan::model_shape(&d).unwrap();
        let profiles = deploy::plan::load_profiles(&d).unwrap();
        let target = deploy::plan::target(&d);
        let planned = planner::plan(&target, &config, &stored, &profiles).unwrap();
        let step_ms = planned.predicted.unwrap().step_ms;
        let model = emulate::StepModel::new(&target, config, &stored, profiles).unwrap();
        let nodes = d.attention.nodes;
        let per_node = d.workload.batch.div_ceil(nodes);
        let context = d.workload.input_len.max(1);
        let batch = StepBatch {
            entries: (0..per_node as u64)
                .map(|seq| StepEntry {
                    seq,
                    tokens: vec![0],
                    start: context - 1,
                    prompt_len: context - 1,
                    block_table: Vec::new(),
                    sample: Some(SampleRequest {
                        params: Default::default(),
                        penalties: Default::default(),
                        logprobs: false,
                        top_logprobs: 0,
                        allowed: None,
                    }),
                    cached_prefix: Vec::new(),
                    prompt_logprobs: None,
                })
                .collect(),
        };
        // No routing reported: uniform routing in expectation, the planner's.
        let modeled = model.time(&batch, None, nodes).detail.time.seconds * 1e3;
        assert!(
            (modeled - step_ms).abs() <= 1e-9 * step_ms,
            "{}: emulation's step model {modeled} ms, plan {step_ms} ms",
            file.display()
        );
    }
}

/// The bundled model's own routing is skewed: recorded from the model on real prompts, it
/// replays as a trace, and makes the hottest card busier than uniform routing does.
#[test]
fn the_bundled_models_routing_is_recorded_and_replayed() {
    let dir = tempfile::tempdir().unwrap();
    let tiny = deployments().join("tiny.toml");
    let record = dir.path().join("routing.json");
    let common = [
        "--num-prompts",
        "8",
        "--max-concurrency",
        "4",
        "--input-len",
        "64",
        "--output-len",
        "24",
        "--ignore-eos",
    ];
    let mut args = common.to_vec();
    args.extend(["--routing", "model", "--record-routing"]);
    args.push(record.to_str().unwrap());
    let model = emulate(&tiny, dir.path(), &args);
    assert_eq!(model["completed"], 8);
    assert_eq!(model["emulation"]["routing"], "model");
    let counts = emulate::RoutingCounts::read(&record).unwrap();
    let skew = counts.hottest_over_mean();
    assert!(!skew.is_empty());
    assert!(
        skew.iter().all(|&s| s > 1.5),
        "the bundled model routes unevenly in every layer: {skew:?}"
    );
    let trace = format!("trace:{}", record.display());
    let mut args = common.to_vec();
    args.extend(["--routing", &trace]);
    let replayed = emulate(&tiny, dir.path(), &args);
    let mut args = common.to_vec();
    args.extend(["--routing", "uniform"]);
    let uniform = emulate(&tiny, dir.path(), &args);
    let hottest = |r: &Value| {
        r["emulation"]["card_busy"]["hottest_over_mean"]
            .as_f64()
            .unwrap()
    };
    assert!(
        hottest(&replayed) >= hottest(&uniform),
        "trace {} uniform {}",
        hottest(&replayed),
        hottest(&uniform)
    );
    // Generated token text comes back with the model's routing only.
    assert!(
        model["generated_texts"][0]
            .as_str()
            .is_some_and(|t| !t.is_empty())
    );
}

/// A rate sweep says where queueing starts; a sizing run prints the table and the smallest
/// card count that meets the SLOs; a trace opens as trace-event JSON.
#[test]
fn a_sweep_a_sizing_table_and_a_trace_from_one_command_each() {
    let dir = tempfile::tempdir().unwrap();
    let twenty = deployments().join("gpt-oss-20b-1xh100-8cards.toml");
    let out = afd_ok(|c| {
        c.arg("emulate")
            .arg(&twenty)
            .args([
                "--num-prompts",
                "48",
                "--input-len",
                "256",
                "--output-len",
                "64",
                "--ignore-eos",
                "--max-num-seqs",
                "64",
                "--sweep",
                "rate=20,200,2000",
                "--goodput",
                "ttft:50",
                "--no-progress",
                "--result-dir",
            ])
            .arg(dir.path())
    });
    let text = String::from_utf8_lossy(&out);
    assert!(text.contains("knee: queueing starts by"), "{text}");
    let summaries: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert!(
        summaries.iter().any(|f| f.ends_with("summary.json")),
        "{summaries:?}"
    );
    assert!(
        summaries.iter().any(|f| f.ends_with("goodput.svg")),
        "{summaries:?}"
    );

    let out = afd_ok(|c| {
        c.arg("emulate").arg(&twenty).args([
            "--num-prompts",
            "32",
            "--input-len",
            "512",
            "--output-len",
            "32",
            "--ignore-eos",
            "--request-rate",
            "40",
            "--max-num-seqs",
            "64",
            "--goodput",
            "tpot:1.6",
            "--size-cards",
            "6,8",
            "--size-nodes",
            "1",
            "--no-progress",
            "--no-save",
        ])
    });
    let text = String::from_utf8_lossy(&out);
    assert!(
        text.contains("| 1 | 6 |") && text.contains("| 1 | 8 |"),
        "{text}"
    );
    assert!(text.contains("with 1 attention node(s):"), "{text}");

    let trace = dir.path().join("trace.json");
    afd_ok(|c| {
        c.arg("emulate")
            .arg(&twenty)
            .args([
                "--num-prompts",
                "4",
                "--input-len",
                "128",
                "--output-len",
                "8",
            ])
            .args([
                "--max-concurrency",
                "2",
                "--no-progress",
                "--no-save",
                "--trace",
            ])
            .arg(&trace)
    });
    let t: Value = serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let events = t["traceEvents"].as_array().unwrap();
    assert!(events.iter().any(|e| e["args"]["name"] == "card 7"));
    assert!(events.iter().filter(|e| e["ph"] == "X").count() > 100);
}

/// A deployment that does not fit says so instead of emulating, and a card that does not
/// exist cannot fail.
#[test]
fn bad_requests_are_refused_with_the_reason() {
    let twenty = deployments().join("gpt-oss-20b-1xh100-8cards.toml");
    let out = std::process::Command::new(AFD)
        .arg("emulate")
        .arg(&twenty)
        .args(["--cards", "2", "--no-save", "--num-prompts", "2"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("does not fit") && e.contains("SRAM"), "{e}");
    let out = std::process::Command::new(AFD)
        .arg("emulate")
        .arg(&twenty)
        .args(["--fail-card", "9", "--no-save", "--num-prompts", "2"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("--fail-card 9 names no card"), "{e}");
}

const DILATION: f64 = 400.0;

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(name) && !l.starts_with('#'))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{name} missing from /metrics"))
}

#[test]
fn a_modeled_clock_serves_what_the_emulation_computes() {
    let port = free_port();
    let dir = tempfile::tempdir().unwrap();
    let recorded = dir.path().join("served-routing.json");
    let mut serve = Proc(
        Command::new(AFD)
            .arg("serve")
            .args(["--port", &port.to_string(), "--cards", "2"])
            .args(["--clock", "modeled", "--time-dilation"])
            .arg(DILATION.to_string())
            .args(["--micro-batches", "1", "--max-num-batched-tokens", "256"])
            .arg("--record-routing")
            .arg(&recorded)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let address = format!("127.0.0.1:{port}");
    wait_healthy(&address, Duration::from_secs(300));

    // afd-loadtest against it: the times come back divided by the dilation.
    let config = loadtest::BenchmarkConfig {
        base_url: format!("http://{address}"),
        num_prompts: 6,
        max_concurrency: Some(2),
        prompts: loadtest::PromptConfig {
            source: loadtest::PromptSource::TokenIds,
            input_len: 32,
            prefix_len: 0,
            output_len: 12,
            range_ratio: 0.0,
            vocab_size: 200,
        },
        ignore_eos: true,
        ..loadtest::BenchmarkConfig::default()
    };
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let served = runtime.block_on(loadtest::run_benchmark(&config)).unwrap();
    assert_eq!((served.completed, served.failed), (6, 0));
    let base = served.time_base.as_ref().expect("the dilation was read");
    assert_eq!(base.clock, "dilated");
    assert_eq!(base.dilation, DILATION);

    // The same deployment and workload emulated: what the served times should be.
    let file = dir.path().join("serve.toml");
    let model = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/afd-tiny-gpt-oss");
    std::fs::write(
        &file,
        format!(
            "[model]\npath = {:?}\n[attention]\nmax_num_seqs = 256\nmax_model_len = 4096\n\
             max_num_batched_tokens = 256\n[cards]\ncount = 2\n[overlap]\nmicro_batches = 1\n",
            model.display().to_string()
        ),
    )
    .unwrap();
    afd_ok(|c| {
        c.arg("emulate")
            .arg(&file)
            .args([
                "--num-prompts",
                "6",
                "--max-concurrency",
                "2",
                "--input-len",
                "32",
                "--output-len",
                "12",
                "--ignore-eos",
                "--vocab-size",
                "200",
                "--no-progress",
                "--no-plots",
                "--result-filename",
                "emulated.json",
                "--result-dir",
            ])
            .arg(dir.path())
    });
    let emulated: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("emulated.json")).unwrap())
            .unwrap();
    let modeled_tpot = emulated["mean_tpot_ms"].as_f64().unwrap();
    let served_tpot = served.latency.tpot.mean_ms;
    // A step's tokens are never released before its dilated modeled end, so the served TPOT
    // is at least the modeled one; the host's own overhead, divided by the dilation, adds
    // little on top.
    assert!(
        served_tpot >= 0.97 * modeled_tpot && served_tpot <= 1.5 * modeled_tpot,
        "served TPOT {served_tpot} ms, emulated {modeled_tpot} ms"
    );

    let (_, metrics) = common::http(&address, "GET", "/metrics", None).unwrap();
    assert_eq!(metric(&metrics, "afd_clock_time_dilation"), DILATION);
    assert!(metric(&metrics, "afd_clock_steps_total") >= 12.0);
    assert!(metric(&metrics, "afd_clock_modeled_step_seconds") > 0.0);
    let required = metric(&metrics, "afd_clock_required_dilation");
    let late = metric(&metrics, "afd_clock_late_steps_total");
    assert!(
        (late == 0.0) == (required <= DILATION),
        "{late} late steps, but every step needed at most {required}"
    );

    // Another client: the official openai package streams from the dilated server and sees
    // the header.
    let python = std::env::var("AFD_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = r#"
import os, sys
from openai import OpenAI
client = OpenAI(base_url=os.environ["BASE"] + "/v1", api_key="none")
raw = client.completions.with_raw_response.create(
    model="afd-tiny-gpt-oss", prompt="It is a truth", max_tokens=4, temperature=0)
assert raw.headers.get("x-afd-time-dilation") == os.environ["K"], raw.headers
pieces = [c.choices[0].text for c in client.completions.create(
    model="afd-tiny-gpt-oss", prompt="It is a truth", max_tokens=6, temperature=0,
    stream=True) if c.choices]
assert len(pieces) >= 1, pieces
print("openai client ok:", "".join(pieces))
"#;
    match Command::new(&python).args(["-c", "import openai"]).status() {
        Ok(s) if s.success() => {
            let out = Command::new(&python)
                .args(["-c", script])
                .env("BASE", format!("http://{address}"))
                .env("K", DILATION.to_string())
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        _ => test_skips::skipped(&format!(
            "the openai client part: `{python} -c 'import openai'` failed; install it with \
             `pip install openai` (or set AFD_PYTHON)"
        )),
    }

    // Stopped, the server writes the routing of every step it served.
    // SAFETY: kill only sends a signal to the child this test started.
    unsafe { libc::kill(serve.0.id() as libc::pid_t, libc::SIGTERM) };
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while serve.0.try_wait().unwrap().is_none() {
        assert!(
            std::time::Instant::now() < deadline,
            "afd serve did not stop on SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let counts = emulate::RoutingCounts::read(&recorded).unwrap();
    let steps: u64 = counts.windows.iter().map(|w| w.steps).sum();
    assert!(
        steps as f64 >= metric(&metrics, "afd_clock_steps_total"),
        "{steps} steps recorded"
    );
    assert_eq!((counts.layers, counts.experts, counts.top_k), (6, 8, 2));
}
