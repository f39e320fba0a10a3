//! What several of `deploy`'s integration tests share: the `afd` binary, a process guard,
//! free ports, the committed fixtures, and `afd generate` as the reference for served tokens.
//! Each test crate uses a part of it.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// The `afd` binary under test.
pub const AFD: &str = env!("CARGO_BIN_EXE_afd");

/// Kills its process when dropped, so no test leaves one behind.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs `afd ARGS...` to the end and returns its standard output; fails the test with the
/// command's standard error when it does not succeed.
pub fn afd_ok(configure: impl FnOnce(&mut Command) -> &mut Command) -> Vec<u8> {
    let mut cmd = Command::new(AFD);
    configure(&mut cmd);
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// A minimal HTTP/1.1 exchange with `address` (`Connection: close`): status and body, or
/// `None` when nothing (or no complete head) came back.
pub fn http(
    address: &str,
    method: &str,
    path: &str,
    body: Option<&serde_json::Value>,
) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(address).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(120))).ok()?;
    let payload = body.map(|b| b.to_string()).unwrap_or_default();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{payload}",
        payload.len()
    );
    s.write_all(req.as_bytes()).ok()?;
    let mut raw = String::new();
    s.read_to_string(&mut raw).ok()?;
    let (head, body) = raw.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((status, body.to_string()))
}

/// Waits until `GET /health` at `address` answers 200 (at most `within`).
pub fn wait_healthy(address: &str, within: Duration) {
    let deadline = Instant::now() + within;
    while http(address, "GET", "/health", None).map(|(s, _)| s) != Some(200) {
        assert!(
            Instant::now() < deadline,
            "{address} did not become healthy"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A loopback port free right now.
pub fn free_port() -> u16 {
    free_ports(1)[0]
}

/// `n` distinct free TCP ports on 127.0.0.1. They are held open until all are chosen: ports
/// chosen one at a time, each closed before the next, may repeat (a run once gave the
/// frontend the port it had just given a card).
pub fn free_ports(n: usize) -> Vec<u16> {
    let held: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    held.iter()
        .map(|l| l.local_addr().unwrap().port())
        .collect()
}

/// A committed fixture checkpoint.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures")
        .join(name)
}

/// Every committed fixture checkpoint (the folders with an `expected.json`), sorted.
pub fn fixtures() -> Vec<PathBuf> {
    let dirs = model::test_support::fixture_dirs().unwrap();
    assert!(
        dirs.len() >= 6,
        "the committed fixtures under {}",
        model::test_support::fixtures_root().display()
    );
    dirs
}

/// The folder of the shipped deployment files.
pub fn deployments() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deployments")
}

/// Every shipped deployment file, sorted.
pub fn shipped_deployments() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(deployments())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    files.sort();
    assert!(files.len() >= 5, "{files:?}");
    files
}

/// The tiny deployment file.
pub fn tiny() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deployments/tiny.toml")
}

/// A fixture's prompts and transformers' greedy continuations.
pub fn expected(dir: &Path) -> Vec<(Vec<u32>, Vec<u32>)> {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let ids = |x: &serde_json::Value| -> Vec<u32> {
        x.as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect()
    };
    v["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (ids(&p["ids"]), ids(&p["output_ids"])))
        .collect()
}

/// Greedy requests for a fixture's cases, each as long as transformers' continuation.
pub fn greedy_requests(cases: &[(Vec<u32>, Vec<u32>)]) -> Vec<model::generate::GenerationRequest> {
    cases
        .iter()
        .map(|(p, out)| model::generate::GenerationRequest {
            prompt: p.clone(),
            max_tokens: out.len(),
            sampling: model::sampling::SamplingParams::greedy(),
            stop_token_ids: vec![],
        })
        .collect()
}

/// The tokens `afd generate` gives `prompt` alone on `cards` cards (greedy, `ignore_eos`).
pub fn generate_alone(
    model: &Path,
    prompt: &[impl ToString],
    cards: usize,
    max_tokens: usize,
) -> Vec<u64> {
    let ids: Vec<String> = prompt.iter().map(ToString::to_string).collect();
    let stdout = afd_ok(|c| {
        c.arg("generate")
            .arg("--model")
            .arg(model)
            .args(["--ignore-eos", "--cards", &cards.to_string()])
            .args(["--max-tokens", &max_tokens.to_string()])
            .args(["--prompt-ids", &ids.join(",")])
    });
    let v: serde_json::Value = serde_json::from_slice(&stdout).unwrap();
    v["output_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

/// A one-node cluster of `dir`'s model on `cards` cards over the in-process transport, the
/// node on `device`, one copy of each expert (whatever the host's memory: `auto` would decide by
/// it); the cluster keeps the cards alive.
pub fn embedded_node(
    dir: &Path,
    cards: usize,
    device: gpu_attention::AttentionDevice,
) -> (
    deploy::cluster::EmbeddedCluster,
    gpu_attention::DisaggregatedNode,
) {
    let mut config = deploy::cluster::ClusterConfig::new(dir, cards);
    config.transport = deploy::cluster::TransportKind::Inproc;
    config.node.device = device;
    config.node.kv.memory_bytes = 8 << 20;
    config.replicate_experts = planner::ReplicateExperts::Never;
    let mut cluster = deploy::cluster::EmbeddedCluster::start(&config, &mut |_| {}).unwrap();
    let node = cluster.take_nodes().remove(0);
    assert_eq!(node.device(), device);
    (cluster, node)
}
