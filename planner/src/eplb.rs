//! Rebalancing while serving (`afd serve --eplb`), the deterministic part: the routing of the
//! last `window` steps ([`LoadWindow`]), when to look at it ([`EplbSettings::step_interval`]),
//! and whether the placement by that load ([`crate::balance`]) is worth a move
//! ([`decide_move`]). Moving the weights and switching the nodes is the deployment's shell.

use corsair_ffn::CardAssignment;
use model::ModelConfig;
use std::collections::VecDeque;

use crate::balance::{BalancedPlacement, ExpertLoad, balance};
use crate::error::Result;

/// How the placement follows the load while serving (vLLM's EPLB settings, by its names).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EplbSettings {
    /// Steps of routing a new placement is computed from (`--eplb-window`).
    pub window: usize,
    /// Steps between two looks at the load (`--eplb-step-interval`).
    pub step_interval: u64,
    /// Extra copies per MoE layer beyond one of each expert (`--num-redundant-experts`).
    pub num_redundant_experts: usize,
    /// Equal groups of cards each expert's copies stay inside (`--card-groups`; 0 or 1: one).
    pub card_groups: usize,
    /// How much more even (mean balancedness over the MoE layers, on the window's load) a new
    /// placement must be to be worth moving weights for (`--eplb-min-gain`). A placement fit to
    /// a window always looks better on that window than on the next: on Zipf-skewed traffic
    /// (docs/bench/notes/2026-12-07-eplb.md) a gain of 0.02 moved the experts at 49% of the
    /// looks with 256-step windows and 0.1 at one look in a phase, both settling at the same
    /// balancedness.
    pub min_gain: f64,
}

impl Default for EplbSettings {
    fn default() -> Self {
        EplbSettings {
            window: 1000,
            step_interval: 3000,
            num_redundant_experts: 0,
            card_groups: 1,
            min_gain: 0.1,
        }
    }
}

/// Per MoE layer, how many tokens each expert received over the last `window` steps.
#[derive(Debug, Clone)]
pub struct LoadWindow {
    window: usize,
    experts: usize,
    moe: Vec<bool>,
    /// Per step in the window (oldest first), its counts per (layer, expert), flattened as
    /// `layer * experts + expert`: the model's shape bounds a step's memory, not its batch
    /// (a 512-token prefill of GPT-OSS-20B routes 2,048 ids a layer, its counts are 32).
    steps: VecDeque<Vec<u32>>,
    totals: Vec<u64>,
    seen: u64,
}

impl LoadWindow {
    /// An empty window of `window` steps (at least 1) for a model with `moe_layers` (true for
    /// each MoE layer) and `experts` experts.
    pub fn new(moe_layers: &[bool], experts: usize, window: usize) -> Self {
        LoadWindow {
            window: window.max(1),
            experts,
            moe: moe_layers.to_vec(),
            steps: VecDeque::new(),
            totals: vec![0; moe_layers.len() * experts],
            seen: 0,
        }
    }

    /// Adds one step's routing (per layer: the experts every token of the step was routed to,
    /// `None` for a dense layer), dropping the oldest step beyond the window. Ids past the
    /// model's experts and layers past its depth are ignored.
    pub fn observe(&mut self, layers: &[Option<Vec<u32>>]) {
        let mut counts = vec![0u32; self.totals.len()];
        for (layer, ids) in layers.iter().enumerate().take(self.moe.len()) {
            let Some(ids) = ids.as_ref().filter(|_| self.moe[layer]) else {
                continue;
            };
            for &e in ids {
                if (e as usize) < self.experts {
                    counts[layer * self.experts + e as usize] += 1;
                }
            }
        }
        self.observe_counts(counts);
    }

    /// Adds one step given as counts per (layer, expert), flattened as `layer * experts +
    /// expert` (what a routing record's window holds); a short vector counts the rest as 0.
    pub fn observe_counts(&mut self, mut counts: Vec<u32>) {
        counts.resize(self.totals.len(), 0);
        for (t, &c) in self.totals.iter_mut().zip(&counts) {
            *t += u64::from(c);
        }
        self.steps.push_back(counts);
        if self.steps.len() > self.window
            && let Some(old) = self.steps.pop_front()
        {
            for (t, &c) in self.totals.iter_mut().zip(&old) {
                *t -= u64::from(c);
            }
        }
        self.seen += 1;
    }

    /// Steps observed since the window was made.
    pub fn steps_seen(&self) -> u64 {
        self.seen
    }

    /// Steps in the window now.
    pub fn len(&self) -> usize {
        self.steps.len()
    }

    /// Whether no step is in the window.
    pub fn is_empty(&self) -> bool {
        self.steps.is_empty()
    }

    /// The window's load.
    pub fn load(&self) -> ExpertLoad {
        ExpertLoad {
            layers: self
                .moe
                .iter()
                .enumerate()
                .map(|(layer, &moe)| {
                    if moe {
                        self.totals[layer * self.experts..(layer + 1) * self.experts].to_vec()
                    } else {
                        Vec::new()
                    }
                })
                .collect(),
        }
    }

    /// Experts per MoE layer.
    pub fn experts(&self) -> usize {
        self.experts
    }
}

/// What a look at the load decided.
#[derive(Debug, Clone, PartialEq)]
pub enum MoveDecision {
    /// Move to this placement (its `before` is the serving placement's balancedness on the
    /// load, its `after` the new one's).
    Move(BalancedPlacement),
    /// Stay: the load gives nothing to act on, or the gain is below the threshold.
    Stay {
        /// Mean balancedness of the serving placement on the load.
        now: f64,
        /// Mean balancedness the best placement would reach.
        best: f64,
    },
}

/// Whether the placement by `load` is worth moving to from `serving` (one assignment per card,
/// the placement in use): only when its mean balancedness gains at least `settings.min_gain`
/// and some card's experts change. An empty load (no token routed) never moves.
pub fn decide_move(
    config: &ModelConfig,
    load: &ExpertLoad,
    serving: &[CardAssignment],
    settings: &EplbSettings,
) -> Result<MoveDecision> {
    let placed = balance(
        config,
        load,
        serving,
        settings.num_redundant_experts,
        settings.card_groups,
    )?;
    let (now, best) = (placed.mean_before(), placed.mean_after());
    let routed: u64 = load.layers.iter().flatten().sum();
    if routed == 0 || best < now + settings.min_gain || placed.assignments(serving) == serving {
        return Ok(MoveDecision::Stay { now, best });
    }
    Ok(MoveDecision::Move(placed))
}

#[cfg(test)]
mod tests {
    use super::*;
    use corsair_ffn::{PlacementOptions, plan_placement};

    fn serving(config: &ModelConfig, cards: usize) -> Vec<CardAssignment> {
        plan_placement(
            config,
            &PlacementOptions {
                cards,
                replicas: Vec::new(),
            },
        )
        .unwrap()
    }

    #[test]
    fn the_window_keeps_the_last_steps_only() {
        let mut w = LoadWindow::new(&[true, false], 4, 2);
        w.observe(&[Some(vec![0, 0, 1]), None]);
        w.observe(&[Some(vec![2]), Some(vec![3])]);
        assert_eq!(w.load().layers, vec![vec![2, 1, 1, 0], vec![]]);
        w.observe(&[Some(vec![3, 3, 9]), None]);
        // The first step left the window; id 9 is not an expert.
        assert_eq!(w.load().layers, vec![vec![0, 0, 1, 2], vec![]]);
        assert_eq!((w.len(), w.steps_seen()), (2, 3));
    }

    #[test]
    fn a_skewed_load_moves_and_an_even_one_stays() {
        let (config, _) = crate::named_shape(model::Family::GptOss, "tiny").unwrap();
        let m = config.moe.unwrap();
        let moe = config.moe_layers();
        let now = serving(&config, 2);
        let settings = EplbSettings {
            num_redundant_experts: 2,
            ..EplbSettings::default()
        };
        let even = ExpertLoad {
            layers: moe
                .iter()
                .map(|&is| {
                    if is {
                        vec![10; m.num_experts]
                    } else {
                        Vec::new()
                    }
                })
                .collect(),
        };
        match decide_move(&config, &even, &now, &settings).unwrap() {
            MoveDecision::Stay { now, .. } => assert!((now - 1.0).abs() < 1e-9),
            other => panic!("an even load moved: {other:?}"),
        }
        // Every token to expert 0, which the contiguous placement puts on card 0 alone.
        let skewed = ExpertLoad {
            layers: moe
                .iter()
                .map(|&is| {
                    if is {
                        let mut l = vec![0; m.num_experts];
                        l[0] = 100;
                        l[m.num_experts - 1] = 10;
                        l
                    } else {
                        Vec::new()
                    }
                })
                .collect(),
        };
        let MoveDecision::Move(placed) = decide_move(&config, &skewed, &now, &settings).unwrap()
        else {
            panic!("a skewed load stayed");
        };
        assert!(placed.mean_after() >= placed.mean_before() + settings.min_gain);
        let moved = placed.assignments(&now);
        assert_ne!(moved, now);
        // Moving again on the same load gains nothing.
        assert!(matches!(
            decide_move(&config, &skewed, &moved, &settings).unwrap(),
            MoveDecision::Stay { .. }
        ));
        // Nothing routed: nothing to act on.
        let empty = ExpertLoad {
            layers: skewed.layers.iter().map(|l| vec![0; l.len()]).collect(),
        };
        assert!(matches!(
            decide_move(&config, &empty, &now, &settings).unwrap(),
            MoveDecision::Stay { .. }
        ));
    }
}
