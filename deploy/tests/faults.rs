//! Fault injection on real processes (`afd card` x 2, `afd attention`, `afd frontend`): a card
//! killed under load fails its requests fast (503 naming the card, never a 500 or a hang),
//! `/health` says which card is down, and the card started again with the same command serves
//! again with nothing else restarted, giving the fault-free run's tokens; the same for a card
//! stopped (SIGSTOP) and resumed (SIGCONT); with every expert replicated, a killed card costs no
//! request at all; and a lossy, slow, reordering network between the node and the cards
//! (network namespaces, `netem`) changes no token. Every role exits 0 on SIGINT.
//!
//! The tests take turns (one deployment at a time), and print what they measured.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[path = "faults/cluster.rs"]
mod cluster;
mod common;
#[path = "faults/netem.rs"]
mod netem;

use cluster::{CardNet, Cluster, Options};
use common::fixture;

/// One deployment at a time: they share the machine's cores.
static TURN: Mutex<()> = Mutex::new(());

fn turn() -> std::sync::MutexGuard<'static, ()> {
    TURN.lock().unwrap_or_else(|p| p.into_inner())
}

fn options(replicate_all: bool) -> Options {
    Options {
        model: fixture("gpt-oss-mxfp4"),
        cards: 2,
        replicate_all,
        experts: 4,
        reply_timeout: 60.0,
        net: CardNet::default(),
    }
}

fn prompts() -> Vec<Vec<u32>> {
    (0..4u32)
        .map(|i| {
            (0..4 + i * 3)
                .map(|t| 10 + (t * 17 + i * 5) % 290)
                .collect()
        })
        .collect()
}

const MAX_TOKENS: usize = 12;

/// Each prompt's tokens with every card up.
fn baseline(c: &Cluster) -> Vec<Vec<u64>> {
    prompts()
        .iter()
        .map(|p| match c.complete(p, MAX_TOKENS) {
            (200, Ok(ids)) => ids,
            (status, other) => panic!("fault-free run: {status} {other:?}\n{}", c.logs()),
        })
        .collect()
}

/// One answered request of the load.
#[derive(Debug)]
struct Answer {
    /// When it was sent, from the load's start.
    sent: Duration,
    /// When it was answered, from the load's start.
    at: Duration,
    status: u16,
    /// Whether a 200's tokens equal the baseline's.
    same: bool,
    body: String,
}

/// Clients sending the prompts over and over until stopped.
struct Load {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<Vec<Answer>>>,
    started: Instant,
}

impl Load {
    fn start(c: &Cluster, clients: usize, expected: &[Vec<u64>]) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let started = Instant::now();
        let threads = (0..clients)
            .map(|k| {
                let stop = stop.clone();
                let http = c.http;
                let expected = expected.to_vec();
                std::thread::spawn(move || {
                    let mut answers = Vec::new();
                    let mut i = k;
                    while !stop.load(Ordering::Acquire) {
                        let p = &prompts()[i % expected.len()];
                        let sent = started.elapsed();
                        let (status, got) = cluster::complete_on(http, p, MAX_TOKENS);
                        answers.push(Answer {
                            sent,
                            at: started.elapsed(),
                            status,
                            same: got
                                .as_ref()
                                .is_ok_and(|ids| *ids == expected[i % expected.len()]),
                            body: got.err().unwrap_or_default(),
                        });
                        if status != 200 {
                            std::thread::sleep(Duration::from_millis(20));
                        }
                        i += 1;
                    }
                    answers
                })
            })
            .collect();
        Load {
            stop,
            threads,
            started,
        }
    }

    fn stop(self) -> Vec<Answer> {
        self.stop.store(true, Ordering::Release);
        let mut all: Vec<Answer> = self
            .threads
            .into_iter()
            .flat_map(|t| t.join().unwrap())
            .collect();
        all.sort_by_key(|a| a.at);
        all
    }
}

/// Every answer is a 200 with the baseline's tokens or a 503 naming card `card`.
fn check_answers(answers: &[Answer], card: usize, logs: &str) {
    for a in answers {
        match a.status {
            200 => assert!(a.same, "a 200 with other tokens than the fault-free run"),
            503 => assert!(
                a.body.contains(&format!("card {card}")),
                "a 503 that does not name card {card}: {}",
                a.body
            ),
            other => panic!("answered {other} ({}) at {:?}\n{logs}", a.body, a.at),
        }
    }
}

fn first_503_after(answers: &[Answer], t: Duration) -> Option<Duration> {
    answers
        .iter()
        .find(|a| a.at >= t && a.status == 503)
        .map(|a| a.at - t)
}

fn counter(metrics: &str, name: &str, card: usize) -> f64 {
    metrics
        .lines()
        .find(|l| l.starts_with(name) && l.contains(&format!("card=\"{card}\"")))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(-1.0)
}

/// Kill (or stop) card 1 under load, check the failure, bring it back, check the recovery;
/// `round` counts the faults so far, this one included.
fn fail_and_recover(c: &mut Cluster, kill: bool, round: u64) {
    let expected = baseline(c);
    let load = Load::start(c, 3, &expected);
    std::thread::sleep(Duration::from_millis(700));
    let died = load.started.elapsed();
    if kill {
        c.kill_card(1);
    } else {
        c.signal_card(1, libc::SIGSTOP);
    }
    let down = c.wait_health(503, Duration::from_secs(10));
    let (_, body) = c.health();
    let health: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(health["cards"][0]["card"], 1, "{body}");
    assert_eq!(health["cards"][0]["state"], "down", "{body}");
    assert!(
        health["error"]["message"]
            .as_str()
            .unwrap()
            .contains("card 1 is down"),
        "{body}"
    );
    std::thread::sleep(Duration::from_millis(500));
    let back_at = load.started.elapsed();
    if kill {
        c.restart_card(1);
    } else {
        c.signal_card(1, libc::SIGCONT);
    }
    let serving = c.wait_health(200, Duration::from_secs(60));
    let healthy_at = load.started.elapsed();
    std::thread::sleep(Duration::from_millis(700));
    let answers = load.stop();
    let logs = c.logs();
    check_answers(&answers, 1, &logs);
    // Once /health says the card is back, its path is open: nothing sent after fails.
    let late: Vec<&Answer> = answers
        .iter()
        .filter(|a| a.sent >= healthy_at && a.status != 200)
        .collect();
    assert!(
        late.is_empty(),
        "failed after /health 200: {late:?}\n{logs}"
    );
    let failed_fast =
        first_503_after(&answers, died).expect("no request failed while card 1 was down");
    let first_ok_after = answers
        .iter()
        .find(|a| a.at >= back_at && a.status == 200)
        .map(|a| a.at - back_at);
    eprintln!(
        "{}: /health 503 after {:.2} s, first request failed (503) {:.2} s after the fault; \
         /health 200 {:.2} s after the card was {}, first 200 after {:?}; {} requests",
        if kill { "kill -9" } else { "SIGSTOP" },
        down.as_secs_f64(),
        failed_fast.as_secs_f64(),
        serving.as_secs_f64(),
        if kill { "started again" } else { "resumed" },
        first_ok_after,
        answers.len()
    );
    // The heartbeats, not the 60 s reply timeout, told the node the card was gone: they
    // notice within MISSES_TO_DOWN x (interval + timeout), 1.2 s with the defaults (a killed
    // card at once); 5 s leaves a loaded machine room. (`wait_health` bounded the rejoin.)
    assert!(failed_fast < Duration::from_secs(5), "{failed_fast:?}");
    // Served again, with the fault-free tokens, and nothing else was restarted.
    assert_eq!(baseline(c), expected);
    assert!(c.node_and_frontend_alive(), "{}", c.logs());
    let m = c.metrics();
    assert_eq!(
        counter(&m, "afd_card_failures_total", 1),
        round as f64,
        "{m}"
    );
    assert_eq!(
        counter(&m, "afd_card_rejoins_total", 1),
        round as f64,
        "{m}"
    );
    assert_eq!(counter(&m, "afd_card_up", 1), 1.0, "{m}");
}

#[test]
fn a_killed_card_fails_requests_fast_and_serves_again_once_restarted() {
    let _turn = turn();
    let mut c = Cluster::start(options(false));
    // In a loop: a rejoin that raced its own dial once failed one request after the card was
    // back (issue 60).
    for round in 1..=3 {
        fail_and_recover(&mut c, true, round);
    }
}

#[test]
fn a_stopped_card_fails_requests_fast_and_serves_again_once_resumed() {
    let _turn = turn();
    let mut c = Cluster::start(options(false));
    fail_and_recover(&mut c, false, 1);
}

#[test]
fn with_every_expert_replicated_a_killed_card_costs_no_request() {
    let _turn = turn();
    let mut c = Cluster::start(options(true));
    let expected = baseline(&c);
    let load = Load::start(&c, 3, &expected);
    std::thread::sleep(Duration::from_millis(700));
    c.kill_card(1);
    // Still serving, saying which card is down.
    let deadline = Instant::now() + Duration::from_secs(10);
    let body = loop {
        let (status, body) = c.health();
        assert_eq!(status, 200, "{body}");
        if body.contains("degraded") {
            break body;
        }
        assert!(Instant::now() < deadline, "card 1 never reported down");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(body.contains("\"card\":1"), "{body}");
    std::thread::sleep(Duration::from_millis(1500));
    let answers = load.stop();
    let logs = c.logs();
    for a in &answers {
        assert_eq!(a.status, 200, "{} at {:?}\n{logs}", a.body, a.at);
        assert!(a.same, "other tokens than with both cards up");
    }
    assert_eq!(baseline(&c), expected);
    c.restart_card(1);
    let deadline = Instant::now() + Duration::from_secs(60);
    while c.health().1.contains("degraded") {
        assert!(Instant::now() < deadline, "card 1 never came back");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(baseline(&c), expected);
}

#[test]
fn a_lossy_slow_reordering_network_changes_no_token() {
    let _turn = turn();
    let Some(net) = netem::ImpairedNet::create() else {
        return;
    };
    let mut opts = options(false);
    let reference = {
        let c = Cluster::start(options(false));
        baseline(&c)
    };
    opts.net = net.card_net();
    let c = Cluster::start(opts);
    let started = Instant::now();
    let got = baseline(&c);
    eprintln!(
        "netem ({}): {} prompts in {:.1} s",
        net.describe(),
        got.len(),
        started.elapsed().as_secs_f64()
    );
    assert_eq!(got, reference, "{}", c.logs());
    // Concurrent requests over the same network: no hang, no failure, same tokens.
    let load = Load::start(&c, 3, &reference);
    std::thread::sleep(Duration::from_secs(4));
    let answers = load.stop();
    let logs = c.logs();
    assert!(!answers.is_empty());
    for a in &answers {
        assert_eq!(a.status, 200, "{} at {:?}\n{logs}", a.body, a.at);
        assert!(a.same);
    }
    let m = c.metrics();
    for card in 0..2 {
        assert_eq!(counter(&m, "afd_card_failures_total", card), 0.0, "{m}");
    }
    if let Some((passed, dropped)) = net.relayed() {
        assert!(
            passed > 0 && dropped > 0,
            "the link was not impaired: {passed} {dropped}"
        );
    }
    eprintln!("netem: {}", net.describe());
    drop(c);
    drop(net);
}

/// How `child` ended within a minute of a stop signal: `Err` unless it exited 0 by itself.
fn exits_0(child: &mut std::process::Child) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match child.try_wait() {
            Ok(Some(status)) if status.success() => return Ok(()),
            Ok(Some(status)) => return Err(format!("ended with {status}")),
            Ok(None) if Instant::now() >= deadline => return Err("still running".into()),
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// SIGINT stops each role by itself with exit 0, in afd up's order: the frontend (it drains),
/// the attention node, the cards. (SIGTERM, the same handler, is checked through afd up in
/// tests/afd_up.rs.)
#[test]
fn every_role_exits_0_on_sigint() {
    let _turn = turn();
    let mut c = Cluster::start(options(false));
    baseline(&c);
    let interrupt = |pid: u32| {
        // SAFETY: kill(2) on a child of this process that has not been reaped.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGINT) };
    };
    interrupt(c.frontend.0.id());
    let frontend = exits_0(&mut c.frontend.0);
    assert!(frontend.is_ok(), "frontend: {frontend:?}\n{}", c.logs());
    interrupt(c.attention.0.id());
    let attention = exits_0(&mut c.attention.0);
    assert!(attention.is_ok(), "attention: {attention:?}\n{}", c.logs());
    for k in 0..2 {
        interrupt(c.card_pid(k));
        let card = exits_0(&mut c.cards[k].as_mut().expect("card runs").0);
        assert!(card.is_ok(), "card {k}: {card:?}\n{}", c.logs());
    }
}
