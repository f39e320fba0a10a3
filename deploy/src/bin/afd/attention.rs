//! `afd attention`: one attention node as its own process, connected to card processes, serving
//! the step API over gRPC for a frontend.
//!
//! Its settings come from the command line, or from a deployment file (`--deployment`), as
//! `afd up` and the Kubernetes manifests start it.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use deploy::cluster::ClusterConfig;
use deploy::deployment::Deployment;
use deploy::remote::connect_remote_node;
use gpu_attention::remote::AttentionService;

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
    #[command(flatten)]
    node: NodeArgs,
}

/// The node's settings and the card addresses, from the file or the flags.
fn settings(args: &AttentionArgs) -> anyhow::Result<(ClusterConfig, Vec<String>)> {
    let Some(path) = &args.deployment else {
        let model = args
            .model
            .clone()
            .context("--model is required without --deployment")?;
        return Ok((
            args.node.config(model, args.cards.len()),
            args.cards.clone(),
        ));
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
    let mut config = deployment
        .cluster_config()
        .with_context(|| format!("the node settings of {}", path.display()))?;
    config.cards = cards.len();
    Ok((config, cards))
}

pub fn run(args: AttentionArgs) -> anyhow::Result<()> {
    let (config, cards) = settings(&args)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let data_listen = args
        .data_listen
        .unwrap_or(SocketAddr::new(args.listen.ip(), 0));
    let node = connect_remote_node(&config, args.id, &cards, &args.certs, data_listen, &runtime)
        .with_context(|| {
            format!(
                "connecting attention node {} to the cards {}",
                args.id,
                cards.join(",")
            )
        })?;
    eprintln!(
        "attention node {} serving {} on {} with {} cards",
        args.id,
        config.model.display(),
        args.listen,
        cards.len()
    );
    let service = AttentionService::new(Box::new(node)).into_server();
    runtime
        .block_on(async {
            tonic::transport::Server::builder()
                .add_service(service)
                // The standard gRPC health service too, for Kubernetes' grpc probes.
                .add_service(tonic_health::server::health_reporter().1)
                .serve_with_shutdown(args.listen, async {
                    let _ = tokio::signal::ctrl_c().await;
                })
                .await
        })
        .with_context(|| format!("serving the step API on {}", args.listen))
}
