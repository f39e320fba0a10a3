//! The step API over tonic: [`AttentionService`] serves any [`AttentionNode`] to remote
//! routers; [`RemoteNode`] is a router's handle on such a node and implements the same trait.

use std::sync::{Arc, Mutex};

use proto::control::attention_client::AttentionClient;
use proto::control::attention_server::{Attention, AttentionServer};
use proto::control::{self as pb};
use tonic::{Request, Response, Status};

use step::{
    AttentionNode, HealthSource, InvalidStep, KvCapacity, ModelFailure, SeqId, StepBatch,
    StepError, StepOutput,
};

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
        StepError::Invalid(m) => Status::invalid_argument(m.to_string()),
        StepError::Card { .. } | StepError::NoReply { .. } | StepError::Unavailable { .. } => {
            Status::unavailable(e.to_string())
        }
        StepError::Model(m) => Status::internal(m.to_string()),
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
        let batch = convert::batch_from_pb(r.into_inner()).map_err(status)?;
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
    StepError::Unavailable {
        address: address.to_string(),
        reason: e.to_string(),
    }
}

fn from_status(address: &str, s: Status) -> StepError {
    match s.code() {
        tonic::Code::InvalidArgument => InvalidStep::Remote(s.message().to_owned()).into(),
        tonic::Code::Internal => ModelFailure::Remote(s.message().to_owned()).into(),
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
        let request = convert::batch_to_pb(batch)?;
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use model::sampling::SamplingParams;
    use step::{AllowedTokens, SampleRequest, SampledToken, StepEntry, TokenMask};
    use tonic::transport::server::TcpIncoming;

    use super::*;

    /// Answers each sampling row with its lowest allowed token (0 without a mask), and the
    /// mask's length as the logprob.
    struct LowestAllowed;

    impl AttentionNode for LowestAllowed {
        fn kv_capacity(&self) -> KvCapacity {
            KvCapacity {
                block_size: 4,
                num_blocks: 8,
            }
        }

        fn step(&mut self, batch: &StepBatch) -> Result<StepOutput, StepError> {
            let mut out = StepOutput::default();
            for e in &batch.entries {
                let Some(s) = &e.sample else { continue };
                let (token, len) = match s.allowed_mask(e.seq)? {
                    None => (0, 0),
                    Some(mask) => (mask.iter().next().unwrap_or(0), mask.len()),
                };
                out.sampled.push(SampledToken {
                    seq: e.seq,
                    token,
                    logprob: len as f32,
                    top_logprobs: Vec::new(),
                });
            }
            Ok(out)
        }

        fn free(&mut self, _seqs: &[SeqId]) -> Result<(), StepError> {
            Ok(())
        }
    }

    /// A router's constrained rows reach a remote node with their masks, waited for on the
    /// router's side (a mask filled a little later still goes); a mask that failed fails the
    /// step before it is sent.
    #[test]
    fn masks_cross_the_wire_to_a_remote_node() {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let incoming = runtime
            .block_on(async { TcpIncoming::bind("127.0.0.1:0".parse().unwrap()) })
            .unwrap();
        let address = incoming.local_addr().unwrap();
        let service = AttentionService::new(Box::new(LowestAllowed)).into_server();
        runtime.spawn(
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(incoming),
        );
        let channel = runtime
            .block_on(
                tonic::transport::Endpoint::from_shared(format!("http://{address}"))
                    .unwrap()
                    .connect(),
            )
            .unwrap();
        let mut node =
            RemoteNode::new(channel, &address.to_string(), runtime.handle().clone()).unwrap();
        let entry = |seq: SeqId, allowed: Option<AllowedTokens>| StepEntry {
            seq,
            tokens: vec![1],
            start: 0,
            prompt_len: 1,
            block_table: vec![0],
            sample: Some(SampleRequest {
                params: SamplingParams::greedy(),
                penalties: Default::default(),
                logprobs: true,
                top_logprobs: 0,
                allowed,
            }),
            cached_prefix: Vec::new(),
            prompt_logprobs: None,
        };
        let later = AllowedTokens::pending();
        let filler = later.clone();
        let fill = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            filler.fill(Ok(TokenMask::from_tokens(300, [77, 250])));
        });
        let out = node
            .step(&StepBatch {
                entries: vec![
                    entry(1, None),
                    entry(2, Some(later)),
                    entry(
                        3,
                        Some(AllowedTokens::ready(TokenMask::from_tokens(65, [64]))),
                    ),
                ],
            })
            .unwrap();
        fill.join().unwrap();
        let got: Vec<(u32, f32)> = out.sampled.iter().map(|s| (s.token, s.logprob)).collect();
        assert_eq!(got, vec![(0, 0.0), (77, 300.0), (64, 65.0)]);

        let failed = AllowedTokens::pending();
        failed.fill(Err("the grammar broke".into()));
        let err = node
            .step(&StepBatch {
                entries: vec![entry(4, Some(failed))],
            })
            .unwrap_err();
        assert!(
            matches!(&err, StepError::Model(ModelFailure::Mask { reason, .. }) if reason.contains("the grammar broke")),
            "{err}"
        );
        drop(node);
        runtime.shutdown_timeout(Duration::from_secs(1));
    }
}
