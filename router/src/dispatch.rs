//! The router handle the server holds: admission (a bounded waiting queue), least-loaded
//! assignment of new requests to attention nodes, and per-request output streams whose drop
//! aborts the request.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use step::{AttentionNode, Clock, HealthSource, KvCapacity, NodeHealth};
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

use crate::config::RouterConfig;
use crate::engine::{Command, Engine, NodeShared, RequestEvent};
use crate::error::Error;
use crate::scheduler::{NewRequest, RequestId, Scheduler, SequenceParams};
use crate::stats::RouterStats;
use crate::timing::{ClockSnapshot, ClockStats, Dilation, Pacer, Timing};

/// A request as the server hands it to the router (tokenized and validated).
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationRequest {
    /// Prompt token ids (not empty).
    pub prompt: Vec<u32>,
    /// How to generate.
    pub params: SequenceParams,
    /// When the frontend received the request.
    pub arrival: Instant,
}

struct NodeHandle {
    commands: Sender<Command>,
    shared: Arc<NodeShared>,
    kv: KvCapacity,
    /// The node's view of its cards, when it has cards.
    health: Option<Arc<dyn HealthSource>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl NodeHandle {
    /// Why the node cannot take new requests now, if it cannot.
    fn unserved(&self) -> Option<String> {
        if !self.shared.alive.load(Ordering::Acquire) {
            return Some("its engine loop has stopped".into());
        }
        self.health.as_ref().and_then(|h| h.health().unserved)
    }
}

/// The node a new request goes to: the least loaded (requests assigned and not finished) of
/// those that can serve (`Some(load)`), the first of them on a tie; `None` when none can.
pub fn pick_node(loads: &[Option<usize>]) -> Option<usize> {
    loads
        .iter()
        .enumerate()
        .filter_map(|(i, l)| l.map(|l| (i, l)))
        .min_by_key(|&(_, l)| l)
        .map(|(i, _)| i)
}

/// Continuous batching over one or more attention nodes (one engine thread each).
pub struct Router {
    config: RouterConfig,
    nodes: Vec<NodeHandle>,
    clock: Arc<dyn Clock>,
    clock_stats: Arc<ClockStats>,
    next_id: AtomicU64,
    not_started_total: Arc<AtomicUsize>,
}

impl std::fmt::Debug for Router {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Router")
            .field("config", &self.config)
            .field("nodes", &self.nodes.len())
            .finish()
    }
}

impl Router {
    /// Starts one engine thread per node, on the wall clock. Every node must hold
    /// `max_model_len` tokens.
    pub fn start(config: RouterConfig, nodes: Vec<Box<dyn AttentionNode>>) -> Result<Self, Error> {
        Self::start_with(config, nodes, Timing::default())
    }

    /// [`Router::start`] on the clock of `timing` (with a modeled clock, one step timer per
    /// node).
    pub fn start_with(
        config: RouterConfig,
        nodes: Vec<Box<dyn AttentionNode>>,
        timing: Timing,
    ) -> Result<Self, Error> {
        if nodes.is_empty() {
            return Err(Error::NoNodes);
        }
        let clock_stats = Arc::new(ClockStats::default());
        let (clock_kind, mut timers) = match timing.modeled {
            Some(m) => {
                if m.timers.len() != nodes.len() {
                    return Err(Error::Config(format!(
                        "a modeled clock needs one step timer per attention node: {} for {} nodes",
                        m.timers.len(),
                        nodes.len()
                    )));
                }
                let auto = m.dilation == Dilation::Auto;
                if !auto {
                    clock_stats.settle();
                }
                (
                    Some((m.clock, auto)),
                    m.timers.into_iter().map(Some).collect::<Vec<_>>(),
                )
            }
            None => (None, Vec::new()),
        };
        let not_started_total = Arc::new(AtomicUsize::new(0));
        let mut handles = Vec::with_capacity(nodes.len());
        for (index, node) in nodes.into_iter().enumerate() {
            let kv = node.kv_capacity();
            let health = node.health_source();
            let mut scheduler_config = config.scheduler.clone();
            scheduler_config.enable_prefix_caching &= node.shares_kv_blocks();
            let scheduler = Scheduler::new(scheduler_config, kv.block_size, kv.num_blocks)
                .map_err(|e| Error::Config(format!("attention node {index}: {e}")))?;
            let shared = Arc::new(NodeShared::new(Arc::clone(&not_started_total)));
            let (tx, rx) = channel();
            let pacer = clock_kind.as_ref().and_then(|(clock, auto)| {
                timers
                    .get_mut(index)
                    .and_then(Option::take)
                    .map(|timer| Pacer {
                        timer,
                        clock: Arc::clone(clock),
                        stats: Arc::clone(&clock_stats),
                        auto: *auto,
                        node: index,
                    })
            });
            let engine = Engine::new(
                index,
                node,
                scheduler,
                Arc::clone(&shared),
                rx,
                Arc::clone(&timing.clock),
                pacer,
            );
            let thread = std::thread::Builder::new()
                .name(format!("afd-engine-{index}"))
                .spawn(move || engine.run())
                .map_err(|source| Error::EngineThread {
                    node: index,
                    source,
                })?;
            handles.push(NodeHandle {
                commands: tx,
                shared,
                kv,
                health,
                thread: Mutex::new(Some(thread)),
            });
        }
        Ok(Router {
            config,
            nodes: handles,
            clock: timing.clock,
            clock_stats,
            next_id: AtomicU64::new(1),
            not_started_total,
        })
    }

    /// The settings.
    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    /// The clock serving reads (wall time, or a modeled clock).
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    /// The modeled clock's figures (dilation, late steps); `modeled` is false on wall time.
    pub fn clock_snapshot(&self) -> ClockSnapshot {
        self.clock_stats.snapshot(self.clock.as_ref())
    }

    /// Number of attention nodes.
    pub fn num_nodes(&self) -> usize {
        self.nodes.len()
    }

    /// KV geometry of each node.
    pub fn kv_capacities(&self) -> Vec<KvCapacity> {
        self.nodes.iter().map(|n| n.kv).collect()
    }

    /// Admits a request and starts it on the least-loaded node that can serve. Fails at once
    /// with [`Error::QueueFull`] when `max_waiting` requests are already waiting, and with
    /// [`Error::CardsDown`] when no node can serve because cards they need are down.
    pub fn submit(&self, request: GenerationRequest) -> Result<RequestStream, Error> {
        let mut streams = self.submit_all(vec![request])?;
        streams.pop().ok_or(Error::NoNodes)
    }

    /// Whether a request of `sequences` sequences could ever be admitted: refuses, with
    /// [`Error::TooManySequences`], one larger than `max_waiting`, which no wait would let in.
    pub fn check_sequences(&self, sequences: usize) -> Result<(), Error> {
        let limit = self.config.max_waiting;
        if sequences > limit {
            return Err(Error::TooManySequences { sequences, limit });
        }
        Ok(())
    }

    /// Admits every sequence of one client request (its prompts x `n` choices) or none: their
    /// waiting slots are taken together, so a refused request leaves nothing behind that could
    /// make the next client's request fail. Each sequence goes to the least-loaded node.
    /// Fails with [`Error::TooManySequences`] when the group can never fit, and with
    /// [`Error::QueueFull`] when it does not fit now.
    pub fn submit_all(
        &self,
        requests: Vec<GenerationRequest>,
    ) -> Result<Vec<RequestStream>, Error> {
        let asked = requests.len();
        self.check_sequences(asked)?;
        let limit = self.config.max_waiting;
        self.not_started_total
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                (w + asked <= limit).then_some(w + asked)
            })
            .map_err(|waiting| Error::QueueFull {
                waiting,
                asked,
                limit,
            })?;
        let mut streams = Vec::with_capacity(asked);
        for (sent, request) in requests.into_iter().enumerate() {
            match self.place(request) {
                Ok(stream) => streams.push(stream),
                Err(e) => {
                    // Slots of the sequences not sent go back now; those sent are aborted by
                    // dropping their streams (their engines give their slots back).
                    self.not_started_total
                        .fetch_sub(asked - sent, Ordering::AcqRel);
                    return Err(e);
                }
            }
        }
        Ok(streams)
    }

    /// Sends one admitted sequence (its waiting slot already taken) to the least-loaded node
    /// that can serve.
    fn place(&self, request: GenerationRequest) -> Result<RequestStream, Error> {
        let mut refusals = Vec::new();
        let loads: Vec<Option<usize>> = self
            .nodes
            .iter()
            .enumerate()
            .map(|(i, n)| match n.unserved() {
                None => Some(n.shared.load.load(Ordering::Acquire)),
                Some(why) => {
                    refusals.push((i, why));
                    None
                }
            })
            .collect();
        let Some(index) = pick_node(&loads) else {
            return Err(self.refusal(refusals));
        };
        let node = &self.nodes[index];
        node.shared.load.fetch_add(1, Ordering::AcqRel);
        node.shared.not_started.fetch_add(1, Ordering::AcqRel);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = unbounded_channel();
        let command = Command::Submit {
            request: NewRequest {
                id,
                prompt: request.prompt,
                params: request.params,
                arrival: request.arrival,
            },
            tx,
        };
        if node.commands.send(command).is_err() {
            node.shared.load.fetch_sub(1, Ordering::AcqRel);
            node.shared.not_started.fetch_sub(1, Ordering::AcqRel);
            return Err(Error::NodeDown {
                node: index,
                message: "its engine loop has stopped".into(),
            });
        }
        Ok(RequestStream {
            id,
            node: index,
            rx,
            commands: node.commands.clone(),
            finished: false,
        })
    }

    /// The error for a request no node can take.
    fn refusal(&self, refusals: Vec<(usize, String)>) -> Error {
        let stopped = |(_, n): &(usize, &NodeHandle)| !n.shared.alive.load(Ordering::Acquire);
        if self.nodes.iter().enumerate().all(|n| stopped(&n)) {
            return Error::NodeDown {
                node: 0,
                message: "every engine loop has stopped".into(),
            };
        }
        let reasons: Vec<String> = refusals
            .into_iter()
            .map(|(i, why)| {
                if self.nodes.len() == 1 {
                    why
                } else {
                    format!("attention node {i}: {why}")
                }
            })
            .collect();
        Error::CardsDown {
            message: format!("no attention node can serve now: {}", reasons.join("; ")),
        }
    }

    /// Each node's view of its cards (`None` for a node without cards).
    pub fn card_health(&self) -> Vec<Option<NodeHealth>> {
        self.nodes
            .iter()
            .map(|n| n.health.as_ref().map(|h| h.health()))
            .collect()
    }

    /// Gauges and counters of every node.
    pub fn stats(&self) -> RouterStats {
        RouterStats {
            nodes: self.nodes.iter().map(|n| n.shared.snapshot()).collect(),
        }
    }

    /// Whether every node's engine runs and the node can serve: for a node with cards, no card
    /// it needs is down uncovered (its state, not its last step, decides, so the server is
    /// healthy again as soon as the card is back); for others, its last step succeeded.
    pub fn is_healthy(&self) -> bool {
        self.nodes.iter().all(|n| {
            n.shared.alive.load(Ordering::Acquire)
                && match &n.health {
                    Some(h) => h.health().unserved.is_none(),
                    None => n.shared.healthy.load(Ordering::Acquire),
                }
        })
    }
}

impl Router {
    /// Stops every engine loop (each after the step it is in): requests still running end
    /// with [`crate::GenerationError::Shutdown`] and new ones are refused. Waits up to
    /// `patience` for the loops' threads to end, so that what they hold (the attention nodes)
    /// is dropped before the caller goes on; false when some did not end in time (they end
    /// by themselves after their step).
    pub fn shutdown(&self, patience: Duration) -> bool {
        for n in &self.nodes {
            let _ = n.commands.send(Command::Shutdown);
        }
        let deadline = Instant::now() + patience;
        let mut all = true;
        for n in &self.nodes {
            let mut slot = n.thread.lock().unwrap_or_else(PoisonError::into_inner);
            while slot.as_ref().is_some_and(|t| !t.is_finished()) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
            match slot.take_if(|t| t.is_finished()) {
                Some(t) => {
                    let _ = t.join();
                }
                None => all &= slot.is_none(),
            }
        }
        all
    }
}

impl Drop for Router {
    fn drop(&mut self) {
        // Join only loops that have already stopped: a node blocked in a step must not hang
        // the caller; its thread ends by itself after that step.
        self.shutdown(Duration::ZERO);
    }
}

/// The outputs of one request. Dropping it before the last token aborts the request, and the
/// engine frees its KV blocks at once.
#[derive(Debug)]
pub struct RequestStream {
    id: RequestId,
    node: usize,
    rx: UnboundedReceiver<RequestEvent>,
    commands: Sender<Command>,
    finished: bool,
}

impl RequestStream {
    /// The request's id.
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// The node it runs on.
    pub fn node(&self) -> usize {
        self.node
    }

    /// The next token (or the error that ended the request); `None` after the last one.
    pub async fn next(&mut self) -> Option<RequestEvent> {
        if self.finished {
            return None;
        }
        let event = self.rx.recv().await;
        self.note(&event);
        event
    }

    /// The next token if one is ready, without waiting.
    pub fn try_next(&mut self) -> Option<RequestEvent> {
        if self.finished {
            return None;
        }
        let event = self.rx.try_recv().ok();
        if event.is_some() {
            self.note(&event);
        }
        event
    }

    /// Stops the request now (for example on a stop string), freeing its blocks.
    pub fn abort(mut self) {
        self.send_abort();
    }

    fn note(&mut self, event: &Option<RequestEvent>) {
        match event {
            None | Some(Err(_)) => self.finished = true,
            Some(Ok(t)) if t.finish.is_some() => self.finished = true,
            Some(Ok(_)) => {}
        }
    }

    fn send_abort(&mut self) {
        if !self.finished {
            self.finished = true;
            let _ = self.commands.send(Command::Abort(self.id));
        }
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        self.send_abort();
    }
}

#[cfg(test)]
mod tests {
    use super::pick_node;

    #[test]
    fn the_least_loaded_node_that_can_serve_takes_the_request() {
        assert_eq!(
            pick_node(&[Some(3), Some(1), Some(1)]),
            Some(1),
            "first on a tie"
        );
        assert_eq!(pick_node(&[None, Some(5), Some(7)]), Some(1));
        assert_eq!(pick_node(&[Some(0), None]), Some(0));
        assert_eq!(pick_node(&[None, None]), None);
        assert_eq!(pick_node(&[]), None);
    }
}
