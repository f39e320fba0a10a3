//! `afd compile` end to end: GPT-OSS-20B's shape (config only) fits 8 cards in MXFP4, fails on
//! 4 with a clear message and a non-zero exit, compiles on 4 with `--allow-spill` and shows the
//! LPDDR cost; every fixture passes the sanitizer.

use std::path::Path;
use std::process::{Command, Output};

fn afd(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_afd"))
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("afd runs")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn gpt_oss_20b_fits_eight_cards_not_four_unless_spilling() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("gpt-oss-20b");
    let m = model.to_str().unwrap();
    let synth = afd(&[
        "synth",
        "--family",
        "gpt-oss",
        "--preset",
        "gpt-oss-20b",
        "--config-only",
        "--out",
        m,
    ]);
    assert!(synth.status.success(), "{}", text(&synth));

    let eight = afd(&["compile", "--model", m, "--cards", "8", "--format", "mxfp4"]);
    let out = text(&eight);
    assert!(eight.status.success(), "{out}");
    assert_eq!(out.matches("sanitizer: clean").count(), 8, "{out}");
    assert_eq!(out.matches("spilled to LPDDR: nothing").count(), 8, "{out}");
    assert!(
        out.contains("expert weights") && out.contains("SRAM:"),
        "{out}"
    );

    let four = afd(&["compile", "--model", m, "--cards", "4", "--format", "mxfp4"]);
    let out = text(&four);
    assert!(!four.status.success(), "{out}");
    assert!(
        out.contains("does not fit") && out.contains("--allow-spill") && out.contains("--cards 6"),
        "{out}"
    );

    let spill = afd(&[
        "compile",
        "--model",
        m,
        "--cards",
        "4",
        "--format",
        "mxfp4",
        "--allow-spill",
    ]);
    let out = text(&spill);
    assert!(spill.status.success(), "{out}");
    assert_eq!(out.matches("spilled to LPDDR: ").count(), 4, "{out}");
    assert!(!out.contains("spilled to LPDDR: nothing"), "{out}");

    let json = afd(&[
        "compile",
        "--model",
        m,
        "--cards",
        "4",
        "--format",
        "mxfp4",
        "--allow-spill",
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(v["fits"], true);
    let lpddr = v["per_card"][0]["batch_one"]["layers"][0]["lpddr_seconds"]
        .as_f64()
        .unwrap();
    assert!(lpddr > 0.0, "spilled layers stream from LPDDR: {lpddr}");
}

#[test]
fn every_fixture_compiles_and_passes_the_sanitizer() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures");
    let mut seen = 0;
    for entry in std::fs::read_dir(root).unwrap() {
        let dir = entry.unwrap().path();
        if !dir.join("config.json").exists() {
            continue;
        }
        for format in ["as-stored", "mxfp4"] {
            let o = afd(&[
                "compile",
                "--model",
                dir.to_str().unwrap(),
                "--cards",
                "3",
                "--format",
                format,
            ]);
            let out = text(&o);
            assert!(o.status.success(), "{}: {out}", dir.display());
            assert_eq!(out.matches("sanitizer: clean").count(), 3, "{out}");
        }
        seen += 1;
    }
    assert!(seen >= 6);
}
