//! `afd attention`: one attention node as its own process, connected to card processes, serving
//! the step API over gRPC for a frontend.
//!
//! Its settings come from the command line, or from a deployment file (`--deployment`), as
//! `afd up` and the Kubernetes manifests start it.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use deploy::cluster::{ClusterConfig, attention_name};
use deploy::control_plane::{self, Role};
use deploy::deployment::{Deployment, ServerSection};
use deploy::remote::connect_remote_node;
use deploy::shutdown::{CountedNode, StopSignals};
use gpu_attention::remote::AttentionService;
use jetstream::NodeIdentity;

use crate::cluster_args::NodeArgs;

/// Run one attention node against running `afd card` processes.
#[derive(Debug, clap::Args)]
pub struct AttentionArgs {
    /// Control-plane addresses of the cards, in card order (card 0 first); default, with
    /// --deployment: the file's card addresses.
    #[arg(long, value_delimiter = ',', required_unless_present = "deployment")]
    cards: Vec<String>,
    /// Address of this node's gRPC step service.
    #[arg(long, default_value = "127.0.0.1:7200")]
    listen: SocketAddr,
    /// Checkpoint folder (the same checkpoint the cards load); default, with --deployment: the
    /// file's model.
    #[arg(long, required_unless_present = "deployment")]
    model: Option<PathBuf>,
    /// Deployment file: the node settings (weight format, spill, replicas, micro-batches, wire
    /// dtype, KV cache, block size, max tokens, reply timeout) come from its sections instead of
    /// the flags below; --cards, --model, --listen, --id and --certs still apply.
    #[arg(long)]
    deployment: Option<PathBuf>,
    /// This node's index (its JetStream name is attn-<id>).
    #[arg(long, default_value_t = 0)]
    id: usize,
    /// Folder made by `afd certs` holding the cluster CA and this node's certificate.
    #[arg(long)]
    certs: PathBuf,
    /// UDP address of the JetStream data plane (default: the --listen host, any port).
    #[arg(long)]
    data_listen: Option<SocketAddr>,
    /// Seconds to keep serving steps after SIGTERM or SIGINT, until the frontend has freed
    /// every sequence this node holds; default 30, or, with --deployment, the file's
    /// `server.shutdown_timeout`. A second signal stops at once.
    #[arg(long)]
    shutdown_timeout: Option<f64>,
    #[command(flatten)]
    node: NodeArgs,
}

/// What the node is told to run: its settings, the card addresses, and its drain time.
struct Settings {
    config: ClusterConfig,
    cards: Vec<String>,
    shutdown_timeout: Duration,
}

/// The node's settings and the card addresses, from the file or the flags.
fn settings(args: &AttentionArgs) -> anyhow::Result<Settings> {
    let timeout =
        |file: f64| Duration::from_secs_f64(args.shutdown_timeout.unwrap_or(file).max(0.0));
    let Some(path) = &args.deployment else {
        let model = args
            .model
            .clone()
            .context("--model is required without --deployment")?;
        return Ok(Settings {
            config: args.node.config(model, args.cards.len()),
            cards: args.cards.clone(),
            shutdown_timeout: timeout(ServerSection::default().shutdown_timeout),
        });
    };
    let mut deployment = Deployment::load(path)?;
    if let Some(model) = &args.model {
        deployment.model.path = Some(model.clone());
        deployment.model.shape = None;
    }
    let cards = if args.cards.is_empty() {
        deployment.card_addresses()
    } else {
        args.cards.clone()
    };
    if deployment.cards.eplb && deployment.attention.nodes > 1 {
        anyhow::bail!(
            "{}: `cards.eplb` moves the experts of cards that one attention node uses, but {} \
             attention nodes share these cards; serve them from one process (`afd serve \
             --attention-nodes {}`) or set `attention.nodes = 1`",
            path.display(),
            deployment.attention.nodes,
            deployment.attention.nodes
        );
    }
    let mut config = deployment
        .cluster_config()
        .with_context(|| format!("the node settings of {}", path.display()))?;
    config.cards = cards.len();
    Ok(Settings {
        config,
        cards,
        shutdown_timeout: timeout(deployment.server.shutdown_timeout),
    })
}

/// After the drain, how long the step service may take to close its connections.
const CLOSE_GRACE: Duration = Duration::from_secs(2);

pub fn run(args: AttentionArgs) -> anyhow::Result<()> {
    let Settings {
        config,
        cards,
        shutdown_timeout,
    } = settings(&args)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let data_listen = args
        .data_listen
        .unwrap_or(SocketAddr::new(args.listen.ip(), 0));
    let (node, targets) =
        connect_remote_node(&config, args.id, &cards, &args.certs, data_listen, &runtime)
            .with_context(|| {
                format!(
                    "connecting attention node {} to the cards {}",
                    args.id,
                    cards.join(",")
                )
            })?;
    let node: Box<dyn step::AttentionNode> = match config.eplb {
        // This process moves the experts of its cards: they must serve no other node.
        Some(settings) => deploy::eplb::start(settings, targets, vec![node])
            .context("starting --eplb")?
            .nodes
            .pop()
            .context("--eplb returned no node")?,
        None => Box::new(node),
    };
    let kv = node.kv_capacity();
    let identity = NodeIdentity::read_pem(&args.certs, &attention_name(args.id))
        .with_context(|| format!("reading attn-{}'s certificate", args.id))?;
    let node = CountedNode::new(node);
    let live = node.live();
    let service = AttentionService::new(Box::new(node)).into_server();
    let id = args.id;
    runtime
        .block_on(async {
            let mut signals = StopSignals::install()?;
            let incoming = control_plane::incoming(args.listen, &identity).await?;
            eprintln!(
                "attention node {id} serving {} on {} with {} cards; computing on {}, KV cache \
                 of {} blocks of {} tokens",
                config.model.display(),
                args.listen,
                cards.len(),
                config.node.device,
                kv.num_blocks,
                kv.block_size
            );
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let server = control_plane::serve(service, Role::Frontend, incoming, async {
                let _ = stopped.await;
            });
            tokio::pin!(server);
            let signal = tokio::select! {
                served = &mut server => return served.map_err(anyhow::Error::from),
                signal = signals.recv() => signal,
            };
            eprintln!(
                "attention node {id}: {signal}: serving the {} sequence(s) it holds until the \
                 frontend frees them, up to {:.0} s",
                live.count(),
                shutdown_timeout.as_secs_f64()
            );
            let deadline = tokio::time::Instant::now() + shutdown_timeout;
            let mut poll = tokio::time::interval(Duration::from_millis(50));
            loop {
                tokio::select! {
                    served = &mut server => return served.map_err(anyhow::Error::from),
                    _ = poll.tick() => {
                        if live.count() == 0 {
                            break;
                        }
                        if tokio::time::Instant::now() >= deadline {
                            eprintln!(
                                "attention node {id}: {} sequence(s) still held at the deadline",
                                live.count()
                            );
                            break;
                        }
                    }
                    signal = signals.recv() => {
                        eprintln!("attention node {id}: {signal} again: stopping now");
                        break;
                    }
                }
            }
            let _ = stop.send(());
            // A client that keeps its connection open must not hold the exit.
            match tokio::time::timeout(CLOSE_GRACE, &mut server).await {
                Ok(served) => served.map_err(anyhow::Error::from),
                Err(_) => Ok(()),
            }
        })
        .with_context(|| format!("serving the step API on {}", args.listen))?;
    eprintln!("attention node {id}: stopped");
    Ok(())
}
