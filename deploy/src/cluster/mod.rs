//! Assembling a disaggregated deployment: cards load their shards, attention nodes connect to
//! them over JetStream, and out come [`DisaggregatedNode`]s ready for the router.
//!
//! Two shapes share one path: the embedded cluster (cards are threads of this process, over
//! loopback QUIC or the in-process transport) and remote cards (separate `afd card` processes,
//! reached through their gRPC control plane).

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use corsair_ffn::assignment::LayerShare;
use corsair_ffn::service::{
    CardHost, CardHostConfig, CardSpan, CpuTurns, DataPlane, model_fingerprint,
};
use corsair_ffn::{CardAssignment, ExecOptions};
use gpu_attention::dispatch::ExpertPlacement;
use gpu_attention::fabric::JetstreamFabric;
use gpu_attention::node::slot_sizes;
use gpu_attention::{CardLayout, DisaggregatedNode};
use jetstream::{
    ClusterCa, EndpointRuntime, InprocFabric, NodeIdentity, QuicConfig, QuicTransport, Transport,
};
use model::weights::ExpertFilter;
use model::{ModelConfig, ModelWeights};
use proto::control::{
    HealthReply, LoadShardReply, LoadShardRequest, RegionDescriptor, ReleaseShardsReply,
    ReleaseShardsRequest, StageShardReply, StageShardRequest,
};

use crate::eplb::{MoveTargets, ShardBook};
use crate::error::{Error, Result};
use crate::watch::{HeartbeatError, WatchedCard, watch_cards};

mod config;

pub use config::{ClusterConfig, TransportKind};

/// A card's control plane, however the card is reached.
pub trait CardControl: Send + Sync {
    /// Asks the card to load (or attach to) its shard.
    fn load_shard(&self, request: LoadShardRequest) -> Result<LoadShardReply>;

    /// Asks the card to build another version of its shard beside the one serving.
    fn stage_shard(&self, request: StageShardRequest) -> Result<StageShardReply>;

    /// Asks the card to free every shard version but one.
    fn release_shards(&self, request: ReleaseShardsRequest) -> Result<ReleaseShardsReply>;

    /// Asks the card how it is, waiting at most `timeout`.
    fn health(&self, timeout: Duration) -> std::result::Result<HealthReply, HeartbeatError>;
}

impl CardControl for CardHost {
    fn load_shard(&self, request: LoadShardRequest) -> Result<LoadShardReply> {
        CardHost::load_shard(self, &request).map_err(|source| Error::CardService {
            card: request.card_index as usize,
            source: Box::new(source),
        })
    }

    fn stage_shard(&self, request: StageShardRequest) -> Result<StageShardReply> {
        CardHost::stage_shard(self, &request).map_err(|source| Error::CardService {
            card: request.card_index as usize,
            source: Box::new(source),
        })
    }

    fn release_shards(&self, request: ReleaseShardsRequest) -> Result<ReleaseShardsReply> {
        CardHost::release_shards(self, &request).map_err(|source| Error::CardService {
            card: request.card_index as usize,
            source: Box::new(source),
        })
    }

    fn health(&self, _timeout: Duration) -> std::result::Result<HealthReply, HeartbeatError> {
        Ok(CardHost::health(self))
    }
}

/// The attention node's layout of the cards, from their assignments.
pub fn card_layout(config: &ModelConfig, assignments: &[CardAssignment]) -> Result<CardLayout> {
    let card_experts: Vec<Vec<Vec<u32>>> = assignments
        .iter()
        .map(|a| {
            a.layers
                .iter()
                .map(|l| match l {
                    LayerShare::Moe { experts } => experts.clone(),
                    LayerShare::Dense { .. } => Vec::new(),
                })
                .collect()
        })
        .collect();
    let placement = ExpertPlacement::for_model(config, &card_experts)?;
    let dense_cards = assignments
        .iter()
        .filter(|a| {
            a.layers
                .iter()
                .any(|l| matches!(l, LayerShare::Dense { columns } if !columns.is_empty()))
        })
        .map(|a| a.card)
        .collect();
    let lm_head: Vec<Range<u32>> = assignments
        .iter()
        .map(|a| a.lm_head_rows.start as u32..a.lm_head_rows.end as u32)
        .collect();
    Ok(CardLayout {
        placement,
        dense_cards,
        lm_head,
    })
}

/// The attention node's transport.
pub enum NodeTransport {
    /// QUIC; card addresses are added as the cards report them.
    Quic(Arc<QuicTransport>),
    /// In-process.
    Inproc(Arc<dyn Transport>),
}

/// Connects one attention node to every card: registers its reply region, asks each card to
/// load its share in `book` (the first node) or attach (the others), builds the node, and
/// starts watching the cards for it ([`crate::watch`]).
#[allow(clippy::too_many_arguments)]
pub fn connect_node(
    config: &ClusterConfig,
    model: &ModelConfig,
    attention_weights: &ModelWeights,
    fingerprint: &str,
    book: &Arc<ShardBook>,
    cards: &[Arc<dyn CardControl>],
    transport: NodeTransport,
    runtime: Arc<EndpointRuntime>,
) -> Result<DisaggregatedNode> {
    let (shard_version, assignments) = book.current();
    if shard_version != 0 {
        return Err(Error::Config(
            "an attention node connects to the cards before any expert move (the placement \
             book must be at version 0)"
                .into(),
        ));
    }
    let mut layout = card_layout(model, &assignments)?;
    let sizes = slot_sizes(model, &config.node, &layout);
    let (dyn_transport, quic): (Arc<dyn Transport>, Option<Arc<QuicTransport>>) = match transport {
        NodeTransport::Quic(q) => (q.clone(), Some(q)),
        NodeTransport::Inproc(t) => (t, None),
    };
    let names: Vec<String> = (0..config.cards).map(card_name).collect();
    let mut fabric = JetstreamFabric::new(dyn_transport.clone(), runtime.clone(), names, sizes)?;
    let reply = fabric.reply_region();
    let data_addr = match &quic {
        Some(q) => q.local_addr()?.to_string(),
        None => String::new(),
    };
    let mut inboxes = Vec::with_capacity(cards.len());
    let mut watched = Vec::with_capacity(cards.len());
    // What each card reports of its split costs (`ExpertPlacement::with_card_reports`).
    let mut split_reports = Vec::with_capacity(cards.len());
    for (i, (card, assignment)) in cards.iter().zip(&assignments).enumerate() {
        let request = LoadShardRequest {
            model_path: config.model.display().to_string(),
            model_fingerprint: fingerprint.to_owned(),
            card_index: i as u32,
            num_cards: config.cards as u32,
            assignment_json: serde_json::to_string(assignment).map_err(Error::AssignmentJson)?,
            weight_format: config.weight_format.to_string(),
            activation_dtype: config.activation_dtype.to_string(),
            max_tokens: config.node.max_tokens as u32,
            allow_spill: config.allow_spill,
            wire_dtype: match config.node.wire_dtype {
                proto::data::WireDtype::F32 => "f32".into(),
                proto::data::WireDtype::Bf16 => "bf16".into(),
            },
            attention_node: dyn_transport.node().to_owned(),
            attention_data_addr: data_addr.clone(),
            reply_region: Some(RegionDescriptor {
                node: reply.node.clone(),
                id: reply.id,
                len: reply.len,
                key: reply.key,
            }),
            lm_head_candidates: config.node.lm_head_candidates as u32,
            inbox_slot_bytes: sizes.inbox as u64,
            reply_slot_bytes: sizes.reply as u64,
            shard_version,
        };
        let answer = card.load_shard(request.clone())?;
        let inbox = answer.inbox.ok_or_else(|| Error::Card {
            card: i,
            message: "the card returned no inbox".into(),
        })?;
        if let Some(q) = &quic {
            let addr = answer
                .card_data_addr
                .parse::<std::net::SocketAddr>()
                .map_err(|e| Error::CardLink {
                    card: i,
                    what: format!("bad data address `{}`", answer.card_data_addr),
                    source: e.into(),
                })?;
            q.add_peer(answer.card_node.clone(), addr);
        }
        tracing::info!(card = i, "{}", answer.program_summary);
        split_reports.push((answer.rows_per_weight_read, answer.fixed_rows_per_copy));
        inboxes.push(jetstream::RegionDescriptor {
            node: inbox.node,
            id: inbox.id,
            len: inbox.len,
            key: inbox.key,
        });
        watched.push(WatchedCard {
            control: card.clone(),
            request,
            book: Arc::clone(book),
        });
    }
    fabric.set_inboxes(inboxes);
    layout.placement = layout.placement.with_card_reports(
        split_reports
            .iter()
            .map(|(rows, fixed)| (rows.as_slice(), fixed.as_slice())),
    );
    let node = DisaggregatedNode::new(
        attention_weights,
        layout,
        Box::new(fabric),
        config.node.clone(),
    )?;
    let link = quic.as_ref().map(|quic| crate::watch::NodeLink {
        quic,
        runtime: &runtime,
    });
    watch_cards(&node.board(), watched, link, config.watch)?;
    Ok(node)
}

/// JetStream name of card `i`.
pub fn card_name(i: usize) -> String {
    format!("card-{i}")
}

/// JetStream name of attention node `j`.
pub fn attention_name(j: usize) -> String {
    format!("attn-{j}")
}

/// Certificate name of a frontend (every frontend replica shares it).
pub const FRONTEND_NAME: &str = "frontend";

/// A deployment in this process: cards as threads, attention nodes ready to step.
pub struct EmbeddedCluster {
    /// The cards.
    pub cards: Vec<Arc<CardHost>>,
    /// The assignments the cards started with.
    pub assignments: Vec<CardAssignment>,
    /// The placement the cards serve now (it moves under `--eplb`).
    pub book: Arc<ShardBook>,
    /// Boxed: the cluster sits in an enum beside small variants.
    model: Box<ModelConfig>,
    /// Behind a mutex only so the cluster can be shared (its stats) once the nodes are taken.
    nodes: std::sync::Mutex<Vec<DisaggregatedNode>>,
}

impl std::fmt::Debug for EmbeddedCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddedCluster")
            .field("cards", &self.cards.len())
            .finish()
    }
}

/// Progress while a cluster starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StartEvent {
    /// Card `i` of `n` is compiling and loading its shard.
    LoadingCard(usize, usize),
    /// Attention node `j` of `m` is connecting.
    ConnectingNode(usize, usize),
}

impl EmbeddedCluster {
    /// Starts every card and attention node of `config` in this process.
    pub fn start(config: &ClusterConfig, progress: &mut dyn FnMut(StartEvent)) -> Result<Self> {
        if config.cards == 0 || config.attention_nodes == 0 {
            return Err(Error::Config(
                "a deployment needs at least one card and one attention node".into(),
            ));
        }
        let model = ModelConfig::from_file(&config.model.join("config.json"))?;
        let fingerprint = model_fingerprint(&config.model)?;
        let assignments = config.assignments(&model, config.cards, host_available_memory())?;
        let ca = match config.transport {
            TransportKind::Quic => Some(ClusterCa::generate()?),
            TransportKind::Inproc => None,
        };
        let inproc = InprocFabric::new();
        // Each endpoint (card or node) gets a runtime of its own, driven by the threads that
        // compute on its messages (see `EndpointRuntime`): a packet wakes the thread that
        // works on it, with no I/O thread between.
        let endpoint_runtime = |name: &str| -> Result<Arc<EndpointRuntime>> {
            EndpointRuntime::new(name).map_err(Error::system("cannot start an endpoint's runtime"))
        };
        let quic = |name: &str, runtime: &EndpointRuntime| -> Result<Arc<QuicTransport>> {
            let identity: NodeIdentity = ca
                .as_ref()
                .ok_or_else(|| Error::Config("no cluster CA".into()))?
                .issue(name)?;
            let _guard = runtime.enter();
            let listen = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
            Ok(Arc::new(QuicTransport::bind(QuicConfig::new(
                identity, listen,
            ))?))
        };
        let mut cards = Vec::with_capacity(config.cards);
        let exec = ExecOptions {
            threads: config.card_threads,
            cpu_mask: config.card_cpu_mask,
            ..ExecOptions::default()
        };
        // The cards are threads of this process: they take turns on the CPUs they may use.
        let cpu_turns = CpuTurns::for_cards(&exec);
        for i in 0..config.cards {
            let runtime = endpoint_runtime(&card_name(i))?;
            let plane = match config.transport {
                TransportKind::Quic => DataPlane::Quic(quic(&card_name(i), &runtime)?),
                TransportKind::Inproc => {
                    DataPlane::Inproc(Arc::new(inproc.endpoint(&card_name(i))?))
                }
            };
            let host = CardHostConfig {
                index: i,
                model: None,
                profile: config.profile.clone(),
                exec,
                cpu_turns: Some(cpu_turns.clone()),
                // The node's trace switch records the cards' side of the timeline too.
                trace: config.node.trace,
            };
            cards.push(Arc::new(CardHost::new(host, plane, runtime)));
        }
        let attention_weights = config.load_weights(ExpertFilter::None)?;
        let book = Arc::new(ShardBook::new(assignments.clone()));
        let mut nodes = Vec::with_capacity(config.attention_nodes);
        for j in 0..config.attention_nodes {
            progress(StartEvent::ConnectingNode(j, config.attention_nodes));
            let runtime = endpoint_runtime(&attention_name(j))?;
            let transport = match config.transport {
                TransportKind::Quic => NodeTransport::Quic(quic(&attention_name(j), &runtime)?),
                TransportKind::Inproc => {
                    NodeTransport::Inproc(Arc::new(inproc.endpoint(&attention_name(j))?))
                }
            };
            let controls: Vec<Arc<dyn CardControl>> = cards
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    if j == 0 {
                        progress(StartEvent::LoadingCard(i, config.cards));
                    }
                    c.clone() as Arc<dyn CardControl>
                })
                .collect();
            nodes.push(connect_node(
                config,
                &model,
                &attention_weights,
                &fingerprint,
                &book,
                &controls,
                transport,
                runtime,
            )?);
        }
        Ok(EmbeddedCluster {
            cards,
            assignments,
            book,
            model: Box::new(model),
            nodes: std::sync::Mutex::new(nodes),
        })
    }

    /// What an expert move reaches in this cluster (see [`crate::eplb`]).
    pub fn move_targets(&self) -> MoveTargets {
        MoveTargets {
            model: (*self.model).clone(),
            cards: self
                .cards
                .iter()
                .map(|c| Arc::clone(c) as Arc<dyn CardControl>)
                .collect(),
            book: Arc::clone(&self.book),
        }
    }

    /// The attention nodes (the caller owns them from now on; the cluster keeps the cards).
    pub fn take_nodes(&mut self) -> Vec<DisaggregatedNode> {
        std::mem::take(self.nodes.get_mut().unwrap_or_else(|p| p.into_inner()))
    }

    /// Every card's statistics.
    pub fn card_stats(&self) -> Vec<proto::control::CardStats> {
        self.cards.iter().map(|c| c.stats()).collect()
    }

    /// Every card's message spans since the last call, card by card (empty unless the node's
    /// `trace` was on when the cluster started).
    pub fn take_card_spans(&self) -> Vec<CardSpan> {
        self.cards.iter().flat_map(|c| c.take_spans()).collect()
    }
}

impl Drop for EmbeddedCluster {
    fn drop(&mut self) {
        for c in &self.cards {
            c.shutdown();
        }
    }
}

/// The checkpoint's fingerprint (for refusing mismatched roles).
pub fn fingerprint(model: &Path) -> Result<String> {
    Ok(model_fingerprint(model)?)
}

/// This host's available memory (`MemAvailable` in `/proc/meminfo`), where it can be read: what
/// `replicate_experts = "auto"` weighs the copies of cards simulated in this process against.
pub fn host_available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
