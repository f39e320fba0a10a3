//! `afd serve` (the bundled model on 2 cards over loopback QUIC) stopped by SIGTERM and
//! SIGINT while streams run: new requests get 503 and `/health` says it is draining, every
//! stream ends with `[DONE]` (finished, or with an error event at the deadline), and the
//! process exits 0 without a panic.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

mod common;

use common::{AFD, free_port, http, wait_healthy};

/// A running `afd serve` whose stderr is collected.
struct Serve {
    child: Child,
    address: String,
    stderr: Arc<Mutex<String>>,
    reader: Option<JoinHandle<()>>,
}

impl Serve {
    fn start(extra: &[&str]) -> Serve {
        let port = free_port();
        let mut child = Command::new(AFD)
            .args(["serve", "--cards", "2", "--port", &port.to_string()])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = Arc::new(Mutex::new(String::new()));
        let pipe = child.stderr.take().unwrap();
        let reader = {
            let stderr = Arc::clone(&stderr);
            std::thread::spawn(move || {
                for line in BufReader::new(pipe).lines() {
                    let Ok(line) = line else { break };
                    let mut text = stderr.lock().unwrap();
                    text.push_str(&line);
                    text.push('\n');
                }
            })
        };
        let address = format!("127.0.0.1:{port}");
        wait_healthy(&address, Duration::from_secs(300));
        Serve {
            child,
            address,
            stderr,
            reader: Some(reader),
        }
    }

    fn signal(&self, signal: libc::c_int) {
        // SAFETY: kill(2) has no memory effects; the pid is our unreaped child.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, signal);
        }
    }

    /// Waits for the exit (at most a minute), checks it was exit 0 with no panic, and returns
    /// everything the process wrote on stderr.
    fn exits_cleanly(mut self) -> String {
        let within = Duration::from_secs(60);
        let deadline = Instant::now() + within;
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            assert!(
                Instant::now() < deadline,
                "afd serve did not exit within {within:?}:\n{}",
                self.stderr.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
        let stderr = self.stderr.lock().unwrap().clone();
        assert_eq!(status.code(), Some(0), "{stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        stderr
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A streaming completion of `max_tokens` tokens that has produced its first chunk; the
/// thread returns every `data:` payload until the server closed the connection.
fn open_stream(address: &str, max_tokens: usize) -> JoinHandle<Vec<String>> {
    let mut s = TcpStream::connect(address).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let body = json!({"prompt": "It is a truth universally acknowledged", "max_tokens": max_tokens,
                      "stream": true, "ignore_eos": true})
    .to_string();
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(request.as_bytes()).unwrap();
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&raw).contains("data: {") {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "closed before the first chunk");
        raw.extend_from_slice(&buf[..n]);
    }
    std::thread::spawn(move || {
        let _ = s.read_to_end(&mut raw);
        let text = String::from_utf8_lossy(&raw).into_owned();
        text.lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .map(str::to_string)
            .collect()
    })
}

/// The last event of a stream before `[DONE]`, checking `[DONE]` is there.
fn before_done(events: &[String]) -> &str {
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    &events[events.len() - 2]
}

/// Asserts that during the drain new work gets 503 and `/health` says it is draining.
fn assert_refuses_new_work(address: &str) {
    let body = json!({"prompt": "Hello", "max_tokens": 2});
    let (status, answer) = http(address, "POST", "/v1/completions", Some(&body)).unwrap();
    assert_eq!(status, 503, "{answer}");
    let v: Value = serde_json::from_str(&answer).unwrap();
    assert_eq!(v["error"]["type"], "ServiceUnavailableError", "{v}");
    let (status, answer) = http(address, "GET", "/health", None).unwrap();
    assert_eq!(status, 503, "{answer}");
    assert!(answer.contains("draining"), "{answer}");
}

#[test]
fn sigterm_drains_every_stream_and_exits_0() {
    let serve = Serve::start(&[]);
    let streams: Vec<_> = (0..6).map(|_| open_stream(&serve.address, 60)).collect();
    serve.signal(libc::SIGTERM);
    std::thread::sleep(Duration::from_millis(100));
    assert_refuses_new_work(&serve.address);
    for stream in streams {
        let events = stream.join().unwrap();
        let finished = before_done(&events);
        assert!(
            finished.contains("\"finish_reason\":\"length\""),
            "{finished}"
        );
    }
    let stderr = serve.exits_cleanly();
    assert!(stderr.contains("SIGTERM: draining"), "{stderr}");
}

#[test]
fn sigint_at_a_short_deadline_ends_the_streams_with_an_error_event_and_exits_0() {
    let serve = Serve::start(&["--shutdown-timeout", "0.5"]);
    // Far more tokens than half a second gives them.
    let streams: Vec<_> = (0..4).map(|_| open_stream(&serve.address, 4000)).collect();
    serve.signal(libc::SIGINT);
    std::thread::sleep(Duration::from_millis(100));
    assert_refuses_new_work(&serve.address);
    for stream in streams {
        let events = stream.join().unwrap();
        let error: Value = serde_json::from_str(before_done(&events)).unwrap();
        assert_eq!(error["error"]["code"], 503, "{error}");
        let message = error["error"]["message"].as_str().unwrap();
        assert!(message.contains("shutting down"), "{error}");
    }
    let stderr = serve.exits_cleanly();
    let cut: usize = stderr
        .split(" request(s) cut off")
        .next()
        .and_then(|head| head.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(cut >= 4, "the four streams were cut off:\n{stderr}");
}
