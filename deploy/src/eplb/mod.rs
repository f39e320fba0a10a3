//! Moving experts while serving (`--eplb`): the shell around [`planner::eplb`].
//!
//! Every attention node of the process is wrapped ([`RecordingNode`]) to add each step's routing to
//! one window of recent steps; every `step_interval` steps the [`Rebalancer`]'s thread takes
//! the window's load and, when the placement by that load is worth it, moves the experts:
//!
//! 1. **Stage.** Each card builds the new version of its share beside the one serving
//!    (`StageShard`; a card whose share is unchanged serves the new version number from the
//!    same program). The nodes keep stepping on the old version meanwhile.
//! 2. **Switch.** Every node is handed the new placement on its [`CardBoard`] and takes it
//!    between two of its steps; from then on its messages name the new version, so no step
//!    mixes placements and greedy tokens stay what they were.
//! 3. **Free.** Once every node has switched, each card frees the old version
//!    (`ReleaseShards`).
//!
//! A move that fails while staging (a card down, a share that does not fit its memory) frees
//! what was staged and leaves the old placement serving. The [`ShardBook`] holds the placement
//! in use, so a card that rejoins later loads the current version.

use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use corsair_ffn::CardAssignment;
use emulate::record::{RecordingNode, RoutingObserver};
use gpu_attention::cards::CardBoard;
use gpu_attention::node::DisaggregatedNode;
use model::ModelConfig;
use planner::balance::ExpertLoad;
use planner::eplb::{EplbSettings, LoadWindow, MoveDecision, decide_move};
use proto::control::{ReleaseShardsRequest, StageShardReply, StageShardRequest};
use step::{AttentionNode, StepRouting};

use crate::cluster::{CardControl, card_layout};
use crate::error::{Error, Result};

/// The placement the cards serve now: its shard version and every card's share. Shared by the
/// rebalancer (which moves it on) and the card watchers (a card that rejoins loads it).
#[derive(Debug)]
pub struct ShardBook {
    inner: Mutex<(u32, Vec<CardAssignment>)>,
}

impl ShardBook {
    /// Version 0: the placement the deployment starts with.
    pub fn new(assignments: Vec<CardAssignment>) -> Self {
        ShardBook {
            inner: Mutex::new((0, assignments)),
        }
    }

    fn lock(&self) -> MutexGuard<'_, (u32, Vec<CardAssignment>)> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The version in use and every card's share.
    pub fn current(&self) -> (u32, Vec<CardAssignment>) {
        self.lock().clone()
    }

    /// The version in use and card `card`'s share under it.
    pub fn card(&self, card: usize) -> Option<(u32, CardAssignment)> {
        let inner = self.lock();
        inner.1.get(card).map(|a| (inner.0, a.clone()))
    }

    fn set(&self, version: u32, assignments: Vec<CardAssignment>) {
        *self.lock() = (version, assignments);
    }
}

/// What a move reaches: the model, the cards' control planes and the placement book.
#[derive(Clone)]
pub struct MoveTargets {
    /// The model served.
    pub model: ModelConfig,
    /// Every card, in order.
    pub cards: Vec<Arc<dyn CardControl>>,
    /// The placement in use.
    pub book: Arc<ShardBook>,
}

/// What one look at the load did.
#[derive(Debug, Clone, PartialEq)]
pub enum MoveOutcome {
    /// The experts moved: every node dispatches with shard version `version`, and the cards
    /// hold it alone.
    Moved {
        /// The new shard version.
        version: u32,
        /// Mean balancedness on the load, before and after.
        before: f64,
        /// See `before`.
        after: f64,
    },
    /// Nothing worth moving (mean balancedness now, and the best reachable).
    Stayed {
        /// Mean balancedness of the placement in use.
        now: f64,
        /// What the best placement would reach.
        best: f64,
    },
}

/// Counters of the moves made, for logs and tests.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct EplbStats {
    /// Looks at the load.
    pub looks: u64,
    /// Moves completed.
    pub moves: u64,
    /// Moves abandoned (the old placement kept serving).
    pub failed_moves: u64,
}

/// Moves the experts of one deployment: stage on every card, switch every node, free the old.
pub struct Rebalancer {
    targets: MoveTargets,
    boards: Vec<Arc<CardBoard>>,
    settings: EplbSettings,
    stats: Mutex<EplbStats>,
}

impl Rebalancer {
    /// A rebalancer for `targets`, switching the nodes whose boards are `boards`.
    pub fn new(targets: MoveTargets, boards: Vec<Arc<CardBoard>>, settings: EplbSettings) -> Self {
        Rebalancer {
            targets,
            boards,
            settings,
            stats: Mutex::default(),
        }
    }

    /// The moves so far.
    pub fn stats(&self) -> EplbStats {
        self.stats
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn count(&self, f: impl FnOnce(&mut EplbStats)) {
        f(&mut self.stats.lock().unwrap_or_else(PoisonError::into_inner));
    }

    /// Looks at `load` and moves the experts when the placement by it is worth it. Blocks
    /// while the cards build their new shares and until every node has switched.
    pub fn rebalance(&self, load: &ExpertLoad) -> Result<MoveOutcome> {
        self.count(|s| s.looks += 1);
        let (version, serving) = self.targets.book.current();
        let decision = decide_move(&self.targets.model, load, &serving, &self.settings)
            .map_err(|e| Error::Config(format!("--eplb: placing the experts by load: {e}")))?;
        let placed = match decision {
            MoveDecision::Stay { now, best } => return Ok(MoveOutcome::Stayed { now, best }),
            MoveDecision::Move(placed) => placed,
        };
        let next = version.wrapping_add(1);
        let assignments = placed.assignments(&serving);
        match self.move_to(next, &assignments) {
            Ok(()) => {
                self.count(|s| s.moves += 1);
                tracing::info!(
                    version = next,
                    "--eplb: moved the experts; mean balancedness {:.3} -> {:.3} on the last {} \
                     step(s)",
                    placed.mean_before(),
                    placed.mean_after(),
                    self.settings.window
                );
                Ok(MoveOutcome::Moved {
                    version: next,
                    before: placed.mean_before(),
                    after: placed.mean_after(),
                })
            }
            Err(e) => {
                self.count(|s| s.failed_moves += 1);
                // Nothing switched: free what was staged, keep serving the old version.
                self.release_all(version);
                Err(e)
            }
        }
    }

    /// Stages `assignments` as shard `version` on every card, switches every node to it, and
    /// frees the old versions.
    fn move_to(&self, version: u32, assignments: &[CardAssignment]) -> Result<()> {
        // Every card builds its share at once (each on its own machine, or its own thread here).
        let replies: Vec<Result<StageShardReply>> = std::thread::scope(|scope| {
            let staging: Vec<_> = self
                .targets
                .cards
                .iter()
                .zip(assignments)
                .enumerate()
                .map(|(i, (card, share))| {
                    scope.spawn(move || {
                        card.stage_shard(StageShardRequest {
                            card_index: i as u32,
                            shard_version: version,
                            assignment_json: serde_json::to_string(share)
                                .map_err(Error::AssignmentJson)?,
                        })
                    })
                })
                .collect();
            staging
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(Error::Config("--eplb: a card's staging panicked".into()))
                    })
                })
                .collect()
        });
        let replies = replies.into_iter().collect::<Result<Vec<_>>>()?;
        let placement = card_layout(&self.targets.model, assignments)?
            .placement
            .with_card_reports(replies.iter().map(|r| {
                (
                    r.rows_per_weight_read.as_slice(),
                    r.fixed_rows_per_copy.as_slice(),
                )
            }));
        if let Some(board) = self.boards.iter().find(|b| b.cards() != placement.cards()) {
            return Err(Error::Config(format!(
                "--eplb: a placement over {} cards for a node with {}",
                placement.cards(),
                board.cards()
            )));
        }
        // From here a rejoining card loads the new version.
        self.targets.book.set(version, assignments.to_vec());
        for board in &self.boards {
            board
                .switch_placement(version, placement.clone())
                .map_err(|e| Error::Config(format!("--eplb: {e}")))?;
        }
        // Each node takes the switch at its next step; an idle node takes it when it steps
        // again, and the old version stays on the cards until then. A node that is gone
        // (its board held here alone) steps no more.
        while self
            .boards
            .iter()
            .any(|b| b.shard_version() != version && Arc::strong_count(b) > 1)
        {
            std::thread::sleep(SWITCH_POLL);
        }
        self.release_all(version);
        Ok(())
    }

    /// Asks every card to keep shard `version` alone (a card that fails is logged: it frees
    /// the rest when it rejoins, or at the next move).
    fn release_all(&self, version: u32) {
        for (i, card) in self.targets.cards.iter().enumerate() {
            let request = ReleaseShardsRequest {
                card_index: i as u32,
                keep_version: version,
            };
            if let Err(e) = card.release_shards(request) {
                tracing::warn!(card = i, "--eplb: freeing the other shard versions: {e}");
            }
        }
    }
}

/// How often a move checks whether every node has switched.
const SWITCH_POLL: Duration = Duration::from_millis(2);

/// The window every wrapped node adds to, and the channel to the rebalancer's thread.
struct Shared {
    window: Mutex<LoadWindow>,
    interval: u64,
    looks: SyncSender<ExpertLoad>,
}

impl RoutingObserver for Shared {
    /// Adds a step's routing; every `interval` steps, hands the window's load to the
    /// rebalancer unless it is still busy with the last one (the step never waits).
    fn observe(&self, routing: &StepRouting) {
        let load = {
            let mut window = self.window.lock().unwrap_or_else(PoisonError::into_inner);
            window.observe(&routing.layers);
            if !window.steps_seen().is_multiple_of(self.interval) {
                return;
            }
            window.load()
        };
        match self.looks.try_send(load) {
            Ok(()) | Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {}
        }
    }
}

/// Nodes whose experts move while they serve.
pub struct Rebalanced {
    /// The nodes, each counting its routing into the rebalancer's window.
    pub nodes: Vec<Box<dyn AttentionNode>>,
    /// What moves their experts (its thread holds it too).
    pub rebalancer: Arc<Rebalancer>,
}

/// Wraps `nodes` to count their routing and starts the thread that moves the experts by it;
/// the thread ends when the nodes are dropped.
pub fn start(
    settings: EplbSettings,
    targets: MoveTargets,
    nodes: Vec<DisaggregatedNode>,
) -> Result<Rebalanced> {
    let m = targets.model.moe.ok_or_else(|| {
        Error::Config("--eplb moves experts, but the model has none (it is dense)".into())
    })?;
    if settings.step_interval == 0 || settings.window == 0 {
        return Err(Error::Config(
            "--eplb-window and --eplb-step-interval must be at least 1 step".into(),
        ));
    }
    let boards = nodes.iter().map(|n| n.board()).collect();
    let rebalancer = Arc::new(Rebalancer::new(targets.clone(), boards, settings));
    let (looks, looked) = std::sync::mpsc::sync_channel(1);
    let shared = Arc::new(Shared {
        window: Mutex::new(LoadWindow::new(
            &targets.model.moe_layers(),
            m.num_experts,
            settings.window,
        )),
        interval: settings.step_interval,
        looks,
    });
    let worker = Arc::clone(&rebalancer);
    std::thread::Builder::new()
        .name("afd-eplb".into())
        .spawn(move || run(&worker, &looked))
        .map_err(Error::system("cannot start the --eplb thread"))?;
    let nodes = nodes
        .into_iter()
        .map(|n| {
            let observer: Arc<dyn RoutingObserver> = shared.clone();
            Box::new(RecordingNode::new(Box::new(n), observer)) as Box<dyn AttentionNode>
        })
        .collect();
    Ok(Rebalanced { nodes, rebalancer })
}

fn run(rebalancer: &Rebalancer, looked: &Receiver<ExpertLoad>) {
    while let Ok(load) = looked.recv() {
        match rebalancer.rebalance(&load) {
            Ok(MoveOutcome::Stayed { now, best }) => tracing::debug!(
                "--eplb: placement kept (mean balancedness {now:.3}; by load {best:.3})"
            ),
            Ok(MoveOutcome::Moved { .. }) => {}
            Err(e) => tracing::warn!("--eplb: the move failed, the old placement serves: {e}"),
        }
    }
}
