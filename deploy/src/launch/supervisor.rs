//! Starting the processes of a [`LaunchPlan`] one after another, each once the one before it is
//! healthy; forwarding their output line by line with the role's name in front; starting again,
//! with back-off ([`super::restart`]), a process that dies once the deployment is up; and
//! stopping all of them in order when asked to.
//!
//! Children get their own process group, so a Ctrl-C at the terminal reaches only the
//! supervisor, which then passes the signal on in stages (the frontend, then the attention
//! nodes, then the cards, each stage given the grace period to drain before it is killed)
//! instead of racing them. On Linux each child is also told to die with the supervisor, so even
//! a supervisor killed with SIGKILL leaves nothing behind.

use std::future::Future;
use std::io::Write;
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::health::probe;
use super::plan::{LaunchPlan, ProcessSpec, Role};
use super::restart::{Backoff, RestartPolicy, stop_stage};
use crate::error::{Error, Result};

/// How the supervisor starts, restarts and stops processes.
#[derive(Debug, Clone)]
pub struct SupervisorConfig {
    /// The `afd` binary every role runs (normally this very program).
    pub program: PathBuf,
    /// How long one process may take to become healthy.
    pub ready_timeout: Duration,
    /// How long each stage of processes (frontend, attention nodes, cards) may take to stop
    /// after the signal before it is killed.
    pub stop_grace: Duration,
    /// How often a starting process is probed.
    pub probe_interval: Duration,
    /// How a process that dies after the deployment is up is started again; `None`: not at
    /// all, the deployment is stopped instead.
    pub restart: Option<RestartPolicy>,
}

impl Default for SupervisorConfig {
    fn default() -> Self {
        SupervisorConfig {
            program: PathBuf::from("afd"),
            ready_timeout: Duration::from_secs(600),
            stop_grace: Duration::from_secs(40),
            probe_interval: Duration::from_millis(250),
            restart: Some(RestartPolicy::default()),
        }
    }
}

/// A started child.
struct Running {
    role: Role,
    pid: u32,
    started: Instant,
    exit: Option<std::io::Result<ExitStatus>>,
    backoff: Backoff,
}

/// What ended a launch that was not an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// Stopped on request (`stop` completed).
    Stopped,
}

/// Why the launch ended before the stop request.
enum Failure {
    /// A child exited on its own (and is not restarted).
    Died(usize),
    /// Any other problem.
    Error(Error),
}

fn describe(exit: &Option<std::io::Result<ExitStatus>>) -> String {
    match exit {
        Some(Ok(status)) => status.to_string(),
        Some(Err(e)) => format!("status unknown ({e})"),
        None => "still running".into(),
    }
}

/// Prints each line `reader` yields as `[name] line`, on stderr or stdout.
fn forward(
    name: String,
    reader: impl AsyncRead + Unpin + Send + 'static,
    to_stderr: bool,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut reader = BufReader::new(reader);
        let mut line = Vec::new();
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    let text = String::from_utf8_lossy(&line);
                    let text = text.trim_end_matches(['\n', '\r']);
                    // A closed stdout (`afd up ... | head`) must not stop the launcher.
                    let _ = if to_stderr {
                        writeln!(std::io::stderr().lock(), "[{name}] {text}")
                    } else {
                        writeln!(std::io::stdout().lock(), "[{name}] {text}")
                    };
                }
            }
        }
    })
}

/// Makes the child die with this process (Linux), checked against a parent that is already
/// gone.
#[cfg(target_os = "linux")]
fn die_with_parent(parent: u32) -> std::io::Result<()> {
    // SAFETY: prctl(PR_SET_PDEATHSIG) and getppid only read or set attributes of the calling
    // process; both are async-signal-safe, as required between fork and exec.
    unsafe {
        if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        if libc::getppid() as u32 != parent {
            return Err(std::io::Error::other("the launcher exited while starting"));
        }
    }
    Ok(())
}

/// Sends `sig` to the process group child `pid` leads (the child and anything it started).
fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: kill(2) has no memory effects. The pid is a child this process has not reaped
    // yet (exits are recorded before any signal is sent), so its group cannot be another's.
    unsafe {
        libc::kill(-(pid as libc::pid_t), sig);
    }
}

/// A signal's name, for the log.
fn signal_name(sig: libc::c_int) -> &'static str {
    match sig {
        libc::SIGINT => "SIGINT",
        libc::SIGTERM => "SIGTERM",
        libc::SIGKILL => "SIGKILL",
        _ => "a signal",
    }
}

/// Starts, watches, restarts and stops the processes of one launch.
pub struct Supervisor {
    config: SupervisorConfig,
    running: Vec<Running>,
    exits: mpsc::UnboundedReceiver<(usize, std::io::Result<ExitStatus>)>,
    exit_sender: mpsc::UnboundedSender<(usize, std::io::Result<ExitStatus>)>,
    logs: Vec<JoinHandle<()>>,
}

impl Supervisor {
    /// A supervisor with nothing started yet.
    pub fn new(config: SupervisorConfig) -> Self {
        let (exit_sender, exits) = mpsc::unbounded_channel();
        Supervisor {
            config,
            running: Vec::new(),
            exits,
            exit_sender,
            logs: Vec::new(),
        }
    }

    /// Runs `plan` until `stop` completes with a signal (then `Ok`, after passing that signal
    /// on to every process in stages), or until a process fails to start or to become healthy,
    /// or dies without a restart policy (then `Err` naming it). Every process is stopped either
    /// way. Call it on a current-thread runtime on the main thread: children are told to die
    /// with the thread that started them.
    pub async fn run(
        mut self,
        plan: &LaunchPlan,
        stop: impl Future<Output = libc::c_int>,
    ) -> Result<Ended> {
        let mut forwarded = libc::SIGINT;
        let outcome = self.start_and_watch(plan, stop, &mut forwarded).await;
        if let Err(Failure::Died(i)) = &outcome {
            let r = &self.running[*i];
            eprintln!(
                "[up] {} (pid {}) exited on its own with {}; stopping the others",
                r.role,
                r.pid,
                describe(&r.exit)
            );
        }
        self.stop_all(forwarded).await;
        for log in self.logs.drain(..) {
            // Output still buffered in the pipes is printed before returning.
            let _ = tokio::time::timeout(Duration::from_secs(2), log).await;
        }
        match outcome {
            Ok(ended) => Ok(ended),
            Err(Failure::Error(e)) => Err(e),
            Err(Failure::Died(i)) => {
                let r = &self.running[i];
                Err(Error::Io(format!(
                    "{} (pid {}) exited on its own with {}; stopped the other processes",
                    r.role,
                    r.pid,
                    describe(&r.exit)
                )))
            }
        }
    }

    async fn start_and_watch(
        &mut self,
        plan: &LaunchPlan,
        stop: impl Future<Output = libc::c_int>,
        forwarded: &mut libc::c_int,
    ) -> Result<Ended, Failure> {
        tokio::pin!(stop);
        for spec in &plan.processes {
            let started = Instant::now();
            let child = self
                .spawn(spec, self.running.len())
                .map_err(Failure::Error)?;
            self.running.push(child);
            let deadline = started + self.config.ready_timeout;
            loop {
                let why = tokio::select! {
                    sig = &mut stop => { *forwarded = sig; return Ok(Ended::Stopped) }
                    Some((i, status)) = self.exits.recv() => {
                        self.running[i].exit = Some(status);
                        return Err(Failure::Died(i));
                    }
                    answer = probe(&spec.health) => match answer {
                        Ok(()) => break,
                        Err(why) => why,
                    },
                };
                if Instant::now() >= deadline {
                    return Err(Failure::Error(Error::Io(format!(
                        "{} did not become healthy within {:.0} s (last probe: {why}); raise \
                         --ready-timeout if it is still loading",
                        spec.role,
                        self.config.ready_timeout.as_secs_f64()
                    ))));
                }
                tokio::select! {
                    sig = &mut stop => { *forwarded = sig; return Ok(Ended::Stopped) }
                    Some((i, status)) = self.exits.recv() => {
                        self.running[i].exit = Some(status);
                        return Err(Failure::Died(i));
                    }
                    _ = tokio::time::sleep(self.config.probe_interval) => {}
                }
            }
            eprintln!(
                "[up] {} is healthy after {:.1} s",
                spec.role,
                started.elapsed().as_secs_f64()
            );
        }
        eprintln!(
            "[up] ready: {} processes; serving {} (Ctrl-C stops them all)",
            self.running.len(),
            plan.url
        );
        // Up: a process that dies is started again (after its back-off), the others go on.
        let mut due: Vec<(Instant, usize)> = Vec::new();
        loop {
            let next = due.iter().map(|(t, _)| *t).min();
            tokio::select! {
                sig = &mut stop => { *forwarded = sig; return Ok(Ended::Stopped) }
                Some((i, status)) = self.exits.recv() => {
                    self.running[i].exit = Some(status);
                    let Some(policy) = self.config.restart else {
                        return Err(Failure::Died(i));
                    };
                    let r = &mut self.running[i];
                    let delay = r.backoff.next(&policy, r.started.elapsed());
                    eprintln!(
                        "[up] {} (pid {}) exited on its own with {}; starting it again{}",
                        r.role,
                        r.pid,
                        describe(&r.exit),
                        if delay.is_zero() {
                            String::new()
                        } else {
                            format!(" in {:.1} s", delay.as_secs_f64())
                        }
                    );
                    due.push((Instant::now() + delay, i));
                }
                _ = tokio::time::sleep_until(next.unwrap_or_else(Instant::now)), if next.is_some() => {
                    let now = Instant::now();
                    let ready: Vec<usize> = due.iter().filter(|(t, _)| *t <= now).map(|(_, i)| *i).collect();
                    due.retain(|(t, _)| *t > now);
                    for i in ready {
                        self.restart(&plan.processes[i], i).map_err(Failure::Error)?;
                    }
                }
            }
        }
    }

    /// Starts process `i` again and reports when it is healthy.
    fn restart(&mut self, spec: &ProcessSpec, i: usize) -> Result<()> {
        let mut child = self.spawn(spec, i)?;
        child.backoff = std::mem::take(&mut self.running[i].backoff);
        eprintln!(
            "[up] {} started again (pid {}, restart {})",
            spec.role,
            child.pid,
            child.backoff.total()
        );
        self.running[i] = child;
        let (health, role, interval, within) = (
            spec.health.clone(),
            spec.role,
            self.config.probe_interval,
            self.config.ready_timeout,
        );
        tokio::spawn(async move {
            let started = Instant::now();
            while started.elapsed() < within {
                if probe(&health).await.is_ok() {
                    eprintln!(
                        "[up] {role} is healthy again after {:.1} s",
                        started.elapsed().as_secs_f64()
                    );
                    return;
                }
                tokio::time::sleep(interval).await;
            }
        });
        Ok(())
    }

    fn spawn(&mut self, spec: &ProcessSpec, index: usize) -> Result<Running> {
        let mut command = tokio::process::Command::new(&self.config.program);
        command
            .args(&spec.args)
            .envs(spec.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .process_group(0);
        #[cfg(target_os = "linux")]
        {
            let parent = std::process::id();
            // SAFETY: the closure only calls async-signal-safe functions (see die_with_parent).
            unsafe {
                command.pre_exec(move || die_with_parent(parent));
            }
        }
        let mut child = command.spawn().map_err(Error::system(format!(
            "cannot start {} ({} {})",
            spec.role,
            self.config.program.display(),
            spec.args.join(" ")
        )))?;
        let pid = child.id().unwrap_or(0);
        let name = spec.role.name();
        if let Some(out) = child.stdout.take() {
            self.logs.push(forward(name.clone(), out, false));
        }
        if let Some(err) = child.stderr.take() {
            self.logs.push(forward(name.clone(), err, true));
        }
        let sender = self.exit_sender.clone();
        tokio::spawn(async move {
            let status = child.wait().await;
            let _ = sender.send((index, status));
        });
        eprintln!(
            "[up] started {name} (pid {pid}): afd {}",
            spec.args.join(" ")
        );
        Ok(Running {
            role: spec.role,
            pid,
            started: Instant::now(),
            exit: None,
            backoff: Backoff::default(),
        })
    }

    /// Passes `sig` on in stages: the frontend, then the attention nodes, then the cards, each
    /// stage waited for (SIGKILL after the grace period) before the next is signalled; returns
    /// once every child has been reaped.
    async fn stop_all(&mut self, sig: libc::c_int) {
        for stage in 0..3 {
            let members: Vec<usize> = (0..self.running.len())
                .filter(|&i| stop_stage(self.running[i].role) == stage)
                .collect();
            for &i in &members {
                let r = &self.running[i];
                if r.exit.is_none() {
                    eprintln!(
                        "[up] stopping {} (pid {}) with {}",
                        r.role,
                        r.pid,
                        signal_name(sig)
                    );
                    signal(r.pid, sig);
                }
            }
            let deadline = Instant::now() + self.config.stop_grace;
            let mut killed = false;
            while members.iter().any(|&i| self.running[i].exit.is_none()) {
                tokio::select! {
                    Some((i, status)) = self.exits.recv() => {
                        let r = &mut self.running[i];
                        r.exit = Some(status);
                        eprintln!("[up] {} (pid {}) stopped: {}", r.role, r.pid, describe(&r.exit));
                    }
                    _ = tokio::time::sleep_until(deadline), if !killed => {
                        killed = true;
                        for &i in &members {
                            let r = &self.running[i];
                            if r.exit.is_none() {
                                eprintln!(
                                    "[up] {} (pid {}) did not stop within {:.0} s; killing it",
                                    r.role,
                                    r.pid,
                                    self.config.stop_grace.as_secs_f64()
                                );
                                signal(r.pid, libc::SIGKILL);
                            }
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launch::plan::HealthCheck;

    fn spec(role: Role, script: &str) -> ProcessSpec {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .unwrap();
        ProcessSpec {
            role,
            args: vec!["-c".into(), script.into()],
            env: Vec::new(),
            // Nothing listens there: the process never becomes healthy.
            health: HealthCheck::Http {
                address: format!("127.0.0.1:{port}"),
                path: "/health".into(),
            },
        }
    }

    fn shell() -> SupervisorConfig {
        SupervisorConfig {
            program: "/bin/sh".into(),
            ready_timeout: Duration::from_secs(30),
            stop_grace: Duration::from_secs(5),
            probe_interval: Duration::from_millis(20),
            restart: Some(RestartPolicy::default()),
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_process_that_exits_while_starting_is_named_with_its_status() {
        let plan = LaunchPlan {
            processes: vec![spec(Role::Card(3), "exit 7")],
            url: String::new(),
        };
        let err = Supervisor::new(shell())
            .run(&plan, std::future::pending())
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("card-3"), "{err}");
        assert!(err.contains("exit status: 7"), "{err}");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_stop_request_while_starting_stops_the_process() {
        let plan = LaunchPlan {
            processes: vec![spec(Role::Frontend, "exec sleep 30")],
            url: String::new(),
        };
        let started = std::time::Instant::now();
        let ended = Supervisor::new(shell())
            .run(&plan, async {
                tokio::time::sleep(Duration::from_millis(300)).await;
                libc::SIGINT
            })
            .await
            .unwrap();
        assert_eq!(ended, Ended::Stopped);
        // SIGINT ends `sleep` at once; far less than its 30 s.
        assert!(started.elapsed() < Duration::from_secs(20));
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_process_that_never_becomes_healthy_times_out() {
        let mut config = shell();
        config.ready_timeout = Duration::from_millis(300);
        let plan = LaunchPlan {
            processes: vec![spec(Role::Attention(1), "exec sleep 30")],
            url: String::new(),
        };
        let err = Supervisor::new(config)
            .run(&plan, std::future::pending())
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("attention-1 did not become healthy"), "{err}");
    }

    /// Answers every connection with `HTTP/1.1 200`: a health check that passes.
    async fn healthy_endpoint() -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            while let Ok((mut s, _)) = listener.accept().await {
                let _ = s
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                    .await;
            }
        });
        address
    }

    fn healthy(role: Role, script: &str, address: &str) -> ProcessSpec {
        ProcessSpec {
            role,
            args: vec!["-c".into(), script.into()],
            env: Vec::new(),
            health: HealthCheck::Http {
                address: address.into(),
                path: "/health".into(),
            },
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_process_that_dies_once_up_is_started_again_with_back_off() {
        let dir = tempfile::tempdir().unwrap();
        let starts = dir.path().join("starts");
        let address = healthy_endpoint().await;
        let script = format!("echo start >> {}; sleep 0.2; exit 3", starts.display());
        let plan = LaunchPlan {
            processes: vec![healthy(Role::Card(1), &script, &address)],
            url: String::new(),
        };
        let ended = Supervisor::new(shell())
            .run(&plan, async {
                tokio::time::sleep(Duration::from_millis(2500)).await;
                libc::SIGTERM
            })
            .await
            .unwrap();
        assert_eq!(ended, Ended::Stopped);
        // Started at 0 s, again at once (~0.2 s), after 0.5 s (~0.9 s), after 1 s (~2.1 s):
        // restarted, but not in a tight loop.
        let n = std::fs::read_to_string(&starts).unwrap().lines().count();
        assert!((3..=5).contains(&n), "{n} starts");

        let mut config = shell();
        config.restart = None;
        let err = Supervisor::new(config)
            .run(&plan, std::future::pending())
            .await
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("card-1") && err.contains("exit status: 3"),
            "{err}"
        );
    }

    #[tokio::test(flavor = "current_thread")]
    async fn the_signal_reaches_the_frontend_first_and_the_cards_last() {
        let dir = tempfile::tempdir().unwrap();
        let order = dir.path().join("order");
        let address = healthy_endpoint().await;
        // Each records the signal it got, the frontend taking a while to drain.
        let script = |name: &str, drain: &str| {
            format!(
                "trap 'echo {name} TERM >> {f}; sleep {drain}; exit 0' TERM; \
                 trap 'echo {name} INT >> {f}; exit 0' INT; \
                 while :; do sleep 0.05; done",
                f = order.display()
            )
        };
        let plan = LaunchPlan {
            processes: vec![
                healthy(Role::Card(0), &script("card", "0"), &address),
                healthy(Role::Attention(0), &script("attention", "0"), &address),
                healthy(Role::Frontend, &script("frontend", "0.3"), &address),
            ],
            url: String::new(),
        };
        Supervisor::new(shell())
            .run(&plan, async {
                tokio::time::sleep(Duration::from_millis(500)).await;
                libc::SIGTERM
            })
            .await
            .unwrap();
        let got = std::fs::read_to_string(&order).unwrap();
        assert_eq!(got, "frontend TERM\nattention TERM\ncard TERM\n");
    }
}
