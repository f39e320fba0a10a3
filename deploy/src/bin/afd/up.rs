//! `afd up FILE`: every process of a deployment on this machine until Ctrl-C or SIGTERM, a
//! process that dies started again (see `deploy::launch`).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use deploy::launch::{RestartPolicy, SupervisorConfig, UpOptions, launch};

/// Start the cards, attention nodes and frontend of a deployment file as separate processes.
#[derive(Debug, clap::Args)]
pub struct UpArgs {
    /// The deployment file (TOML).
    file: PathBuf,
    /// Ignore the file's ports and listen on free ports of 127.0.0.1.
    #[arg(long)]
    free_ports: bool,
    /// Address the frontend listens on (default: the file's `server.host`).
    #[arg(long)]
    host: Option<String>,
    /// Port the frontend listens on (default: the file's `server.port`; 0: a free one).
    #[arg(long)]
    port: Option<u16>,
    /// Seconds each process may take to become healthy.
    #[arg(long, default_value_t = 600.0)]
    ready_timeout: f64,
    /// Seconds each stage (the frontend, then the attention nodes, then the cards) may take to
    /// stop after the signal before it is killed; above the frontend's drain time.
    #[arg(long, default_value_t = 40.0)]
    stop_grace: f64,
    /// Stop the whole deployment when a process dies, instead of starting it again.
    #[arg(long)]
    no_restart: bool,
}

pub fn run(args: UpArgs) -> anyhow::Result<()> {
    let program = std::env::current_exe().context("finding the afd binary to start")?;
    let options = UpOptions {
        file: args.file.clone(),
        free_ports: args.free_ports,
        host: args.host,
        port: args.port,
        supervisor: SupervisorConfig {
            program,
            ready_timeout: Duration::from_secs_f64(args.ready_timeout.max(0.0)),
            stop_grace: Duration::from_secs_f64(args.stop_grace.max(0.0)),
            restart: (!args.no_restart).then(RestartPolicy::default),
            ..SupervisorConfig::default()
        },
    };
    launch(&options).with_context(|| format!("afd up {}", args.file.display()))?;
    eprintln!("[up] every process stopped");
    Ok(())
}
