//! The official `openai` Python package against an in-process server (fake attention node).
//! Skips, saying so, when python3 or the package is missing; `.ci/run` installs it.

mod common;

use std::path::Path;
use std::process::Stdio;

use common::*;

fn python() -> String {
    std::env::var("AFD_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// Whether `python` has the client; says so (as a counted skip) when it does not.
async fn has_openai(python: &str) -> bool {
    let probe = tokio::process::Command::new(python)
        .args(["-c", "import openai"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .await;
    if matches!(probe, Ok(s) if s.success()) {
        return true;
    }
    test_skips::skipped(&format!(
        "`{python} -c 'import openai'` failed; install the client with \
         `pip install openai` (or set AFD_PYTHON to a python that has it)"
    ));
    false
}

/// Runs `tests/python/SCRIPT` with `env`; asserts it passed every check.
async fn run_script(python: &str, script: &str, env: &[(&str, String)]) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/python")
        .join(script);
    let mut command = tokio::process::Command::new(python);
    command.arg(&script);
    for (k, v) in env {
        command.env(k, v);
    }
    let out = command.output().await.unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "python client checks failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("all checks passed"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_python_client_works_against_the_server() {
    let python = python();
    if !has_openai(&python).await {
        return;
    }
    let s = start().await;
    run_script(
        &python,
        "test_openai_client.py",
        &[("AFD_BASE_URL", format!("http://{}", s.addr))],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_python_client_calls_tools_through_the_responses_api() {
    let python = python();
    if !has_openai(&python).await {
        return;
    }
    let tool = scripted(
        model::Family::GptOss,
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Paris\"}<|call|>",
        true,
    )
    .await;
    let answer = scripted(
        model::Family::GptOss,
        "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Four.<|return|>",
        true,
    )
    .await;
    run_script(
        &python,
        "test_openai_responses.py",
        &[
            ("AFD_TOOL_URL", format!("http://{}", tool.addr)),
            ("AFD_ANSWER_URL", format!("http://{}", answer.addr)),
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_python_client_parses_structured_outputs() {
    let python = python();
    if !has_openai(&python).await {
        return;
    }
    let s = scripted(
        model::Family::GptOss,
        "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Sunny.<|return|>",
        false,
    )
    .await;
    run_script(
        &python,
        "test_openai_structured.py",
        &[("AFD_BASE_URL", format!("http://{}", s.addr))],
    )
    .await;
}
