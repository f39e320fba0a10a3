//! The step API over tonic: [`AttentionService`] serves any [`AttentionNode`] to remote
//! routers; [`RemoteNode`] is a router's handle on such a node and implements the same trait.

use std::sync::{Arc, Mutex};

use model::sampling::SamplingParams;
use proto::control::attention_client::AttentionClient;
use proto::control::attention_server::{Attention, AttentionServer};
use proto::control::{self as pb};
use tonic::{Request, Response, Status};

use step::{
    AttentionNode, KvCapacity, Penalties, SampleRequest, SampledToken, SeqId, StepBatch, StepEntry,
    StepError, StepOutput,
};

/// Step batches to and from their wire form.
pub mod convert {
    use super::*;

    /// Wire form of a batch.
    pub fn batch_to_pb(batch: &StepBatch) -> pb::StepRequest {
        pb::StepRequest {
            entries: batch
                .entries
                .iter()
                .map(|e| pb::StepEntry {
                    seq: e.seq,
                    tokens: e.tokens.clone(),
                    start: e.start as u32,
                    prompt_len: e.prompt_len as u32,
                    block_table: e.block_table.clone(),
                    sample: e.sample.map(|s| pb::SamplingParams {
                        temperature: s.params.temperature,
                        top_p: s.params.top_p,
                        top_k: s.params.top_k as u32,
                        min_p: s.params.min_p,
                        seed: s.params.seed,
                        presence_penalty: s.penalties.presence,
                        frequency_penalty: s.penalties.frequency,
                        repetition_penalty: s.penalties.repetition,
                        top_logprobs: s.top_logprobs as u32,
                        logprobs: s.logprobs,
                    }),
                })
                .collect(),
        }
    }

    /// A batch from its wire form.
    pub fn batch_from_pb(request: pb::StepRequest) -> StepBatch {
        StepBatch {
            entries: request
                .entries
                .into_iter()
                .map(|e| StepEntry {
                    seq: e.seq,
                    tokens: e.tokens,
                    start: e.start as usize,
                    prompt_len: e.prompt_len as usize,
                    block_table: e.block_table,
                    sample: e.sample.map(|s| SampleRequest {
                        params: SamplingParams {
                            temperature: s.temperature,
                            top_p: s.top_p,
                            top_k: s.top_k as usize,
                            min_p: s.min_p,
                            seed: s.seed,
                        },
                        penalties: Penalties {
                            presence: s.presence_penalty,
                            frequency: s.frequency_penalty,
                            repetition: s.repetition_penalty,
                        },
                        logprobs: s.logprobs,
                        top_logprobs: s.top_logprobs as usize,
                    }),
                })
                .collect(),
        }
    }

    /// Wire form of an output.
    pub fn output_to_pb(out: StepOutput) -> pb::StepReply {
        pb::StepReply {
            sampled: out
                .sampled
                .into_iter()
                .map(|t| pb::SampledToken {
                    seq: t.seq,
                    token: t.token,
                    logprob: t.logprob,
                    top_logprobs: t
                        .top_logprobs
                        .into_iter()
                        .map(|(token, logprob)| pb::TokenLogprob { token, logprob })
                        .collect(),
                })
                .collect(),
        }
    }

    /// An output from its wire form.
    pub fn output_from_pb(reply: pb::StepReply) -> StepOutput {
        StepOutput {
            sampled: reply
                .sampled
                .into_iter()
                .map(|t| SampledToken {
                    seq: t.seq,
                    token: t.token,
                    logprob: t.logprob,
                    top_logprobs: t
                        .top_logprobs
                        .into_iter()
                        .map(|l| (l.token, l.logprob))
                        .collect(),
                })
                .collect(),
        }
    }
}

/// Serves one attention node over gRPC. Steps run on a blocking thread, one at a time.
pub struct AttentionService {
    node: Arc<Mutex<Box<dyn AttentionNode>>>,
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
    }
}

#[tonic::async_trait]
impl Attention for AttentionService {
    async fn health(
        &self,
        _r: Request<pb::HealthRequest>,
    ) -> Result<Response<pb::HealthReply>, Status> {
        Ok(Response::new(pb::HealthReply {
            ready: true,
            status: "serving".into(),
            model_fingerprint: String::new(),
        }))
    }

    async fn kv_capacity(
        &self,
        _r: Request<pb::KvCapacityRequest>,
    ) -> Result<Response<pb::KvCapacityReply>, Status> {
        let c = self.with_node(|n| n.kv_capacity()).await?;
        Ok(Response::new(pb::KvCapacityReply {
            block_size: c.block_size as u32,
            num_blocks: c.num_blocks as u32,
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
    address: String,
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
    /// Connects to the node at `address` (`http://host:port`); call from a plain thread, with a
    /// handle of the runtime that will drive the gRPC channel.
    pub fn connect(address: &str, runtime: tokio::runtime::Handle) -> Result<Self, StepError> {
        let endpoint = tonic::transport::Endpoint::from_shared(address.to_owned())
            .map_err(|e| unavailable(address, e))?;
        let mut client = runtime
            .block_on(AttentionClient::connect(endpoint))
            .map_err(|e| unavailable(address, e))?;
        let c = runtime
            .block_on(client.kv_capacity(pb::KvCapacityRequest {}))
            .map_err(|s| from_status(address, s))?
            .into_inner();
        Ok(RemoteNode {
            client,
            runtime,
            capacity: KvCapacity {
                block_size: c.block_size as usize,
                num_blocks: c.num_blocks as usize,
            },
            address: address.to_owned(),
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
}
