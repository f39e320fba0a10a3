//! The step API over tonic: [`AttentionService`] serves any [`AttentionNode`] to remote
//! routers; [`RemoteNode`] is a router's handle on such a node and implements the same trait.

use std::sync::{Arc, Mutex};

use proto::control::attention_client::AttentionClient;
use proto::control::attention_server::{Attention, AttentionServer};
use proto::control::{self as pb};
use tonic::{Request, Response, Status};

use step::{AttentionNode, HealthSource, KvCapacity, SeqId, StepBatch, StepError, StepOutput};

pub mod convert;
mod health;

/// Serves one attention node over gRPC. Steps run on a blocking thread, one at a time.
pub struct AttentionService {
    node: Arc<Mutex<Box<dyn AttentionNode>>>,
    health: Option<Arc<dyn HealthSource>>,
}

impl std::fmt::Debug for AttentionService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AttentionService")
    }
}

impl AttentionService {
    /// Serves `node`.
    pub fn new(node: Box<dyn AttentionNode>) -> Self {
        AttentionService {
            health: node.health_source(),
            node: Arc::new(Mutex::new(node)),
        }
    }

    /// As a tonic server.
    pub fn into_server(self) -> AttentionServer<Self> {
        AttentionServer::new(self)
    }

    async fn with_node<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut dyn AttentionNode) -> R + Send + 'static,
    ) -> Result<R, Status> {
        let node = self.node.clone();
        tokio::task::spawn_blocking(move || {
            let mut guard = node.lock().unwrap_or_else(|p| p.into_inner());
            f(guard.as_mut())
        })
        .await
        .map_err(|e| Status::internal(format!("the attention node panicked: {e}")))
    }
}

fn status(e: StepError) -> Status {
    match e {
        StepError::Invalid(m) => Status::invalid_argument(m),
        StepError::Card { .. } | StepError::NoReply { .. } | StepError::Unavailable(_) => {
            Status::unavailable(e.to_string())
        }
        StepError::Model(m) => Status::internal(m),
        // The cause crosses the wire as text; the other side reads it back as `Model`.
        StepError::Compute(source) => Status::internal(source.to_string()),
    }
}

#[tonic::async_trait]
impl Attention for AttentionService {
    async fn health(
        &self,
        _r: Request<pb::HealthRequest>,
    ) -> Result<Response<pb::HealthReply>, Status> {
        let health = self.health.as_ref().map(|h| h.health()).unwrap_or_default();
        Ok(Response::new(convert::health_to_pb(&health)))
    }

    async fn kv_capacity(
        &self,
        _r: Request<pb::KvCapacityRequest>,
    ) -> Result<Response<pb::KvCapacityReply>, Status> {
        let (c, shares) = self
            .with_node(|n| (n.kv_capacity(), n.shares_kv_blocks()))
            .await?;
        Ok(Response::new(pb::KvCapacityReply {
            block_size: c.block_size as u32,
            num_blocks: c.num_blocks as u32,
            shares_kv_blocks: shares,
        }))
    }

    async fn step(&self, r: Request<pb::StepRequest>) -> Result<Response<pb::StepReply>, Status> {
        let batch = convert::batch_from_pb(r.into_inner());
        let out = self
            .with_node(move |n| n.step(&batch))
            .await?
            .map_err(status)?;
        Ok(Response::new(convert::output_to_pb(out)))
    }

    async fn free(&self, r: Request<pb::FreeRequest>) -> Result<Response<pb::FreeReply>, Status> {
        let seqs = r.into_inner().seqs;
        self.with_node(move |n| n.free(&seqs))
            .await?
            .map_err(status)?;
        Ok(Response::new(pb::FreeReply {}))
    }

    async fn stats(
        &self,
        _r: Request<pb::StatsRequest>,
    ) -> Result<Response<pb::AttentionStats>, Status> {
        Ok(Response::new(pb::AttentionStats::default()))
    }
}

/// A remote attention node, driven through its gRPC service from a blocking thread.
pub struct RemoteNode {
    client: AttentionClient<tonic::transport::Channel>,
    runtime: tokio::runtime::Handle,
    capacity: KvCapacity,
    shares_kv_blocks: bool,
    address: String,
    health: Arc<health::RemoteHealth>,
    /// The task that keeps `health` current; stopped with the node.
    poll: tokio::task::JoinHandle<()>,
}

impl Drop for RemoteNode {
    fn drop(&mut self) {
        self.poll.abort();
    }
}

impl std::fmt::Debug for RemoteNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteNode")
            .field("address", &self.address)
            .finish()
    }
}

fn unavailable(address: &str, e: impl std::fmt::Display) -> StepError {
    StepError::Unavailable(format!("attention node at {address}: {e}"))
}

fn from_status(address: &str, s: Status) -> StepError {
    match s.code() {
        tonic::Code::InvalidArgument => StepError::Invalid(s.message().to_owned()),
        tonic::Code::Internal => StepError::Model(s.message().to_owned()),
        _ => unavailable(address, s.message()),
    }
}

impl RemoteNode {
    /// Drives the node at `address` (for messages) over `channel` (connected by the caller,
    /// with the control plane's TLS); call from a plain thread, with a handle of the runtime
    /// that drives the channel.
    pub fn new(
        channel: tonic::transport::Channel,
        address: &str,
        runtime: tokio::runtime::Handle,
    ) -> Result<Self, StepError> {
        let mut client = AttentionClient::new(channel);
        let c = runtime
            .block_on(client.kv_capacity(pb::KvCapacityRequest {}))
            .map_err(|s| from_status(address, s))?
            .into_inner();
        let health = Arc::new(health::RemoteHealth::default());
        let poll = runtime.spawn(health::poll(
            client.clone(),
            health.clone(),
            address.to_owned(),
        ));
        Ok(RemoteNode {
            client,
            runtime,
            capacity: KvCapacity {
                block_size: c.block_size as usize,
                num_blocks: c.num_blocks as usize,
            },
            shares_kv_blocks: c.shares_kv_blocks,
            address: address.to_owned(),
            health,
            poll,
        })
    }
}

impl AttentionNode for RemoteNode {
    fn kv_capacity(&self) -> KvCapacity {
        self.capacity
    }

    fn step(&mut self, batch: &StepBatch) -> Result<StepOutput, StepError> {
        let mut client = self.client.clone();
        let request = convert::batch_to_pb(batch);
        let reply = self
            .runtime
            .block_on(client.step(request))
            .map_err(|s| from_status(&self.address, s))?;
        Ok(convert::output_from_pb(reply.into_inner()))
    }

    fn free(&mut self, seqs: &[SeqId]) -> Result<(), StepError> {
        let mut client = self.client.clone();
        self.runtime
            .block_on(client.free(pb::FreeRequest {
                seqs: seqs.to_vec(),
            }))
            .map_err(|s| from_status(&self.address, s))?;
        Ok(())
    }

    fn shares_kv_blocks(&self) -> bool {
        self.shares_kv_blocks
    }

    fn health_source(&self) -> Option<Arc<dyn HealthSource>> {
        Some(self.health.clone())
    }
}
