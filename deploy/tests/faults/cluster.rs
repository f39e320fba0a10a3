//! A multi-process deployment for fault tests: `afd card` x N, `afd attention`, `afd frontend`,
//! each its own process with its log in a file, started the way docs/UP.md shows; cards can be
//! killed, stopped, resumed and started again with the identical command.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::common::{AFD, Proc, afd_ok, free_ports};

/// Where the cards live on the network.
#[derive(Debug, Clone)]
pub struct CardNet {
    /// The cards' IP (their control and data planes bind it).
    pub card_ip: String,
    /// The attention node's IP towards the cards (its data plane binds it).
    pub node_ip: String,
    /// Prefix for a card's command (`ip netns exec NS`), empty for this namespace.
    pub wrap: Vec<String>,
}

impl Default for CardNet {
    fn default() -> Self {
        CardNet {
            card_ip: "127.0.0.1".into(),
            node_ip: "127.0.0.1".into(),
            wrap: Vec::new(),
        }
    }
}

/// How the deployment is made.
#[derive(Debug, Clone)]
pub struct Options {
    /// Checkpoint.
    pub model: PathBuf,
    /// Cards.
    pub cards: usize,
    /// Replicate every expert on a second card (`[cards] replicas`); otherwise one copy
    /// each (`replicate_experts = false`, not the size-dependent default).
    pub replicate_all: bool,
    /// Experts per MoE layer (for the replica list).
    pub experts: usize,
    /// The attention node's reply timeout (s): long, so that fast failure is told apart.
    pub reply_timeout: f64,
    /// Network placement of the cards.
    pub net: CardNet,
}

/// The running deployment.
pub struct Cluster {
    pub dir: tempfile::TempDir,
    opts: Options,
    card_ports: Vec<u16>,
    pub cards: Vec<Option<Proc>>,
    pub attention: Proc,
    pub frontend: Proc,
    /// The frontend's HTTP port.
    pub http: u16,
}

fn log_file(dir: &Path, name: &str) -> std::fs::File {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(format!("{name}.log")))
        .unwrap()
}

impl Cluster {
    pub fn start(opts: Options) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let mut nodes = vec!["attn-0".to_owned(), "frontend".to_owned()];
        nodes.extend((0..opts.cards).map(|i| format!("card-{i}")));
        afd_ok(|c| {
            c.args(["certs", "--out"])
                .arg(dir.path().join("certs"))
                .args(["--nodes", &nodes.join(",")])
        });
        let replicas: Vec<String> = if opts.replicate_all {
            (0..opts.experts)
                .map(|e| format!("{{ expert = {e} }}"))
                .collect()
        } else {
            Vec::new()
        };
        let file = dir.path().join("deployment.toml");
        std::fs::write(
            &file,
            format!(
                "[model]\npath = {:?}\n[cards]\ncount = {}\nreplicas = [{}]\n\
                 replicate_experts = false\n[attention]\n\
                 reply_timeout_s = {}\nmax_num_seqs = 16\nmax_model_len = 512\n",
                opts.model.display().to_string(),
                opts.cards,
                replicas.join(", "),
                opts.reply_timeout
            ),
        )
        .unwrap();
        // Every port of the cluster at once, so that no two are the same.
        let mut ports = free_ports(opts.cards + 2);
        let (http, attention_port) = (ports[opts.cards], ports[opts.cards + 1]);
        ports.truncate(opts.cards);
        let mut cluster = Cluster {
            cards: Vec::new(),
            attention: Proc(Command::new("true").spawn().unwrap()),
            frontend: Proc(Command::new("true").spawn().unwrap()),
            http,
            card_ports: ports,
            dir,
            opts,
        };
        for i in 0..cluster.opts.cards {
            let p = cluster.card(i);
            cluster.cards.push(Some(p));
        }
        for i in 0..cluster.opts.cards {
            cluster.wait_card(i);
        }
        let card_list: Vec<String> = cluster
            .card_ports
            .iter()
            .map(|p| format!("{}:{p}", cluster.opts.net.card_ip))
            .collect();
        let certs = cluster.dir.path().join("certs");
        cluster.attention = Proc(
            Command::new(AFD)
                .args(["attention", "--deployment"])
                .arg(&file)
                .args(["--cards", &card_list.join(",")])
                .args(["--listen", &format!("127.0.0.1:{attention_port}")])
                .args(["--data-listen", &format!("{}:0", cluster.opts.net.node_ip)])
                .arg("--certs")
                .arg(&certs)
                .stdout(log_file(cluster.dir.path(), "attention"))
                .stderr(log_file(cluster.dir.path(), "attention"))
                .spawn()
                .unwrap(),
        );
        cluster.frontend = Proc(
            Command::new(AFD)
                .arg("frontend")
                .args(["--attention-addrs", &format!("127.0.0.1:{attention_port}")])
                .arg("--certs")
                .arg(&certs)
                .arg("--model")
                .arg(&cluster.opts.model)
                .args(["--port", &cluster.http.to_string()])
                .args(["--served-model-name", "m", "--max-num-seqs", "16"])
                .args(["--max-model-len", "512"])
                .stdout(log_file(cluster.dir.path(), "frontend"))
                .stderr(log_file(cluster.dir.path(), "frontend"))
                .spawn()
                .unwrap(),
        );
        cluster.wait_health(200, Duration::from_secs(240));
        cluster
    }

    /// Card `i`'s process, started with the same command every time.
    fn card(&self, i: usize) -> Proc {
        let net = &self.opts.net;
        let mut cmd = match net.wrap.split_first() {
            Some((program, rest)) => {
                let mut c = Command::new(program);
                c.args(rest).arg(AFD);
                c
            }
            None => Command::new(AFD),
        };
        cmd.args(["card", "--id", &i.to_string()])
            .args([
                "--listen",
                &format!("{}:{}", net.card_ip, self.card_ports[i]),
            ])
            .arg("--certs")
            .arg(self.dir.path().join("certs"))
            .stdin(Stdio::null())
            .stdout(log_file(self.dir.path(), &format!("card-{i}")))
            .stderr(log_file(self.dir.path(), &format!("card-{i}")));
        Proc(cmd.spawn().unwrap())
    }

    fn wait_card(&self, i: usize) {
        let deadline = Instant::now() + Duration::from_secs(60);
        let addr = format!("{}:{}", self.opts.net.card_ip, self.card_ports[i]);
        while TcpStream::connect(&addr).is_err() {
            assert!(
                Instant::now() < deadline,
                "card {i} never listened on {addr}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The pid of card `i` (the card itself, not a wrapper such as `ip netns exec`, which
    /// execs it).
    pub fn card_pid(&self, i: usize) -> u32 {
        self.cards[i].as_ref().expect("card is running").0.id()
    }

    /// SIGKILL to card `i`.
    pub fn kill_card(&mut self, i: usize) {
        if let Some(mut p) = self.cards[i].take() {
            let _ = p.0.kill();
            let _ = p.0.wait();
        }
    }

    /// Starts card `i` again with its original command.
    pub fn restart_card(&mut self, i: usize) {
        assert!(self.cards[i].is_none(), "card {i} is still running");
        let p = self.card(i);
        self.cards[i] = Some(p);
    }

    /// Sends `signal` to card `i`.
    pub fn signal_card(&self, i: usize, signal: libc::c_int) {
        // SAFETY: kill(2) on a child of this process that has not been reaped.
        unsafe {
            libc::kill(self.card_pid(i) as libc::pid_t, signal);
        }
    }

    /// Waits until `/health` answers `status`; returns how long it took.
    pub fn wait_health(&self, status: u16, within: Duration) -> Duration {
        let started = Instant::now();
        loop {
            if let Some((s, _)) = http(self.http, "GET", "/health", None)
                && s == status
            {
                return started.elapsed();
            }
            assert!(
                started.elapsed() < within,
                "/health did not answer {status} within {within:?}\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `/health`: status and body.
    pub fn health(&self) -> (u16, String) {
        http(self.http, "GET", "/health", None).expect("/health answers")
    }

    /// A greedy completion of `prompt`: status, and the tokens or the body.
    pub fn complete(&self, prompt: &[u32], max_tokens: usize) -> (u16, Result<Vec<u64>, String>) {
        complete_on(self.http, prompt, max_tokens)
    }

    /// Prometheus text.
    pub fn metrics(&self) -> String {
        http(self.http, "GET", "/metrics", None).unwrap().1
    }

    /// Every process's log, for failure messages.
    pub fn logs(&self) -> String {
        let mut out = String::new();
        let mut names: Vec<PathBuf> = std::fs::read_dir(self.dir.path())
            .unwrap()
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "log"))
            .collect();
        names.sort();
        for p in names {
            let text = std::fs::read_to_string(&p).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(15).collect();
            out.push_str(&format!("--- {}\n", p.display()));
            for l in tail.iter().rev() {
                out.push_str(l);
                out.push('\n');
            }
        }
        out
    }

    /// Whether the attention and frontend processes are still the ones started.
    pub fn node_and_frontend_alive(&mut self) -> bool {
        let alive = |c: &mut Child| matches!(c.try_wait(), Ok(None));
        alive(&mut self.attention.0) && alive(&mut self.frontend.0)
    }
}

/// A minimal HTTP/1.1 exchange with 127.0.0.1:`port` (`Connection: close`): status and body.
pub fn http(port: u16, method: &str, path: &str, body: Option<&Value>) -> Option<(u16, String)> {
    crate::common::http(&format!("127.0.0.1:{port}"), method, path, body)
}

/// A greedy completion of `prompt` from the frontend on `port`: status, and the tokens or the
/// body.
pub fn complete_on(
    port: u16,
    prompt: &[u32],
    max_tokens: usize,
) -> (u16, Result<Vec<u64>, String>) {
    let body = json!({"model": "m", "prompt": prompt, "max_tokens": max_tokens,
                      "temperature": 0, "ignore_eos": true, "return_token_ids": true});
    let Some((status, text)) = http(port, "POST", "/v1/completions", Some(&body)) else {
        return (0, Err("no answer (connection failed or timed out)".into()));
    };
    if status != 200 {
        return (status, Err(text));
    }
    let v: Value = serde_json::from_str(&text).unwrap();
    let ids = v["choices"][0]["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    (status, Ok(ids))
}
