//! lm-evaluation-harness against `afd serve`: its `local-completions` model runs a small
//! loglikelihood task (tests/lm_eval/data.jsonl) through the server, scoring each continuation
//! from `echo` + `logprobs` and tokenizing through `/tokenize` and `/tokenizer_info`, and every
//! score equals what lm-eval's `hf` model gave on the same checkpoint in transformers
//! (tests/lm_eval/reference/, made by tests/lm_eval/loglikelihood.py --hf): each request's
//! loglikelihood to 1e-4, whether it was greedy exactly, and the task's metrics.
//!
//! On three families with the LM head sharded over two cards, and on one with the whole model
//! on the node (`--reference`). Skips, saying so, when lm-eval is not installed (`.ci/run`
//! installs `lm-eval[api]` into its venv; AFD_PYTHON names the python).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;

mod common;

use common::{AFD, Proc, fixture, free_port, wait_healthy};

fn python() -> String {
    std::env::var("AFD_PYTHON").unwrap_or_else(|_| "python3".into())
}

fn here() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/lm_eval")
}

fn read(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Serves `name` with `args`, runs the task through it and returns lm-eval's scores.
fn scores_through_afd(name: &str, args: &[&str], out: &Path) -> Value {
    let port = free_port();
    let _serve = Proc(
        Command::new(AFD)
            .arg("serve")
            .arg("--model")
            .arg(fixture(name))
            .args(args)
            .args([
                "--port",
                &port.to_string(),
                "--served-model-name",
                "fixture",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let address = format!("127.0.0.1:{port}");
    wait_healthy(&address, Duration::from_secs(300));
    let run = Command::new(python())
        .arg(here().join("loglikelihood.py"))
        .args(["--server", &format!("http://{address}")])
        .arg("--out")
        .arg(out)
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "lm-eval against afd serve ({name} {args:?}) failed:\n{}\n{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    read(out)
}

fn compare(what: &str, got: &Value, want: &Value) {
    let (g, w) = (
        got["scores"].as_array().unwrap(),
        want["scores"].as_array().unwrap(),
    );
    assert_eq!(g.len(), w.len(), "{what}: requests scored");
    assert!(g.len() >= 10, "{what}: the whole task");
    for (g, w) in g.iter().zip(w) {
        let doc = &w["doc_id"];
        assert_eq!(g["doc_id"], *doc);
        let (a, b) = (
            g["loglikelihood"].as_f64().unwrap(),
            w["loglikelihood"].as_f64().unwrap(),
        );
        assert!(
            (a - b).abs() < 1e-4,
            "{what}, doc {doc} ({:?}): afd {a} vs transformers {b}",
            w["continuation"]
        );
        assert_eq!(g["is_greedy"], w["is_greedy"], "{what}, doc {doc}");
    }
    let acc = |v: &Value| v["metrics"]["acc"].as_f64().unwrap();
    assert_eq!(acc(got), acc(want), "{what}: accuracy");
    // Perplexity is exp(-mean loglikelihood): huge for random weights, so relative.
    let ppl = |v: &Value| v["metrics"]["perplexity"].as_f64().unwrap();
    assert!(
        (ppl(got) / ppl(want) - 1.0).abs() < 1e-4,
        "{what}: perplexity {} vs {}",
        ppl(got),
        ppl(want)
    );
}

#[test]
fn lm_eval_loglikelihood_through_afd_serve_matches_transformers() {
    let probe = Command::new(python())
        .args(["-c", "import lm_eval, requests, aiohttp, tenacity"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    if !matches!(probe, Ok(s) if s.success()) {
        test_skips::skipped(&format!(
            "`{} -c 'import lm_eval'` failed; install it with `pip install 'lm-eval[api]'` \
             (or set AFD_PYTHON to a python that has it)",
            python()
        ));
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    for (name, args) in [
        ("gpt-oss-mxfp4", &["--cards", "2"][..]),
        ("mixtral", &["--cards", "2"][..]),
        ("qwen3-moe", &["--cards", "2"][..]),
        ("mixtral", &["--reference"][..]),
    ] {
        let what = format!("{name} {}", args.join(" "));
        let got = scores_through_afd(name, args, &dir.path().join(format!("{name}.json")));
        let want = read(&here().join("reference").join(format!("{name}.json")));
        assert_eq!(want["model"], "hf", "the reference is transformers'");
        compare(&what, &got, &want);
    }
}
