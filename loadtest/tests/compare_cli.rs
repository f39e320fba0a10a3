//! `afd-loadtest compare` end to end: made-up result files in, the table, JSON and plots out;
//! a wrong baseline is a clear error.

use std::path::Path;
use std::process::Command;

fn binary() -> Command {
    Command::new(env!("CARGO_BIN_EXE_afd-loadtest"))
}

fn write_result(dir: &Path, name: &str, concurrency: usize, tpot: f64, tps: f64) {
    std::fs::create_dir_all(dir).unwrap();
    let json = serde_json::json!({
        "label": "openai",
        "max_concurrency": concurrency,
        "completed": 4,
        "failed": 0,
        "output_throughput": tps,
        "median_tpot_ms": tpot,
        "p99_tpot_ms": tpot * 2.0,
        "median_ttft_ms": 50.0,
        "p99_ttft_ms": 80.0,
    });
    std::fs::write(dir.join(name), json.to_string()).unwrap();
}

#[test]
fn compare_writes_table_json_and_plots() {
    let dir = tempfile::tempdir().unwrap();
    let mono = dir.path().join("mono");
    let afd = dir.path().join("afd");
    write_result(&mono, "c1.json", 1, 10.0, 100.0);
    write_result(&mono, "c4.json", 4, 20.0, 200.0);
    write_result(&afd, "c1.json", 1, 40.0, 25.0);
    write_result(&afd, "c4.json", 4, 30.0, 150.0);
    let out = dir.path().join("cmp");
    let run = binary()
        .arg("compare")
        .arg(format!("mono={}", mono.display()))
        .arg(format!("afd-2cards={}", afd.display()))
        .args(["--title", "cli test", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    // Throughput ratios 0.25 and 0.75; TPOT ratios 4 and 1.5.
    assert!(
        stdout.contains("| afd-2cards | 0.25x | 0.75x |"),
        "{stdout}"
    );
    assert!(
        stdout.contains("| afd-2cards | 4.00x | 1.50x |"),
        "{stdout}"
    );
    let md = std::fs::read_to_string(out.join("comparison.md")).unwrap();
    assert_eq!(md, stdout);
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("comparison.json")).unwrap())
            .unwrap();
    assert_eq!(json["baseline"], "mono");
    assert_eq!(json["variants"][1]["points"][1]["throughput_ratio"], 0.75);
    for plot in ["tpot.svg", "throughput.svg", "ttft.svg"] {
        assert!(out.join(plot).is_file(), "{plot} missing");
    }

    let bad = binary()
        .arg("compare")
        .arg(format!("mono={}", mono.display()))
        .args(["--baseline", "gpu", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(!bad.status.success());
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(
        stderr.contains("'gpu'") && stderr.contains("--baseline"),
        "{stderr}"
    );
}
