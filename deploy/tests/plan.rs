//! `afd plan` end to end: every shipped deployment file parses and plans; the seed's GPT-OSS-20B
//! figures are reproduced within 15% (the two calibrated constants are what their rows fit);
//! a deployment that does not fit exits non-zero and says why.

mod common;

use std::path::Path;

use common::deployments;
use std::process::{Command, Output};

use corsair_ffn::compiler::StoredFormats;
use deploy::deployment::Deployment;
use deploy::plan::load_profiles;
use deploy::plan::seed::{SEED_ROWS, calibrate};
use model::ModelConfig;
use serde_json::Value;

fn afd_plan(file: &Path, extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_afd"))
        .arg("plan")
        .arg(file)
        .args(extra)
        .output()
        .expect("run afd plan")
}

fn plan_json(file: &Path, extra: &[&str]) -> Value {
    let mut args = vec!["--json"];
    args.extend_from_slice(extra);
    let out = afd_plan(file, &args);
    assert!(
        out.status.success(),
        "afd plan {} {extra:?} failed:\n{}",
        file.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("afd plan --json prints JSON")
}

#[test]
fn every_shipped_deployment_parses_and_plans() {
    for file in &common::shipped_deployments() {
        let d = Deployment::load(file).unwrap();
        let plan = plan_json(file, &[]);
        assert_eq!(plan["fits"], true, "{}", file.display());
        let p = &plan["predicted"];
        for key in ["tpot_ms", "step_ms", "output_tokens_per_s"] {
            let v = p[key].as_f64().unwrap_or(f64::NAN);
            assert!(v.is_finite() && v > 0.0, "{}: {key} = {v}", file.display());
        }
        let cards = plan["per_card"].as_array().unwrap();
        assert_eq!(cards.len(), d.cards.count, "{}", file.display());
        for c in cards {
            let need = c["sram_bytes_needed"].as_u64().unwrap();
            let have = c["sram_bytes_available"].as_u64().unwrap();
            assert!(need > 0 && need <= have, "{}: {c}", file.display());
        }
    }
}

#[test]
fn the_seed_figures_are_reproduced_within_15_percent() {
    let mut table = String::new();
    let mut worst: f64 = 0.0;
    for row in &SEED_ROWS {
        let file = deployments().join(row.file);
        let overrides: Vec<String> = row
            .workload
            .map(|(i, o)| {
                vec![
                    "--input-len".into(),
                    i.to_string(),
                    "--output-len".into(),
                    o.to_string(),
                ]
            })
            .unwrap_or_default();
        let args: Vec<&str> = overrides.iter().map(String::as_str).collect();
        let plan = plan_json(&file, &args);
        let key = serde_json::to_value(row.metric).unwrap();
        let got = plan["predicted"][key.as_str().unwrap()].as_f64().unwrap();
        let error = (got - row.figure) / row.figure;
        worst = worst.max(error.abs());
        table += &format!(
            "{}: seed {} afd plan {got:.4} ({:+.1}%)\n",
            row.setup,
            row.figure,
            100.0 * error
        );
    }
    eprintln!("{table}");
    assert!(
        worst <= 0.15,
        "a seed figure is off by more than 15%:\n{table}"
    );
}

#[test]
fn the_calibrated_constants_are_the_fit_on_their_seed_rows() {
    let afd = Deployment::load(&deployments().join(SEED_ROWS[1].file)).unwrap();
    let alone = Deployment::load(&deployments().join(SEED_ROWS[0].file)).unwrap();
    let (text, path) = afd.model_config_text().unwrap();
    let config = ModelConfig::from_json(&text, &path).unwrap();
    let stored = StoredFormats::from_config_json(&text, &config).unwrap();
    let profiles = load_profiles(&afd).unwrap();
    let fit = calibrate(&afd, &alone, &config, &stored, &profiles).unwrap();
    let k = &profiles.device.kernels;
    let close = |a: f64, b: f64| (a - b).abs() <= 0.02 * b.abs();
    assert!(
        close(k.fixed_ns, fit.fixed_ns)
            && close(
                k.mxfp4_moe_bandwidth_efficiency,
                fit.mxfp4_moe_bandwidth_efficiency
            ),
        "the model changed: refit the calibrated constants in planner/profiles/h100.toml and \
         h200.toml (profile {k:?}, fit {fit:?}; `cargo run -p deploy --example plan_sweep`)"
    );
    assert_eq!(profiles.device.calibrated.len(), 2);
}

#[test]
fn a_deployment_that_does_not_fit_exits_non_zero_and_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("two-cards.toml");
    std::fs::write(
        &file,
        "[model]\nshape = \"gpt-oss-20b\"\n[cards]\ncount = 2\nallow_spill = false\n",
    )
    .unwrap();
    let out = afd_plan(&file, &[]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("does not fit") && stderr.contains("SRAM"),
        "{stderr}"
    );
    // The same file fits once spilling is allowed.
    assert!(afd_plan(&file, &["--allow-spill", "true"]).status.success());

    // The attention device: 64 sequences of 128K tokens do not fit in 80 GB.
    let out = afd_plan(
        &deployments().join("gpt-oss-20b-1xh100-8cards.toml"),
        &[
            "--max-num-seqs",
            "64",
            "--max-model-len",
            "131072",
            "--batch",
            "1",
        ],
    );
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("attention.max_num_seqs"), "{stderr}");
}

#[test]
fn flags_override_the_file() {
    let file = deployments().join("gpt-oss-20b-1xh100-8cards.toml");
    let eight = plan_json(&file, &[]);
    let sixteen = plan_json(&file, &["--cards", "16"]);
    assert_eq!(eight["per_card"].as_array().unwrap().len(), 8);
    assert_eq!(sixteen["per_card"].as_array().unwrap().len(), 16);
    let need = |p: &Value| p["per_card"][0]["sram_bytes_needed"].as_u64().unwrap();
    assert!(need(&sixteen) < need(&eight));
    let alone = plan_json(&file, &["--cards", "0"]);
    assert!(
        alone["predicted"]["tpot_ms"].as_f64().unwrap()
            > eight["predicted"]["tpot_ms"].as_f64().unwrap()
    );
}

/// A routing record (`afd-routing-counts/1`) of GPT-OSS-20B's shape (24 layers of 32 experts,
/// top 4) whose every layer sends most tokens to experts 0 and 1.
fn skewed_record(dir: &Path, layers: usize) -> std::path::PathBuf {
    let counts: Vec<Vec<u64>> = (0..layers)
        .map(|_| (0..32).map(|e| if e < 2 { 1000 } else { 20 }).collect())
        .collect();
    let record = serde_json::json!({
        "format": "afd-routing-counts/1",
        "layers": layers, "experts": 32, "top_k": 4, "window_steps": 256,
        "windows": [{"first_step": 0, "steps": 256, "tokens": 660, "counts": counts}],
    });
    let path = dir.join(format!("routing-{layers}.json"));
    std::fs::write(&path, record.to_string()).unwrap();
    path
}

#[test]
fn a_measured_load_places_the_hot_experts_on_every_card_and_shortens_the_modeled_step() {
    let dir = tempfile::tempdir().unwrap();
    let file = deployments().join("gpt-oss-20b-64k-16cards.toml");
    let record = skewed_record(dir.path(), 24);
    let record_arg = record.to_str().unwrap();
    // 16 tokens a step: each hot expert's rows still fit one pass over its weights, so its
    // copies spread the experts over the cards, not one expert's rows (docs/PLANNING.md).
    let args = [
        "--expert-load",
        record_arg,
        "--num-redundant-experts",
        "30",
        "--batch",
        "16",
        "--max-num-seqs",
        "16",
    ];
    let plan = plan_json(&file, &args);
    let p = &plan["placement_by_load"];
    assert_eq!(p["redundant_experts"], 30, "{p}");
    let layers = |key: &str| -> Vec<f64> {
        let xs = p[key].as_array().unwrap_or_else(|| panic!("{key}: {p}"));
        xs.iter().map(|x| x.as_f64().unwrap()).collect()
    };
    let (before, after) = (layers("before"), layers("after"));
    assert_eq!((before.len(), after.len()), (24, 24));
    // Both hot experts sit on card 0 (and, replicated, card 1) by default: those two take most
    // of every layer's tokens. 30 copies give each hot expert a copy on every card.
    assert!(before.iter().all(|&b| b < 0.2), "{before:?}");
    assert!(after.iter().all(|&a| a > 0.8), "{after:?}");
    assert_eq!(p["fits"], true, "{p}");
    let ms = |key: &str| p[key].as_f64().unwrap_or_else(|| panic!("{key}: {p}"));
    assert!(
        ms("cards_step_ms_after") < ms("cards_step_ms_before"),
        "{p}"
    );
    // 64 tokens a step: the hot experts are compute bound, and their rows are split over
    // their copies within the step (with one copy serving all of them, as before the split
    // existed, the by-load step was within 1% of the contiguous one).
    let mut at64 = args.to_vec();
    at64[5] = "64";
    at64[7] = "64";
    // 64 sequences of 64K overflow the H100.
    at64.extend([
        "--max-model-len",
        "8192",
        "--input-len",
        "1024",
        "--output-len",
        "0",
    ]);
    let p64 = plan_json(&file, &at64)["placement_by_load"].clone();
    let ms64 = |key: &str| p64[key].as_f64().unwrap_or_else(|| panic!("{key}: {p64}"));
    assert!(
        ms64("cards_step_ms_after") < 0.9 * ms64("cards_step_ms_before"),
        "{p64}"
    );
    // The report says the same in words.
    let out = afd_plan(&file, &args);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("Placement by load"), "{text}");
    assert!(
        text.contains("30 extra copies per MoE layer on 16 cards"),
        "{text}"
    );

    // A record of another model is refused, saying what to do.
    let other = skewed_record(dir.path(), 2);
    let out = afd_plan(&file, &["--expert-load", other.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("record the routing of the same model"),
        "{err}"
    );
}
