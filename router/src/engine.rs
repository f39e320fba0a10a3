//! The engine loop of one attention node: a thin shell around [`Scheduler`] on its own OS
//! thread (a model step is blocking CPU work and must never run on the async runtime).
//!
//! It takes commands (submit, abort, shutdown) from a channel, drops requests whose client has
//! gone (their output receiver was dropped), runs schedule -> node.free -> node.step ->
//! update_from_output, and sends each request its tokens over its own channel.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use step::{AttentionNode, Clock, MaskJob, StepError};
use tokio::sync::mpsc::UnboundedSender;

use crate::error::GenerationError;
use crate::scheduler::{NewRequest, RequestId, RequestStatus, Scheduler, TokenOutput};
use crate::stats::NodeStats;
use crate::timing::Pacer;

/// What a request's output channel carries: tokens, or the error that ended it.
pub type RequestEvent = Result<TokenOutput, GenerationError>;

pub(crate) type OutputSender = UnboundedSender<RequestEvent>;

/// A command to an engine loop.
pub(crate) enum Command {
    /// Start a request; its outputs go to `tx`.
    Submit {
        request: NewRequest,
        tx: OutputSender,
    },
    /// Drop a request and free its blocks (client gone, or stopped by a stop string).
    Abort(RequestId),
    /// Fail everything and end the loop.
    Shutdown,
}

/// State shared between an engine loop and the router's submit path.
#[derive(Debug)]
pub(crate) struct NodeShared {
    /// Requests assigned and not finished.
    pub(crate) load: AtomicUsize,
    /// Requests admitted and not yet started.
    pub(crate) not_started: AtomicUsize,
    /// The router-wide count of requests admitted and not yet started.
    pub(crate) not_started_total: Arc<AtomicUsize>,
    /// The loop is running.
    pub(crate) alive: AtomicBool,
    /// The last step succeeded.
    pub(crate) healthy: AtomicBool,
    /// Published after every step.
    pub(crate) stats: Mutex<NodeStats>,
}

impl NodeShared {
    pub(crate) fn new(not_started_total: Arc<AtomicUsize>) -> Self {
        NodeShared {
            load: AtomicUsize::new(0),
            not_started: AtomicUsize::new(0),
            not_started_total,
            alive: AtomicBool::new(true),
            healthy: AtomicBool::new(true),
            stats: Mutex::new(NodeStats {
                healthy: true,
                ..Default::default()
            }),
        }
    }

    fn started(&self) {
        self.not_started.fetch_sub(1, Ordering::AcqRel);
        self.not_started_total.fetch_sub(1, Ordering::AcqRel);
    }

    pub(crate) fn snapshot(&self) -> NodeStats {
        let mut s = *self.stats.lock().unwrap_or_else(PoisonError::into_inner);
        s.not_started = self.not_started.load(Ordering::Acquire);
        s.load = self.load.load(Ordering::Acquire);
        s.healthy = self.healthy.load(Ordering::Acquire) && self.alive.load(Ordering::Acquire);
        s
    }
}

/// One node's loop state.
pub(crate) struct Engine {
    pub(crate) index: usize,
    pub(crate) node: Box<dyn AttentionNode>,
    /// What steps are stamped with.
    clock: Arc<dyn Clock>,
    /// On a modeled clock: what times the steps and keeps pace.
    pacer: Option<Pacer>,
    pub(crate) scheduler: Scheduler,
    pub(crate) shared: Arc<NodeShared>,
    pub(crate) commands: Receiver<Command>,
    senders: HashMap<RequestId, OutputSender>,
    /// A shutdown command arrived.
    stopping: bool,
    /// The thread computing structured outputs' masks, started with the first one.
    masks: Option<std::sync::mpsc::Sender<MaskJob>>,
}

impl Engine {
    pub(crate) fn new(
        index: usize,
        mut node: Box<dyn AttentionNode>,
        scheduler: Scheduler,
        shared: Arc<NodeShared>,
        commands: Receiver<Command>,
        clock: Arc<dyn Clock>,
        pacer: Option<Pacer>,
    ) -> Self {
        if pacer.is_some() {
            node.record_routing(true);
        }
        Engine {
            index,
            node,
            clock,
            pacer,
            scheduler,
            shared,
            commands,
            senders: HashMap::new(),
            stopping: false,
            masks: None,
        }
    }

    /// Hands the step's masks to the mask thread, which computes them while the node runs
    /// the step (a row waits for its mask only when it samples). Should the thread be gone,
    /// they are computed here.
    fn start_masks(&mut self, jobs: &[MaskJob]) {
        if jobs.is_empty() {
            return;
        }
        if self.masks.is_none() {
            let (tx, rx) = std::sync::mpsc::channel::<MaskJob>();
            let spawned = std::thread::Builder::new()
                .name(format!("afd-masks-{}", self.index))
                .spawn(move || {
                    for job in rx {
                        job.run();
                    }
                });
            match spawned {
                Ok(_) => self.masks = Some(tx),
                Err(e) => tracing::warn!(error = %e, "no mask thread; masks computed inline"),
            }
        }
        for job in jobs {
            let sent = self.masks.as_ref().map(|tx| tx.send(job.clone()));
            if !matches!(sent, Some(Ok(()))) {
                job.run();
            }
        }
    }

    /// Runs until shutdown or until every command sender is gone, on a compute pool of this
    /// thread's own (see [`step::compute::on_own_pool`]).
    pub(crate) fn run(self) {
        let name = format!("afd-compute-{}", self.index);
        step::compute::on_own_pool(&name, || self.run_loop());
    }

    fn run_loop(mut self) {
        let _span = tracing::info_span!("engine", node = self.index).entered();
        loop {
            if !self.scheduler.has_work() {
                self.free_on_node();
                self.publish();
                match self.commands.recv() {
                    Ok(cmd) => {
                        if !self.handle(cmd) {
                            break;
                        }
                    }
                    Err(_) => break,
                }
            }
            if !self.drain_commands() {
                break;
            }
            self.drop_abandoned();
            if !self.scheduler.has_work() {
                continue;
            }
            self.step();
            if self.stopping {
                break;
            }
        }
        self.shutdown();
    }

    /// Handles queued commands without blocking; false on shutdown.
    fn drain_commands(&mut self) -> bool {
        loop {
            match self.commands.try_recv() {
                Ok(cmd) => {
                    if !self.handle(cmd) {
                        return false;
                    }
                }
                Err(TryRecvError::Empty) => return true,
                // The router is gone; finish what is running, then stop at the next idle wait.
                Err(TryRecvError::Disconnected) => return true,
            }
        }
    }

    fn handle(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Submit { request, tx } => {
                let id = request.id;
                match self.scheduler.add_request(request) {
                    Ok(()) => {
                        self.senders.insert(id, tx);
                    }
                    Err(e) => {
                        self.shared.started();
                        self.shared.load.fetch_sub(1, Ordering::AcqRel);
                        let _ = tx.send(Err(GenerationError::Step {
                            node: self.index,
                            message: e.to_string(),
                        }));
                    }
                }
                true
            }
            Command::Abort(id) => {
                self.abort(id);
                true
            }
            Command::Shutdown => false,
        }
    }

    fn abort(&mut self, id: RequestId) {
        if self.scheduler.abort(id) == Some(RequestStatus::Waiting) {
            self.shared.started();
        }
        if self.senders.remove(&id).is_some() {
            self.shared.load.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// Aborts requests whose client dropped its receiver.
    fn drop_abandoned(&mut self) {
        let gone: Vec<RequestId> = self
            .senders
            .iter()
            .filter(|(_, tx)| tx.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            tracing::debug!(request = id, "client gone; aborting");
            self.abort(id);
        }
    }

    fn free_on_node(&mut self) {
        let freed = self.scheduler.take_freed();
        if !freed.is_empty()
            && let Err(e) = self.node.free(&freed)
        {
            tracing::warn!(node = self.index, error = %e, "freeing sequences on the node failed");
        }
    }

    fn step(&mut self) {
        let wall_start = Instant::now();
        let out = self.scheduler.schedule(self.clock.now());
        for _ in &out.started {
            self.shared.started();
        }
        if !out.freed.is_empty()
            && let Err(e) = self.node.free(&out.freed)
        {
            tracing::warn!(node = self.index, error = %e, "freeing sequences on the node failed");
        }
        // The running set is decided: publish it before the (possibly long) step.
        self.publish();
        if out.is_empty() {
            // Work exists but nothing fits right now; wait for a command instead of spinning.
            match self.commands.recv_timeout(Duration::from_millis(10)) {
                Ok(cmd) => self.stopping = !self.handle(cmd),
                Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => {}
            }
            return;
        }
        if let Some(p) = &self.pacer {
            p.begin();
        }
        self.start_masks(&out.mask_jobs);
        let stepped = self.node.step(&out.batch);
        if let Some(p) = self.pacer.as_mut() {
            match &stepped {
                Ok(_) => {
                    let routing = self.node.take_routing();
                    p.finish(&out.batch, routing.as_ref(), wall_start);
                }
                Err(_) => p.abandon(),
            }
        }
        match stepped {
            Ok(result) => {
                self.shared.healthy.store(true, Ordering::Release);
                let (tokens, failed) =
                    self.scheduler
                        .update_from_output(&out, &result, self.clock.now());
                // Publish before the tokens go out, so a client that saw a token sees the step
                // in the metrics too.
                self.publish();
                for t in tokens {
                    let id = t.id;
                    let finished = t.finish.is_some();
                    let delivered = self
                        .senders
                        .get(&id)
                        .is_some_and(|tx| tx.send(Ok(t)).is_ok());
                    if finished || !delivered {
                        self.abort(id);
                    }
                }
                for (id, why) in failed {
                    self.fail(id, &why.to_string());
                }
            }
            Err(e) => {
                tracing::error!(node = self.index, error = %e, "step failed");
                self.shared.healthy.store(false, Ordering::Release);
                let error = match e {
                    StepError::Card { .. }
                    | StepError::NoReply { .. }
                    | StepError::Unavailable { .. } => GenerationError::Unavailable {
                        node: self.index,
                        message: e.to_string(),
                    },
                    StepError::Invalid(_) | StepError::Model(_) | StepError::Compute(_) => {
                        GenerationError::Step {
                            node: self.index,
                            message: e.to_string(),
                        }
                    }
                };
                for id in self.scheduler.fail_step(&out) {
                    self.fail_with(id, error.clone());
                }
            }
        }
        self.publish();
    }

    fn fail(&mut self, id: RequestId, message: &str) {
        self.fail_with(
            id,
            GenerationError::Step {
                node: self.index,
                message: message.to_string(),
            },
        );
    }

    fn fail_with(&mut self, id: RequestId, error: GenerationError) {
        self.scheduler.abort(id);
        if let Some(tx) = self.senders.remove(&id) {
            self.shared.load.fetch_sub(1, Ordering::AcqRel);
            let _ = tx.send(Err(error));
        }
    }

    fn publish(&self) {
        let mut s = self
            .shared
            .stats
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        s.scheduler = self.scheduler.stats();
    }

    fn shutdown(&mut self) {
        self.shared.alive.store(false, Ordering::Release);
        let ids: Vec<RequestId> = self.scheduler.request_ids().collect();
        for id in ids {
            if let Some(tx) = self.senders.get(&id) {
                let _ = tx.send(Err(GenerationError::Shutdown));
            }
            self.abort(id);
        }
        self.free_on_node();
        self.publish();
    }
}
