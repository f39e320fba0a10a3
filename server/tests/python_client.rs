//! The official `openai` Python package against an in-process server (fake attention node).
//! Skips, saying so, when python3 or the package is missing; `.ci/run` installs it.

mod common;

use std::path::Path;
use std::process::Stdio;

use common::*;

fn python() -> String {
    std::env::var("AFD_PYTHON").unwrap_or_else(|_| "python3".into())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_python_client_works_against_the_server() {
    let python = python();
    let probe = tokio::process::Command::new(&python)
        .args(["-c", "import openai"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .await;
    match probe {
        Ok(s) if s.success() => {}
        _ => {
            test_skips::skipped(&format!(
                "`{python} -c 'import openai'` failed; install the client with \
                 `pip install openai` (or set AFD_PYTHON to a python that has it)"
            ));
            return;
        }
    }
    let s = start().await;
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/test_openai_client.py");
    let out = tokio::process::Command::new(&python)
        .arg(&script)
        .env("AFD_BASE_URL", format!("http://{}", s.addr))
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "python client checks failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("all checks passed"));
}
