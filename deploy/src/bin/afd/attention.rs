//! `afd attention`: one attention node as its own process, connected to card processes, serving
//! the step API over gRPC for a frontend.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use deploy::remote::connect_remote_node;
use gpu_attention::remote::AttentionService;

use crate::cluster_args::NodeArgs;

/// Run one attention node against running `afd card` processes.
#[derive(Debug, clap::Args)]
pub struct AttentionArgs {
    /// Control-plane addresses of the cards, in card order (card 0 first).
    #[arg(long, value_delimiter = ',', required = true)]
    cards: Vec<String>,
    /// Address of this node's gRPC step service.
    #[arg(long, default_value = "127.0.0.1:7200")]
    listen: SocketAddr,
    /// Checkpoint folder (the same checkpoint the cards load).
    #[arg(long)]
    model: PathBuf,
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

pub fn run(args: AttentionArgs) -> anyhow::Result<()> {
    let config = args.node.config(args.model.clone(), args.cards.len());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let data_listen = args
        .data_listen
        .unwrap_or(SocketAddr::new(args.listen.ip(), 0));
    let node = connect_remote_node(
        &config,
        args.id,
        &args.cards,
        &args.certs,
        data_listen,
        &runtime,
    )
    .with_context(|| {
        format!(
            "connecting attention node {} to the cards {}",
            args.id,
            args.cards.join(",")
        )
    })?;
    eprintln!(
        "attention node {} serving {} on {} with {} cards",
        args.id,
        args.model.display(),
        args.listen,
        args.cards.len()
    );
    let service = AttentionService::new(Box::new(node)).into_server();
    runtime
        .block_on(async {
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_shutdown(args.listen, async {
                    let _ = tokio::signal::ctrl_c().await;
                })
                .await
        })
        .with_context(|| format!("serving the step API on {}", args.listen))
}
