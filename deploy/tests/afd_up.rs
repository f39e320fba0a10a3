//! `afd up` on the tiny deployment: every process starts and becomes healthy, the frontend
//! serves a completion whose tokens equal `afd generate`'s, the cards answer the standard gRPC
//! health check (what Kubernetes probes), and a SIGTERM stops everything with no process left
//! behind; a card that dies is started again and the deployment serves on with nothing else
//! restarted (with `--no-restart`, `afd up` stops the rest and exits non-zero naming it).

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

mod common;

use common::{AFD, generate_alone, tiny};

/// Whether process `pid` still exists (and is not a zombie waiting to be reaped).
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesized command name.
        Ok(stat) => stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| !rest.starts_with('Z')),
        Err(_) => false,
    }
}

fn send(pid: u32, signal: libc::c_int) {
    // SAFETY: kill(2) has no memory effects.
    unsafe {
        libc::kill(pid as libc::pid_t, signal);
    }
}

/// A running `afd up`, its stderr lines, and the processes it reported starting. Dropping it
/// kills `afd up` and every process it started, so a failing test leaves nothing behind: not
/// even the certificates `afd up` makes in its temporary folder, which a killed `afd up` cannot
/// remove (its TMPDIR is `_scratch`, removed after the kill).
struct Up {
    child: Child,
    _scratch: tempfile::TempDir,
    lines: mpsc::Receiver<String>,
    log: Vec<String>,
    pids: Vec<(String, u32)>,
}

impl Up {
    fn start(file: &Path) -> Up {
        Up::start_with(file, &[])
    }

    fn start_with(file: &Path, flags: &[&str]) -> Up {
        let scratch = tempfile::tempdir().unwrap();
        let mut child = Command::new(AFD)
            .env("TMPDIR", scratch.path())
            .arg("up")
            .arg(file)
            .arg("--free-ports")
            .args(flags)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Up {
            child,
            _scratch: scratch,
            lines,
            log: Vec::new(),
            pids: Vec::new(),
        }
    }

    /// Reads stderr until a line contains `needle`; returns that line.
    fn wait_for(&mut self, needle: &str, within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    // "[up] started card-0 (pid 123): afd card ..."
                    if let Some(rest) = line.strip_prefix("[up] started ")
                        && let Some((name, rest)) = rest.split_once(" (pid ")
                        && let Some((pid, _)) = rest.split_once(')')
                    {
                        self.pids.push((name.to_string(), pid.parse().unwrap()));
                    }
                    self.log.push(line.clone());
                    if line.contains(needle) {
                        return line;
                    }
                }
                Err(_) => panic!(
                    "no line with {needle:?} within {within:?}; afd up said:\n{}",
                    self.log.join("\n")
                ),
            }
        }
    }

    fn pid(&self, name: &str) -> u32 {
        self.pids.iter().find(|(n, _)| n == name).unwrap().1
    }

    /// Waits for `afd up` to exit, reading the rest of its output.
    fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            while let Ok(line) = self.lines.try_recv() {
                self.log.push(line);
            }
            if let Some(status) = self.child.try_wait().unwrap() {
                // The reader thread ends at EOF; collect what is left.
                while let Ok(line) = self.lines.recv_timeout(Duration::from_secs(2)) {
                    self.log.push(line);
                }
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "afd up did not exit within {within:?}:\n{}",
                self.log.join("\n")
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        for (_, pid) in &self.pids {
            if alive(*pid) {
                send(*pid, libc::SIGKILL);
            }
        }
    }
}

/// An HTTP exchange that must get an answer.
fn http(address: &str, method: &str, path: &str, body: Option<&Value>) -> (u16, String) {
    common::http(address, method, path, body).expect("an HTTP answer")
}

/// The address after `--listen` in a "[up] started ..." line of `name`.
fn listen_address(up: &Up, name: &str) -> String {
    let line = up
        .log
        .iter()
        .find(|l| l.starts_with(&format!("[up] started {name} ")))
        .unwrap();
    let words: Vec<&str> = line.split_whitespace().collect();
    let i = words.iter().position(|w| *w == "--listen").unwrap();
    words[i + 1].to_string()
}

/// The standard gRPC health check (grpc.health.v1) of node `server` at `address`, over the
/// control plane's TLS as the frontend of afd up's certificates; without TLS it is refused.
fn grpc_health_serving(up: &Up, address: &str, server: &str) -> bool {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;
    let certs = up
        .log
        .iter()
        .find_map(|l| {
            l.split_once("TLS material in ")
                .map(|(_, d)| d.trim().to_owned())
        })
        .expect("afd up names its certificate folder");
    let identity = jetstream::NodeIdentity::read_pem(Path::new(&certs), "frontend").unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let url = format!("http://{address}");
        let request = || HealthCheckRequest {
            service: String::new(),
        };
        let plain = tonic::transport::Endpoint::from_shared(url.clone())
            .unwrap()
            .connect()
            .await;
        if let Ok(channel) = plain {
            assert!(HealthClient::new(channel).check(request()).await.is_err());
        }
        let channel = deploy::control_plane::connect(&url, server, &identity)
            .await
            .unwrap();
        let reply = HealthClient::new(channel)
            .check(request())
            .await
            .unwrap()
            .into_inner();
        reply.status == tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    })
}

#[test]
fn afd_up_serves_a_completion_and_stops_every_process() {
    let deployment = deploy::deployment::Deployment::load(&tiny()).unwrap();
    let mut up = Up::start(&tiny());
    let ready = up.wait_for("[up] ready", Duration::from_secs(300));
    let url = ready
        .split_whitespace()
        .find(|w| w.starts_with("http://"))
        .unwrap();
    let address = url.trim_start_matches("http://").to_string();
    let expected_processes = deployment.cards.count + deployment.attention.nodes + 1;
    assert_eq!(up.pids.len(), expected_processes, "{:?}", up.pids);
    assert!(up.pids.iter().all(|(_, pid)| alive(*pid)));

    // Served through the frontend-only `afd serve` over the attention process: the same
    // greedy tokens as the whole pipeline in one process.
    let (status, models) = http(&address, "GET", "/v1/models", None);
    assert_eq!(status, 200, "{models}");
    let model_id = serde_json::from_str::<Value>(&models).unwrap()["data"][0]["id"].clone();
    let prompt: Vec<u64> = vec![12, 345, 67, 890, 11, 23];
    let body = json!({"model": model_id, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                      "ignore_eos": true, "return_token_ids": true});
    let (status, answer) = http(&address, "POST", "/v1/completions", Some(&body));
    assert_eq!(status, 200, "{answer}");
    let v: Value = serde_json::from_str(&answer).unwrap();
    let got: Vec<u64> = v["choices"][0]["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    let model = deployment.checkpoint().unwrap();
    assert_eq!(
        got,
        generate_alone(&model, &prompt, deployment.cards.count, 8)
    );
    assert!(grpc_health_serving(
        &up,
        &listen_address(&up, "card-0"),
        "card-0"
    ));
    assert!(grpc_health_serving(
        &up,
        &listen_address(&up, "attention-0"),
        "attn-0"
    ));

    send(up.child.id(), libc::SIGTERM);
    let status = up.wait_exit(Duration::from_secs(60));
    assert!(status.success(), "{status}:\n{}", up.log.join("\n"));
    for (name, pid) in &up.pids {
        assert!(!alive(*pid), "{name} (pid {pid}) is still running");
    }
    assert!(
        up.log.iter().any(|l| l.contains("every process stopped")),
        "{}",
        up.log.join("\n")
    );
    // Each role drained and exited by itself on the signal, none was killed.
    let log = up.log.join("\n");
    assert!(!log.contains("did not stop within"), "{log}");
    for (name, _) in &up.pids {
        assert!(
            up.log
                .iter()
                .any(|l| l.contains(&format!("[up] {name} (pid"))
                    && l.contains("stopped: exit status: 0")),
            "{name} did not exit 0:\n{log}"
        );
    }
}

#[test]
fn afd_up_starts_a_card_that_died_again_and_the_deployment_serves_on() {
    let mut up = Up::start(&tiny());
    let ready = up.wait_for("[up] ready", Duration::from_secs(300));
    let address = ready
        .split_whitespace()
        .find(|w| w.starts_with("http://"))
        .unwrap()
        .trim_start_matches("http://")
        .to_string();
    let others: Vec<(String, u32)> = up
        .pids
        .iter()
        .filter(|(n, _)| n != "card-1")
        .cloned()
        .collect();
    let victim = up.pid("card-1");
    send(victim, libc::SIGKILL);
    let line = up.wait_for("card-1 started again", Duration::from_secs(60));
    assert!(line.contains("restart 1"), "{line}");
    up.wait_for("card-1 is healthy again", Duration::from_secs(120));
    let log = up.log.join("\n");
    assert!(
        log.contains(&format!("card-1 (pid {victim}) exited on its own")),
        "{log}"
    );
    assert!(log.contains("SIGKILL"), "{log}");
    // The attention node takes the card back by itself; nothing else was restarted. The
    // supervisor's "healthy again" only says the card process answers: wait until the node
    // has seen the card go and come back with its shard loaded (a request before that is
    // answered 503, "rejoining", and /health can still show the node's view from before the
    // card died).
    let deadline = Instant::now() + Duration::from_secs(60);
    while !card_rejoined(&http(&address, "GET", "/metrics", None).1, 1) {
        assert!(Instant::now() < deadline, "card 1 did not rejoin:\n{log}");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(http(&address, "GET", "/health", None).0, 200, "{log}");
    let (status, models) = http(&address, "GET", "/v1/models", None);
    assert_eq!(status, 200, "{models}");
    let model_id = serde_json::from_str::<Value>(&models).unwrap()["data"][0]["id"].clone();
    let body = json!({"model": model_id, "prompt": [12, 345, 67], "max_tokens": 4,
                      "temperature": 0, "ignore_eos": true});
    let (status, answer) = http(&address, "POST", "/v1/completions", Some(&body));
    assert_eq!(status, 200, "{answer}\n{}", up.log.join("\n"));
    for (name, pid) in &others {
        assert!(alive(*pid), "{name} (pid {pid}) was restarted or died");
    }
}

/// Whether the metrics say attention node 0 has card `card` up again after a rejoin.
fn card_rejoined(metrics: &str, card: usize) -> bool {
    let label = format!("card=\"{card}\"");
    let value = |name: &str| {
        metrics
            .lines()
            .find(|l| l.starts_with(name) && l.contains(&label) && l.contains("node=\"0\""))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
    };
    value("afd_card_rejoins_total{").is_some_and(|n| n >= 1.0) && value("afd_card_up{") == Some(1.0)
}

#[test]
fn afd_up_no_restart_stops_everything_and_fails_naming_a_card_that_died() {
    let mut up = Up::start_with(&tiny(), &["--no-restart"]);
    up.wait_for("[up] ready", Duration::from_secs(300));
    let victim = up.pid("card-1");
    send(victim, libc::SIGKILL);
    let status = up.wait_exit(Duration::from_secs(120));
    assert!(!status.success(), "afd up should fail when a card dies");
    let log = up.log.join("\n");
    assert!(
        log.contains(&format!("card-1 (pid {victim}) exited on its own")),
        "{log}"
    );
    for (name, pid) in &up.pids {
        assert!(!alive(*pid), "{name} (pid {pid}) is still running");
    }
}

#[test]
fn a_killed_afd_up_leaves_no_private_key_behind() {
    let mut up = Up::start(&tiny());
    let line = up.wait_for("TLS material in ", Duration::from_secs(120));
    let certs = std::path::PathBuf::from(line.split_once("TLS material in ").unwrap().1.trim());
    assert!(
        std::fs::read_dir(&certs).unwrap().any(|e| e
            .unwrap()
            .path()
            .to_string_lossy()
            .contains("key")),
        "the folder held keys while afd up ran: {}",
        certs.display()
    );
    // SIGKILL: the launcher runs no code of its own.
    up.child.kill().unwrap();
    up.child.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while certs.exists() {
        assert!(
            Instant::now() < deadline,
            "{} outlived the killed afd up by 10 s",
            certs.display()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
