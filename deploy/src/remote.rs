//! Reaching cards that run as their own processes (`afd card`), through their gRPC control
//! plane, and connecting an attention node to them.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use gpu_attention::DisaggregatedNode;
use jetstream::{EndpointRuntime, NodeIdentity, QuicConfig, QuicTransport};
use model::ModelConfig;
use model::weights::ExpertFilter;
use proto::control::card_client::CardClient;
use proto::control::{
    HealthReply, HealthRequest, LoadShardReply, LoadShardRequest, ReleaseShardsReply,
    ReleaseShardsRequest, StageShardReply, StageShardRequest,
};

use crate::cluster::{
    CardControl, ClusterConfig, NodeTransport, attention_name, card_name, connect_node, fingerprint,
};
use crate::control_plane;
use crate::eplb::{MoveTargets, ShardBook};
use crate::error::{Error, Result};
use crate::watch::HeartbeatError;

/// A card process, reached over gRPC.
pub struct GrpcCard {
    index: usize,
    address: String,
    client: CardClient<tonic::transport::Channel>,
    runtime: tokio::runtime::Handle,
}

impl std::fmt::Debug for GrpcCard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrpcCard")
            .field("address", &self.address)
            .finish()
    }
}

/// `host:port` or a full URL, as a gRPC endpoint URL.
pub fn grpc_url(address: &str) -> String {
    if address.starts_with("http://") || address.starts_with("https://") {
        address.to_owned()
    } else {
        format!("http://{address}")
    }
}

impl GrpcCard {
    /// Connects to card `index` at `address` as `identity` (an attention node's), over the
    /// control plane's TLS (from a plain thread).
    pub fn connect(
        index: usize,
        address: &str,
        identity: &NodeIdentity,
        runtime: tokio::runtime::Handle,
    ) -> Result<Self> {
        let url = grpc_url(address);
        let channel = runtime
            .block_on(control_plane::connect(&url, &card_name(index), identity))
            .map_err(|e| Error::CardUnreachable {
                card: index,
                source: Box::new(e),
            })?;
        let client = CardClient::new(channel);
        Ok(GrpcCard {
            index,
            address: url,
            client,
            runtime,
        })
    }
}

impl CardControl for GrpcCard {
    fn load_shard(&self, request: LoadShardRequest) -> Result<LoadShardReply> {
        let mut client = self.client.clone();
        self.runtime
            .block_on(client.load_shard(request))
            .map(|r| r.into_inner())
            .map_err(|s| Error::Card {
                card: self.index,
                message: s.message().to_owned(),
            })
    }

    fn stage_shard(&self, request: StageShardRequest) -> Result<StageShardReply> {
        let mut client = self.client.clone();
        self.runtime
            .block_on(client.stage_shard(request))
            .map(|r| r.into_inner())
            .map_err(|s| Error::Card {
                card: self.index,
                message: s.message().to_owned(),
            })
    }

    fn release_shards(&self, request: ReleaseShardsRequest) -> Result<ReleaseShardsReply> {
        let mut client = self.client.clone();
        self.runtime
            .block_on(client.release_shards(request))
            .map(|r| r.into_inner())
            .map_err(|s| Error::Card {
                card: self.index,
                message: s.message().to_owned(),
            })
    }

    fn health(&self, timeout: Duration) -> std::result::Result<HealthReply, HeartbeatError> {
        let mut client = self.client.clone();
        let answer = self.runtime.block_on(async move {
            tokio::time::timeout(timeout, client.health(HealthRequest {})).await
        });
        match answer {
            Ok(Ok(reply)) => Ok(reply.into_inner()),
            // The channel could not connect or lost the connection: nothing listens there.
            Ok(Err(status)) if status.code() == tonic::Code::Unavailable => Err(
                HeartbeatError::Unreachable(format!("{}: {}", self.address, status.message())),
            ),
            Ok(Err(status)) => Err(HeartbeatError::TimedOut(format!(
                "{}: {}",
                self.address,
                status.message()
            ))),
            Err(_) => Err(HeartbeatError::TimedOut(format!(
                "{} did not answer within {timeout:?}",
                self.address
            ))),
        }
    }
}

/// Connects attention node `id` (JetStream name `attn-<id>`, identity from `certs`) to the
/// card processes at `card_addresses` and returns it. The node's QUIC endpoint listens on
/// `data_listen`.
pub fn connect_remote_node(
    config: &ClusterConfig,
    id: usize,
    card_addresses: &[String],
    certs: &Path,
    data_listen: std::net::SocketAddr,
    runtime: &tokio::runtime::Runtime,
) -> Result<(DisaggregatedNode, MoveTargets)> {
    let model = ModelConfig::from_file(&config.model.join("config.json"))?;
    let print = fingerprint(&config.model)?;
    let book = Arc::new(ShardBook::new(config.assignments(
        &model,
        card_addresses.len(),
        None,
    )?));
    let identity = NodeIdentity::read_pem(certs, &attention_name(id))?;
    let cards: Vec<Arc<dyn CardControl>> = card_addresses
        .iter()
        .enumerate()
        .map(|(i, a)| {
            GrpcCard::connect(i, a, &identity, runtime.handle().clone())
                .map(|c| Arc::new(c) as Arc<dyn CardControl>)
        })
        .collect::<Result<_>>()?;
    // The node's endpoint runs on a runtime of its own, driven by the node's thread whenever
    // it sends or waits (see `EndpointRuntime`); the control plane stays on `runtime`.
    let endpoint = EndpointRuntime::new(&attention_name(id))
        .map_err(Error::system("cannot start the node endpoint's runtime"))?;
    let transport = {
        let _guard = endpoint.enter();
        Arc::new(QuicTransport::bind(QuicConfig::new(identity, data_listen))?)
    };
    let weights = config.load_weights(ExpertFilter::None)?;
    let node = connect_node(
        config,
        &model,
        &weights,
        &print,
        &book,
        &cards,
        NodeTransport::Quic(transport),
        endpoint,
    )?;
    Ok((node, MoveTargets { model, cards, book }))
}

/// Connects a frontend to running `afd attention` processes at `addresses` (`host:port` or
/// URLs; the j-th is `attn-j`), in order, as `identity` (the frontend's) over the control
/// plane's TLS, retrying each for up to `patience` while it is still starting (loading weights,
/// connecting its cards). The nodes drive their gRPC channels on `runtime`; call from a plain
/// thread.
pub fn connect_attention_nodes(
    addresses: &[String],
    identity: &NodeIdentity,
    patience: std::time::Duration,
    runtime: &tokio::runtime::Runtime,
) -> Result<Vec<gpu_attention::remote::RemoteNode>> {
    let deadline = std::time::Instant::now() + patience;
    let mut nodes = Vec::with_capacity(addresses.len());
    for (j, address) in addresses.iter().enumerate() {
        let url = grpc_url(address);
        let node = loop {
            let attempt = runtime
                .block_on(control_plane::connect(&url, &attention_name(j), identity))
                .map_err(|e| step::StepError::Unavailable {
                    address: address.clone(),
                    reason: e.to_string(),
                })
                .and_then(|channel| {
                    gpu_attention::remote::RemoteNode::new(channel, &url, runtime.handle().clone())
                });
            match attempt {
                Ok(node) => break node,
                Err(e) if std::time::Instant::now() >= deadline => {
                    return Err(Error::Config(format!(
                        "{e}; is `afd attention --listen {address}` running and connected to its \
                         cards? (gave up after {:.0} s)",
                        patience.as_secs_f64()
                    )));
                }
                Err(_) => std::thread::sleep(std::time::Duration::from_millis(200)),
            }
        };
        nodes.push(node);
    }
    Ok(nodes)
}
