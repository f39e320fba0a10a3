//! Snapshots for metrics: per node (scheduler gauges and counters) and for the disaggregated
//! path (cards and JetStream), which the deployment fills through [`AfdStatsSource`].

pub use crate::scheduler::SchedulerStats;

/// One attention node, as last published by its engine loop.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct NodeStats {
    /// The scheduler's gauges and counters.
    pub scheduler: SchedulerStats,
    /// Requests admitted to this node and not yet started (includes those still in flight
    /// to the engine thread).
    pub not_started: usize,
    /// Requests assigned to this node and not finished (the load used to pick a node).
    pub load: usize,
    /// Whether the node's last step succeeded.
    pub healthy: bool,
}

/// Every node of a router.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RouterStats {
    /// One entry per node, by index.
    pub nodes: Vec<NodeStats>,
}

impl RouterStats {
    /// Running requests over all nodes.
    pub fn running(&self) -> usize {
        self.nodes.iter().map(|n| n.scheduler.running).sum()
    }

    /// Waiting requests over all nodes: not started yet, or preempted.
    pub fn waiting(&self) -> usize {
        self.nodes
            .iter()
            .map(|n| n.not_started.max(n.scheduler.waiting_new) + n.scheduler.waiting_preempted)
            .sum()
    }

    /// Fraction of KV blocks in use over all nodes.
    pub fn kv_usage(&self) -> f64 {
        let used: usize = self.nodes.iter().map(|n| n.scheduler.kv_blocks_used).sum();
        let total: usize = self.nodes.iter().map(|n| n.scheduler.kv_blocks_total).sum();
        if total == 0 {
            0.0
        } else {
            used as f64 / total as f64
        }
    }

    /// Sum of a counter over the nodes.
    pub fn sum(&self, counter: impl Fn(&SchedulerStats) -> u64) -> u64 {
        self.nodes.iter().map(|n| counter(&n.scheduler)).sum()
    }
}

/// Figures of the disaggregated path: hooks the attention node and the cards fill.
///
/// Every vector is indexed by card (or by layer for the JetStream bytes) and holds running
/// totals since start; an empty vector means "not measured by this deployment" and is not
/// exported.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AfdStats {
    /// Modeled busy time of each card so far, in seconds (the card performance model).
    pub card_modeled_seconds: Vec<f64>,
    /// Bytes moved over JetStream by each card so far, both directions.
    pub jetstream_bytes_per_card: Vec<u64>,
    /// Bytes sent over JetStream per layer so far, both directions (dispatch and combine).
    pub jetstream_bytes_per_layer: Vec<u64>,
    /// Token-expert assignments routed to each card so far (expert load per card).
    pub expert_tokens_per_card: Vec<u64>,
}

/// Where the server reads [`AfdStats`] from at each scrape of `/metrics`.
pub trait AfdStatsSource: Send + Sync {
    /// The current totals.
    fn snapshot(&self) -> AfdStats;
}
