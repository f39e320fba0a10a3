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
    /// The same per decoder layer: `[layer][card]` (empty lists for dense layers).
    pub expert_tokens_per_layer_card: Vec<Vec<u64>>,
}

/// How even the cards' expert load is, per layer, over a sliding window of time: the counters
/// of [`AfdStats::expert_tokens_per_layer_card`] sampled at each look (each scrape of
/// `/metrics`), differenced against the oldest sample still in the window.
#[derive(Debug, Clone)]
pub struct BalanceWindow {
    window: std::time::Duration,
    samples: std::collections::VecDeque<(std::time::Instant, Vec<Vec<u64>>)>,
}

impl BalanceWindow {
    /// A window of `window` (vLLM balances over its last steps; a scrape sees the last
    /// `window` of them).
    pub fn new(window: std::time::Duration) -> Self {
        BalanceWindow {
            window,
            samples: std::collections::VecDeque::new(),
        }
    }

    /// Adds the counters as of `now` and returns each layer's balancedness over the window
    /// ([`step::replicas::balancedness`] of the cards' tokens): `None` for a layer no token
    /// reached in it. The first look covers everything since start.
    pub fn observe(&mut self, now: std::time::Instant, counts: &[Vec<u64>]) -> Vec<Option<f64>> {
        // Keep the newest sample at least a window old as the base; drop those before it.
        while self.samples.len() >= 2
            && self
                .samples
                .get(1)
                .is_some_and(|(t, _)| now.duration_since(*t) >= self.window)
        {
            self.samples.pop_front();
        }
        let base = self.samples.front().map(|(_, c)| c.clone());
        self.samples.push_back((now, counts.to_vec()));
        counts
            .iter()
            .enumerate()
            .map(|(layer, cards)| {
                let was = base.as_ref().and_then(|b| b.get(layer));
                let delta: Vec<f64> = cards
                    .iter()
                    .enumerate()
                    .map(|(card, &n)| {
                        let before = was.and_then(|w| w.get(card)).copied().unwrap_or(0);
                        n.saturating_sub(before) as f64
                    })
                    .collect();
                (delta.iter().sum::<f64>() > 0.0).then(|| step::replicas::balancedness(&delta))
            })
            .collect()
    }
}

/// Where the server reads [`AfdStats`] from at each scrape of `/metrics`.
pub trait AfdStatsSource: Send + Sync {
    /// The current totals.
    fn snapshot(&self) -> AfdStats;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn balancedness_is_over_the_window_not_since_start() {
        let mut w = BalanceWindow::new(Duration::from_secs(10));
        let t0 = Instant::now();
        // Layer 0 even so far, layer 1 dense (no cards), layer 2 never reached.
        let got = w.observe(t0, &[vec![10, 10], vec![], vec![0, 0]]);
        assert_eq!(got, vec![Some(1.0), None, None]);
        // Then card 0 takes 30 more, card 1 10: 2/3 over that stretch (0.75 since start).
        let got = w.observe(
            t0 + Duration::from_secs(5),
            &[vec![40, 20], vec![], vec![0, 0]],
        );
        assert_eq!(
            got[0],
            Some(2.0 / 3.0),
            "differenced against the first sample"
        );
        let got = w.observe(
            t0 + Duration::from_secs(16),
            &[vec![40, 20], vec![], vec![0, 0]],
        );
        assert_eq!(
            got[0], None,
            "nothing since the base sample (5 s), 11 s ago"
        );
        let got = w.observe(
            t0 + Duration::from_secs(17),
            &[vec![40, 26], vec![], vec![4, 0]],
        );
        assert_eq!(got[0], Some(0.5), "only card 1's 6 since the base");
        assert_eq!(got[2], Some(0.5));
    }
}
