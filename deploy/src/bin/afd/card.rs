//! `afd card`: one simulated Corsair card as its own process: the gRPC control plane on
//! `--listen`, the JetStream data plane on `--data-listen`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, bail};
use corsair_ffn::service::grpc::CardService;
use corsair_ffn::service::{CardHost, CardHostConfig, DataPlane};
use corsair_ffn::{ExecOptions, HardwareProfile};
use deploy::control_plane::{self, Role};
use deploy::shutdown::StopSignals;
use jetstream::{EndpointRuntime, NodeIdentity, QuicConfig, QuicTransport};

/// Run one card: wait for an attention node to load a shard, then serve it.
#[derive(Debug, clap::Args)]
pub struct CardArgs {
    /// Address of the card's gRPC control plane.
    #[arg(long, default_value = "127.0.0.1:7100")]
    listen: SocketAddr,
    /// This card's index in the deployment (its JetStream name is card-<id>).
    #[arg(long)]
    id: usize,
    /// Only ever load this checkpoint (refuse attention nodes that ask for another).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Folder made by `afd certs` holding the cluster CA and this card's certificate.
    #[arg(long)]
    certs: PathBuf,
    /// UDP address of the JetStream data plane (default: the --listen host, any port).
    #[arg(long)]
    data_listen: Option<SocketAddr>,
    /// Hardware profile (TOML); default: the Corsair profile built in.
    #[arg(long)]
    profile: Option<PathBuf>,
    /// Executor threads (0: every core).
    #[arg(long, default_value_t = 0)]
    card_threads: usize,
}

pub fn run(args: CardArgs) -> anyhow::Result<()> {
    let profile = match &args.profile {
        Some(p) => HardwareProfile::from_toml(
            &std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?,
        )?,
        None => HardwareProfile::default(),
    };
    let name = format!("card-{}", args.id);
    let identity = NodeIdentity::read_pem(&args.certs, &name).with_context(|| {
        format!(
            "no certificate for {name} in {}: make them with `afd certs --out {} --nodes attn-0,{name},...`",
            args.certs.display(),
            args.certs.display()
        )
    })?;
    if let Some(m) = &args.model
        && !m.join("config.json").exists()
    {
        bail!("--model {}: no config.json there", m.display());
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let data_listen = args
        .data_listen
        .unwrap_or(SocketAddr::new(args.listen.ip(), 0));
    // The data plane runs on a runtime of its own, driven by the card's worker threads while
    // they wait and reply (see `EndpointRuntime`); the control plane stays on `runtime`.
    let endpoint = EndpointRuntime::new(&name).context("starting the data plane's runtime")?;
    let transport = {
        let _guard = endpoint.enter();
        Arc::new(QuicTransport::bind(QuicConfig::new(
            identity.clone(),
            data_listen,
        ))?)
    };
    let data_addr = transport.local_addr()?;
    let control_identity = identity;
    let host = Arc::new(CardHost::new(
        CardHostConfig {
            index: args.id,
            model: args.model.clone(),
            profile,
            exec: ExecOptions {
                threads: args.card_threads,
                ..ExecOptions::default()
            },
            // One card per process: its CPUs are its own.
            cpu_turns: None,
            // Its spans would stay in this process: only embedded cards join a trace.
            trace: false,
        },
        DataPlane::Quic(transport),
        endpoint,
    ));
    let service = CardService::new(host.clone()).into_server();
    let served = runtime.block_on(async {
        let mut signals = StopSignals::install()?;
        let incoming = control_plane::incoming(args.listen, &control_identity).await?;
        eprintln!(
            "card {} ({name}): control plane on {}, data plane on udp {data_addr}; waiting for a \
             shard",
            args.id, args.listen
        );
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = control_plane::serve(service, Role::Attention, incoming, async {
            let _ = stopped.await;
        });
        tokio::pin!(server);
        let signal = tokio::select! {
            served = &mut server => return served.map_err(anyhow::Error::from),
            signal = signals.recv() => signal,
        };
        eprintln!("card {}: {signal}: stopping", args.id);
        let _ = stop.send(());
        // An attention node that keeps its control connection open must not hold the exit.
        match tokio::time::timeout(CLOSE_GRACE, &mut server).await {
            Ok(served) => served.map_err(anyhow::Error::from),
            Err(_) => Ok(()),
        }
    });
    host.shutdown();
    served.with_context(|| format!("serving the card's control plane on {}", args.listen))
}

/// After a stop signal, how long the control plane may take to close its connections.
const CLOSE_GRACE: std::time::Duration = std::time::Duration::from_secs(2);
