//! The `afd-loadtest` binary end to end: against the fake server it prints the table and
//! writes the JSON and plots; against nothing it exits with a clear message, not a panic.

mod common;

use std::time::Duration;

use common::{Script, closed_port_url, start};
use tokio::process::Command;

fn binary() -> Command {
    Command::new(env!("CARGO_BIN_EXE_afd-loadtest"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_prints_table_and_writes_json_and_plots() {
    let server = start(Script {
        ttft: Duration::from_millis(30),
        itl: Duration::from_millis(10),
        ..Script::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let out = binary()
        .args(["--base-url", &server.base_url])
        .args([
            "--num-prompts",
            "6",
            "--input-len",
            "8",
            "--output-len",
            "5",
        ])
        .args(["--max-concurrency", "2", "--ignore-eos", "--no-progress"])
        .args(["--goodput", "ttft:1000", "tpot:1000"])
        .args(["--result-dir", dir.path().to_str().unwrap()])
        .args(["--result-filename", "run.json"])
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.contains("Serving Benchmark Result"), "{stdout}");
    assert!(stdout.contains("Request goodput (req/s):"), "{stdout}");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("run.json")).unwrap())
            .unwrap();
    assert_eq!(json["completed"], 6);
    assert_eq!(json["max_concurrency"], 2);
    assert_eq!(json["total_output_tokens"], 30);
    assert_eq!(json["model_id"], "fake-model");
    for plot in ["run.latency.svg", "run.timeline.svg"] {
        let svg = std::fs::read_to_string(dir.path().join(plot)).unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("</svg>"), "{plot}");
    }
    assert_eq!(
        server.request_bodies().len(),
        7,
        "six measured requests and one warm-up"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_sweep_prints_a_row_per_point() {
    let server = start(Script {
        ttft: Duration::from_millis(20),
        itl: Duration::from_millis(5),
        ..Script::default()
    })
    .await;
    let out = binary()
        .args(["--base-url", &server.base_url, "--sweep", "rate=50,inf"])
        .args([
            "--num-prompts",
            "3",
            "--input-len",
            "4",
            "--output-len",
            "3",
        ])
        .args(["--no-progress", "--no-save"])
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("request_rate"), "{stdout}");
    let rows: Vec<&str> = stdout
        .lines()
        .filter(|l| l.trim_start().starts_with("50 ") || l.trim_start().starts_with("inf "))
        .collect();
    assert_eq!(rows.len(), 2, "{stdout}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_reports_unreachable_server_without_panicking() {
    let url = closed_port_url();
    let out = binary()
        .args([
            "--base-url",
            &url,
            "--num-prompts",
            "2",
            "--no-progress",
            "--no-save",
        ])
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("could not connect") && stderr.contains(&url),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");

    // With the model given and no warm-up, the table lists the failures and the exit code says so.
    let out = binary()
        .args(["--base-url", &url, "--model", "m", "--num-warmups", "0"])
        .args(["--num-prompts", "2", "--no-progress", "--no-save"])
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stdout.contains("Failed requests:") && stdout.contains("2 x could not connect"),
        "{stdout}"
    );
    assert!(stderr.contains("all 2 requests failed"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_rejects_bad_arguments_with_usage_hints() {
    for (args, hint) in [
        (vec!["--sweep", "batch=1,2"], "concurrency=1,2,4,8"),
        (vec!["--goodput", "itl:5"], "ttft, tpot, e2el"),
        (
            vec!["--endpoint", "chat", "--prompt-source", "token-ids"],
            "chat endpoint takes text",
        ),
        (vec!["--request-rate", "0"], "must be positive"),
    ] {
        let out = binary()
            .args(&args)
            .arg("--no-progress")
            .output()
            .await
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} should fail");
        assert!(stderr.contains(hint), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}
