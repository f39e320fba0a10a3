//! `afd up`: every process of a deployment on this machine (cards, attention nodes, the
//! frontend), each started once the one before it is healthy, their output prefixed by role, a
//! process that dies started again with back-off, all stopped in order on Ctrl-C or SIGTERM.
//!
//! [`plan`] and [`restart`] are the deterministic core (which processes, with which arguments,
//! probed how; when to start one again, in which order to stop them); [`supervisor`] is the
//! async shell that runs them; [`launch`] ties them to a deployment file (ports, TLS material,
//! signals).

pub mod health;
pub mod plan;
pub mod restart;
pub mod supervisor;

use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;

pub use plan::{Addresses, HealthCheck, LaunchFiles, LaunchPlan, ProcessSpec, Role};
pub use restart::RestartPolicy;
pub use supervisor::{Ended, Supervisor, SupervisorConfig};

use crate::deployment::Deployment;
use crate::error::{Error, Result};

/// What `afd up` is asked to do.
#[derive(Debug, Clone)]
pub struct UpOptions {
    /// The deployment file.
    pub file: PathBuf,
    /// Ignore the file's ports and listen on free ports of 127.0.0.1 (several deployments on
    /// one machine, tests).
    pub free_ports: bool,
    /// The frontend's address instead of `server.host`.
    pub host: Option<String>,
    /// The frontend's port instead of `server.port` (0: a free one).
    pub port: Option<u16>,
    /// Starting and stopping.
    pub supervisor: SupervisorConfig,
}

/// A free TCP port on `ip`, by binding port 0 and letting it go. Another program could take it
/// before the child binds it; on a development machine that is rare, and the child then fails
/// with a clear "address in use".
fn free_port(ip: std::net::IpAddr) -> Result<u16> {
    TcpListener::bind(SocketAddr::new(ip, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(Error::system(format!("cannot find a free port on {ip}")))
}

/// Where the processes of `d` listen, after the command line's overrides.
pub fn addresses(d: &Deployment, options: &UpOptions) -> Result<Addresses> {
    let mut d = d.clone();
    if let Some(host) = &options.host {
        d.server.host = host.clone();
    }
    if let Some(port) = options.port {
        d.server.port = port;
    }
    if options.free_ports {
        let loopback = std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);
        let pick = || free_port(loopback).map(|p| SocketAddr::new(loopback, p));
        let cards = (0..d.cards.count).map(|_| pick()).collect::<Result<_>>()?;
        let attention = (0..d.attention.nodes)
            .map(|_| pick())
            .collect::<Result<_>>()?;
        // The frontend keeps an explicit --host / --port; the rest is free.
        let host = match &options.host {
            Some(host) => host.parse().map_err(|_| {
                Error::Config(format!(
                    "--host {host}: `afd up` listens on this machine and needs an IP address"
                ))
            })?,
            None => loopback,
        };
        let port = match options.port {
            Some(port) if port != 0 => port,
            _ => free_port(host)?,
        };
        return Ok(Addresses {
            cards,
            attention,
            frontend: SocketAddr::new(host, port),
        });
    }
    let mut addresses = Addresses::from_deployment(&d)?;
    if addresses.frontend.port() == 0 {
        addresses
            .frontend
            .set_port(free_port(addresses.frontend.ip())?);
    }
    Ok(addresses)
}

/// Resolves on Ctrl-C (SIGINT) or SIGTERM, with the signal (which `afd up` passes on).
async fn stop_requested() -> libc::c_int {
    use tokio::signal::unix::{SignalKind, signal};
    let sig = match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => libc::SIGINT,
                _ = term.recv() => libc::SIGTERM,
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
            libc::SIGINT
        }
    };
    eprintln!(
        "[up] stop requested; stopping the frontend, then the attention nodes, then the cards"
    );
    sig
}

/// Starts a small shell that removes `dir` when this process dies, by any means (the kernel
/// sends it SIGTERM then: `PR_SET_PDEATHSIG`, set before exec, fires when the spawning thread
/// exits, so call this from the thread that outlives the launch). Dropping the handle stops it.
#[cfg(target_os = "linux")]
fn remove_when_this_process_dies(dir: &std::path::Path) -> Result<ReaperGuard> {
    use std::os::unix::process::CommandExt;
    // `sleep & wait`: a trapped signal interrupts `wait` at once, not after the sleep. The
    // shell says "armed" once its trap is set: a SIGTERM before that would end it without
    // removing anything, so no key is written until the line has come.
    let script = r#"trap 'rm -rf -- "$0"; kill $! 2>/dev/null; exit 0' TERM
echo armed
while :; do sleep 3600 & wait; done"#;
    let parent = std::process::id();
    let mut command = std::process::Command::new("/bin/sh");
    command
        .arg("-c")
        .arg(script)
        .arg(dir)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null());
    // SAFETY: prctl(PR_SET_PDEATHSIG) and getppid only set or read attributes of the calling
    // process; both are async-signal-safe, as required between fork and exec.
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() as u32 != parent {
                return Err(std::io::Error::other("the launcher exited while starting"));
            }
            Ok(())
        });
    }
    let mut child = command.spawn().map_err(Error::system(
        "cannot start the shell that removes the certificate folder if afd up is killed",
    ))?;
    let mut line = String::new();
    if let Some(stdout) = child.stdout.take() {
        use std::io::BufRead;
        // EOF (the shell died) leaves the line empty, which is refused below.
        let _ = std::io::BufReader::new(stdout).read_line(&mut line);
    }
    // The guard stops the shell on the error path too.
    let guard = ReaperGuard(Some(child));
    if line.trim() != "armed" {
        return Err(Error::system(
            "the shell that removes the certificate folder if afd up is killed did not start",
        )(std::io::Error::other(
            "/bin/sh ended before setting its trap",
        )));
    }
    Ok(guard)
}

#[cfg(not(target_os = "linux"))]
fn remove_when_this_process_dies(_dir: &std::path::Path) -> Result<ReaperGuard> {
    Ok(ReaperGuard(None))
}

/// The reaper shell (none off Linux); stopped with SIGTERM when dropped, so that it removes
/// the folder (already gone by then) and exits.
struct ReaperGuard(Option<std::process::Child>);

impl Drop for ReaperGuard {
    fn drop(&mut self) {
        if let Some(child) = self.0.as_mut() {
            // SAFETY: kill(2) has no memory effects; the child is not reaped yet, so its pid
            // is still its own.
            unsafe {
                libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
            }
            let _ = child.wait();
        }
    }
}

/// Loads the deployment, makes TLS material when the file names none, and runs every process
/// until Ctrl-C / SIGTERM (then `Ok`) or until one of them dies (then `Err` naming it).
pub fn launch(options: &UpOptions) -> Result<Ended> {
    let deployment = Deployment::load(&options.file)?;
    let addresses = addresses(&deployment, options)?;
    // Attention nodes read the file themselves; an absolute path survives any working folder.
    let file = std::path::absolute(&options.file).map_err(Error::system(format!(
        "cannot make {} absolute",
        options.file.display()
    )))?;
    let (certs, _scratch) = match &deployment.transport.tls_dir {
        Some(dir) => (dir.clone(), None),
        None => {
            let scratch = tempfile::Builder::new()
                .prefix("afd-up-certs-")
                .tempdir()
                .map_err(Error::system("cannot make a folder for certificates"))?;
            // Private keys: the folder goes with the launcher however it ends. Drop removes it
            // on a return (Ctrl-C and SIGTERM return too); a reaper removes it when the
            // launcher is killed outright, which runs no code of its own.
            let reaper = remove_when_this_process_dies(scratch.path())?;
            jetstream::write_cluster(scratch.path(), &addresses.tls_names())?;
            (scratch.path().to_path_buf(), Some((scratch, reaper)))
        }
    };
    let plan = plan::plan(
        &deployment,
        &addresses,
        &LaunchFiles {
            deployment: file,
            certs: certs.clone(),
        },
    )?;
    eprintln!(
        "[up] {}: {} card(s), {} attention node(s), frontend at {}; TLS material in {}",
        options.file.display(),
        deployment.cards.count,
        deployment.attention.nodes,
        plan.url,
        certs.display()
    );
    // Current-thread runtime: every child is started from the main thread, which lives as long
    // as the launch (children die with the thread that started them).
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(Error::system("cannot start the launcher's runtime"))?;
    let supervisor = Supervisor::new(options.supervisor.clone());
    runtime.block_on(supervisor.run(&plan, stop_requested()))
}
