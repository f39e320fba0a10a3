//! The card service: a [`CardHost`] loads a shard when an attention node asks (control plane),
//! then serves that node's per-layer messages from a JetStream inbox (data plane) on a worker
//! thread, writing partial sums and LM-head proposals straight back into the node's region.
//! The worker drives the card endpoint's runtime ([`jetstream::EndpointRuntime`]) while it
//! waits and replies, so its packets wake it directly rather than through an I/O thread.
//!
//! The host is transport-agnostic (QUIC or in-process) and has no gRPC in it; [`grpc`] wraps it
//! as the tonic `Card` service for multi-process deployments, and embedded deployments call it
//! directly.

mod cpu_turns;
pub mod grpc;
mod shards;
mod spans;
mod worker;

pub use cpu_turns::CpuTurns;
pub use spans::{CardSpan, ThreadUsage};

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use jetstream::{EndpointRuntime, InprocTransport, QuicTransport, RegionConfig, Transport};
use model::checkpoint::Checkpoint;
use proto::control::{
    HealthReply, LoadShardReply, LoadShardRequest, RegionDescriptor, ReleaseShardsReply,
    ReleaseShardsRequest, StageShardReply, StageShardRequest,
};

use crate::executor::ExecOptions;
use crate::profile::HardwareProfile;
use shards::{BuildContext, Shard, ShardSettings, ShardTable, build_shard};

/// Why a card refused or failed a control-plane request.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// The request is for another card, another model or another shard.
    #[error("{0}")]
    Refused(String),
    /// The request is malformed.
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The request's assignment is not a card assignment in JSON.
    #[error("invalid request: assignment is not valid JSON: {0}")]
    AssignmentJson(#[source] serde_json::Error),
    /// The request's `attention_data_addr` is not a socket address.
    #[error("invalid request: attention_data_addr: {0}")]
    AttentionAddr(#[source] std::net::AddrParseError),
    /// The checkpoint's config.json could not be read on this card's machine.
    #[error("cannot read {}: {source}; the path must name the same checkpoint on every machine", path.display())]
    ReadConfig {
        /// The config.json path.
        path: std::path::PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// The card's worker thread could not be started (the machine is out of threads or memory).
    #[error("cannot start a worker thread: {0}")]
    WorkerThread(#[source] std::io::Error),
    /// Compiling or loading failed.
    #[error(transparent)]
    Card(#[from] crate::Error),
    /// The data plane failed.
    #[error("data plane: {0}")]
    Transport(#[from] jetstream::Error),
}

/// How a card host is set up.
#[derive(Debug, Clone)]
pub struct CardHostConfig {
    /// This card's index (`--id`).
    pub index: usize,
    /// The only checkpoint this card will load, when given (`--model`); otherwise the one the
    /// first attention node names.
    pub model: Option<PathBuf>,
    /// The card's hardware profile.
    pub profile: HardwareProfile,
    /// Executor threads and kernel.
    pub exec: ExecOptions,
    /// The CPUs this card shares with other cards of the same process, served in the order
    /// their messages land ([`CpuTurns`]); `None` when it has them to itself (a card process).
    pub cpu_turns: Option<Arc<CpuTurns>>,
    /// Record when each message landed, started and was done ([`CardHost::take_spans`]).
    pub trace: bool,
}

/// The card's data plane: QUIC, or the in-process twin.
#[derive(Debug, Clone)]
pub enum DataPlane {
    /// JetStream over QUIC.
    Quic(Arc<QuicTransport>),
    /// JetStream over in-process channels.
    Inproc(Arc<InprocTransport>),
}

impl DataPlane {
    /// The transport behind the common trait.
    pub fn transport(&self) -> Arc<dyn Transport> {
        match self {
            DataPlane::Quic(q) => q.clone(),
            DataPlane::Inproc(i) => i.clone(),
        }
    }
}

/// The worker serving one attention node's inbox.
struct WorkerHandle {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<()>,
}

/// One simulated card process (or thread): its transport, its shard, its workers.
pub struct CardHost {
    config: CardHostConfig,
    plane: DataPlane,
    transport: Arc<dyn Transport>,
    runtime: Arc<EndpointRuntime>,
    /// The shard versions held (see [`shards`]).
    shards: Arc<ShardTable>,
    /// Held while a version is built: one build at a time.
    loading: Mutex<()>,
    /// One worker per attention node served, by the node's JetStream name.
    workers: Mutex<HashMap<String, WorkerHandle>>,
    /// Workers replaced by a node that attached again, still finishing.
    retired: Mutex<Vec<WorkerHandle>>,
    /// Random per host: tells a restarted card from one that only stalled.
    incarnation: u64,
    /// The workers' message spans, when tracing is on.
    spans: Option<Arc<spans::SpanLog>>,
}

impl std::fmt::Debug for CardHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CardHost")
            .field("index", &self.config.index)
            .finish()
    }
}

/// The fingerprint of the checkpoint in `dir`.
pub fn model_fingerprint(dir: &Path) -> Result<String, ServiceError> {
    Ok(Checkpoint::open(dir)
        .map_err(crate::Error::from)?
        .fingerprint()
        .map_err(crate::Error::from)?)
}

impl CardHost {
    /// A host for card `config.index`, writing and receiving over `plane`, whose tasks run on
    /// `runtime` (the transport was bound inside it). The workers drive it while they wait.
    pub fn new(config: CardHostConfig, plane: DataPlane, runtime: Arc<EndpointRuntime>) -> Self {
        CardHost {
            spans: config.trace.then(Default::default),
            config,
            transport: plane.transport(),
            plane,
            runtime,
            shards: Arc::default(),
            loading: Mutex::new(()),
            workers: Mutex::new(HashMap::new()),
            retired: Mutex::new(Vec::new()),
            incarnation: std::collections::hash_map::RandomState::new()
                .build_hasher()
                .finish(),
        }
    }

    /// This host's incarnation (random, fixed for its life).
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// The spans of the messages computed since the last call, in the order they were done;
    /// empty unless [`CardHostConfig::trace`] is on.
    pub fn take_spans(&self) -> Vec<CardSpan> {
        self.spans.as_ref().map_or_else(Vec::new, |log| log.take())
    }

    /// The card's JetStream node name.
    pub fn node(&self) -> &str {
        self.transport.node()
    }

    fn context(&self) -> BuildContext<'_> {
        BuildContext {
            card_index: self.config.index,
            profile: &self.config.profile,
            exec: self.config.exec,
            counters: self.shards.counters(),
        }
    }

    /// Loads this card's shard (or attaches another attention node to the loaded one) and
    /// starts serving that node's inbox. A node that was attached already (it lost the card for
    /// a while and came back to it) gets a fresh inbox, and its old worker stops. Blocks while
    /// compiling and loading.
    pub fn load_shard(&self, req: &LoadShardRequest) -> Result<LoadShardReply, ServiceError> {
        let me = self.config.index;
        if req.card_index as usize != me {
            return Err(ServiceError::Refused(format!(
                "this is card {me}, but the request is for card {} of {}: check the order of --cards",
                req.card_index, req.num_cards
            )));
        }
        if let Some(mine) = &self.config.model {
            let ours = model_fingerprint(mine)?;
            if ours != req.model_fingerprint {
                return Err(ServiceError::Refused(format!(
                    "card {me} serves the model in {} (fingerprint {ours}), but the attention node runs \
                     a different model (fingerprint {}); start every role with the same checkpoint",
                    mine.display(),
                    req.model_fingerprint
                )));
            }
        }
        let settings = ShardSettings::from_request(req)?;
        let shard = {
            // Held across the build: a second node attaching meanwhile waits for it.
            let _loading = self.loading.lock().unwrap_or_else(|p| p.into_inner());
            let loaded = self.shards.settings();
            if let Some(loaded) = loaded.as_ref().filter(|l| !l.compatible(&settings)) {
                return Err(ServiceError::Refused(format!(
                    "card {me} already serves another shard (model {}, format {}); every \
                     attention node sharing the cards must use the same model, placement, \
                     formats and activation dtype",
                    loaded.fingerprint, loaded.weight_format
                )));
            }
            match self.shards.get(req.shard_version) {
                Some(s) if s.assignment_json != req.assignment_json => {
                    return Err(ServiceError::Refused(format!(
                        "card {me} holds another share as version {}; every attention node \
                         sharing the cards must use the same placement",
                        req.shard_version
                    )));
                }
                Some(s) => s,
                None => {
                    // The first shard's settings are every later version's; a build that
                    // fails leaves the card as it was.
                    let settings = loaded.unwrap_or(settings);
                    let s = Arc::new(build_shard(
                        &self.context(),
                        &settings,
                        req.shard_version,
                        &req.assignment_json,
                    )?);
                    self.shards.set_settings(settings);
                    self.shards.insert(Arc::clone(&s));
                    s
                }
            }
        };
        self.attach(req, shard)
    }

    /// Builds version `req.shard_version` of this card's share beside the versions it holds
    /// (an expert move), with the loaded shard's settings; an assignment the card holds already
    /// is served under the new number without building anything. Blocks while compiling and
    /// loading; the versions held keep serving meanwhile.
    pub fn stage_shard(&self, req: &StageShardRequest) -> Result<StageShardReply, ServiceError> {
        let me = self.config.index;
        if req.card_index as usize != me {
            return Err(ServiceError::Refused(format!(
                "this is card {me}, but the staged shard is for card {}",
                req.card_index
            )));
        }
        let _loading = self.loading.lock().unwrap_or_else(|p| p.into_inner());
        let Some(settings) = self.shards.settings() else {
            return Err(ServiceError::Refused(format!(
                "card {me} has no shard loaded yet: load one (LoadShard) before staging another"
            )));
        };
        let shard = match self.shards.get(req.shard_version) {
            Some(s) if s.assignment_json == req.assignment_json => s,
            Some(_) => {
                return Err(ServiceError::Refused(format!(
                    "card {me} already holds another share as version {}: stage the move under a \
                     new version",
                    req.shard_version
                )));
            }
            None => {
                let shard = match self.shards.same_assignment(&req.assignment_json) {
                    Some(same) => same.alias(req.shard_version),
                    None => build_shard(
                        &self.context(),
                        &settings,
                        req.shard_version,
                        &req.assignment_json,
                    )?,
                };
                let shard = Arc::new(shard);
                self.shards.insert(Arc::clone(&shard));
                tracing::info!(
                    card = me,
                    version = req.shard_version,
                    "staged: {}",
                    shard.summary
                );
                shard
            }
        };
        Ok(StageShardReply {
            program_summary: shard.summary.clone(),
            rows_per_weight_read: shard.rows_per_weight_read.clone(),
            fixed_rows_per_copy: shard.fixed_rows_per_copy.clone(),
        })
    }

    /// Frees every shard version but `req.keep_version` (a message in hand on one finishes
    /// first). Refuses when that version is not held: the card would be left with nothing.
    pub fn release_shards(
        &self,
        req: &ReleaseShardsRequest,
    ) -> Result<ReleaseShardsReply, ServiceError> {
        let me = self.config.index;
        if req.card_index as usize != me {
            return Err(ServiceError::Refused(format!(
                "this is card {me}, but the release is for card {}",
                req.card_index
            )));
        }
        if self.shards.get(req.keep_version).is_none() {
            return Err(ServiceError::Refused(format!(
                "card {me} holds no shard version {} to keep (it holds {:?})",
                req.keep_version,
                self.shards.versions()
            )));
        }
        let shard_versions = self.shards.release_all_but(req.keep_version);
        Ok(ReleaseShardsReply { shard_versions })
    }

    fn attach(
        &self,
        req: &LoadShardRequest,
        shard: Arc<Shard>,
    ) -> Result<LoadShardReply, ServiceError> {
        let reply = req
            .reply_region
            .clone()
            .ok_or_else(|| ServiceError::Invalid("no reply_region".into()))?;
        let slot = req.inbox_slot_bytes as usize;
        if slot == 0 || req.reply_slot_bytes == 0 {
            return Err(ServiceError::Invalid("slot sizes must be positive".into()));
        }
        // Every reply, an error report included, carries a header: a smaller slot could hold
        // no answer at all.
        if (req.reply_slot_bytes as usize) < proto::data::HEADER_LEN {
            return Err(ServiceError::Invalid(format!(
                "a {}-byte reply slot cannot hold a {}-byte message header",
                req.reply_slot_bytes,
                proto::data::HEADER_LEN
            )));
        }
        if !req.attention_data_addr.is_empty()
            && let Some(quic) = self.transport_as_quic()
        {
            let addr = req
                .attention_data_addr
                .parse()
                .map_err(ServiceError::AttentionAddr)?;
            quic.add_peer(req.attention_node.clone(), addr);
        }
        let inbox = self.transport.register(
            RegionConfig::new(slot * crate::service::worker::SLOTS)
                .grant(req.attention_node.clone()),
        )?;
        let descriptor = inbox.descriptor();
        let turns = self
            .config
            .cpu_turns
            .as_ref()
            .map(|t| t.join(inbox.probe()));
        let stop = Arc::new(AtomicBool::new(false));
        let worker = worker::Worker {
            card_index: self.config.index,
            shards: Arc::clone(&self.shards),
            wire_dtype: shard.wire_dtype,
            inbox,
            reply: jetstream::RegionDescriptor {
                node: reply.node,
                id: reply.id,
                len: reply.len,
                key: reply.key,
            },
            reply_slot: req.reply_slot_bytes as usize,
            transport: self.transport.clone(),
            runtime: self.runtime.clone(),
            stop: stop.clone(),
            turns,
            spans: self.spans.clone(),
        };
        let name = format!("card-{}-worker", self.config.index);
        let mask = self.config.exec.cpu_mask;
        let handle = std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                // Waking a card must not preempt the stepping thread that sends the layer's
                // other messages (see `host_cpus::run_as_batch_work`).
                crate::host_cpus::run_as_batch_work();
                crate::host_cpus::pin_to_mask(mask, 0);
                worker.run()
            })
            .map_err(ServiceError::WorkerThread)?;
        let previous = self
            .workers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(
                req.attention_node.clone(),
                WorkerHandle {
                    stop,
                    thread: handle,
                },
            );
        if let Some(old) = previous {
            tracing::info!(
                card = self.config.index,
                "{} attached again: its previous inbox is retired",
                req.attention_node
            );
            old.stop.store(true, Ordering::SeqCst);
            let mut retired = self.retired.lock().unwrap_or_else(|p| p.into_inner());
            retired.retain(|w| !w.thread.is_finished());
            retired.push(old);
        }
        let (program, rows_per_weight_read, fixed_rows_per_copy) = (
            shard.summary.clone(),
            shard.rows_per_weight_read.clone(),
            shard.fixed_rows_per_copy.clone(),
        );
        Ok(LoadShardReply {
            inbox: Some(RegionDescriptor {
                node: descriptor.node,
                id: descriptor.id,
                len: descriptor.len,
                key: descriptor.key,
            }),
            card_node: self.transport.node().to_owned(),
            card_data_addr: self.data_addr().unwrap_or_default(),
            program_summary: program,
            incarnation: self.incarnation,
            rows_per_weight_read,
            fixed_rows_per_copy,
        })
    }

    fn transport_as_quic(&self) -> Option<&QuicTransport> {
        match &self.plane {
            DataPlane::Quic(q) => Some(q),
            DataPlane::Inproc(_) => None,
        }
    }

    /// The card's JetStream UDP address (QUIC only).
    pub fn data_addr(&self) -> Option<String> {
        self.transport_as_quic()
            .and_then(|q| q.local_addr().ok())
            .map(|a| a.to_string())
    }

    /// Whether a shard is loaded, and which; the attention nodes served now.
    pub fn health(&self) -> HealthReply {
        let mut attached: Vec<String> = self
            .workers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|(_, w)| !w.thread.is_finished())
            .map(|(node, _)| node.clone())
            .collect();
        attached.sort();
        let held = self.shards.versions();
        let (ready, status, model_fingerprint) = match self.shards.settings() {
            Some(s) if !held.is_empty() => (
                true,
                format!("serving card {}", self.config.index),
                s.fingerprint,
            ),
            _ => (
                false,
                format!("card {} is waiting for a shard", self.config.index),
                String::new(),
            ),
        };
        HealthReply {
            ready,
            status,
            model_fingerprint,
            incarnation: self.incarnation,
            attached,
            shard_versions: held,
            ..HealthReply::default()
        }
    }

    /// The card's counters and modeled time.
    pub fn stats(&self) -> proto::control::CardStats {
        let Some(stats) = self.shards.stats() else {
            return proto::control::CardStats {
                card_index: self.config.index as u32,
                ..Default::default()
            };
        };
        let s = self.shards.counters();
        let layers = stats.layers.iter().chain(std::iter::once(&stats.lm_head));
        proto::control::CardStats {
            card_index: self.config.index as u32,
            messages: s.messages.load(Ordering::Relaxed),
            bytes_in: s.bytes_in.load(Ordering::Relaxed),
            bytes_out: s.bytes_out.load(Ordering::Relaxed),
            modeled_seconds: layers.clone().map(|l| l.modeled_seconds).sum(),
            compute_seconds: *s.compute_seconds.lock().unwrap_or_else(|p| p.into_inner()),
            sram_bytes_used: stats.sram_used,
            sram_bytes_available: stats.sram_capacity,
            lpddr_bytes_used: stats.lpddr.iter().map(|m| m.bytes).sum(),
            expert_tokens: stats.layers.iter().map(|l| l.expert_rows).collect(),
            layer_times: stats
                .layers
                .iter()
                .enumerate()
                .map(|(i, l)| proto::control::LayerTime {
                    layer: i as u32,
                    modeled_seconds: l.modeled_seconds,
                })
                .collect(),
        }
    }

    fn take_workers(&self) -> Vec<WorkerHandle> {
        let mut all: Vec<WorkerHandle> =
            std::mem::take(&mut *self.workers.lock().unwrap_or_else(|p| p.into_inner()))
                .into_values()
                .collect();
        all.append(&mut self.retired.lock().unwrap_or_else(|p| p.into_inner()));
        for w in &all {
            w.stop.store(true, Ordering::SeqCst);
        }
        all
    }

    /// Stops the workers (they finish the message in hand).
    pub fn shutdown(&self) {
        for w in self.take_workers() {
            let _ = w.thread.join();
        }
    }
}

impl Drop for CardHost {
    fn drop(&mut self) {
        self.take_workers();
    }
}
