//! A card's share of the model ([`CardAssignment`]) and the default placement planner.
//!
//! The share travels in the control plane (serde). Per MoE layer it lists the expert ids the
//! card holds; per dense layer a column range of the intermediate dimension (the card computes
//! `down[:, cols] @ act(gate[cols] x, up[cols] x)`, a partial sum); and a row range of the LM
//! head's vocabulary.

use std::sync::Arc;

use model::ModelConfig;
use model::config::FfnKind;
use model::weights::ExpertFilter;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::numerics::BLOCK;

/// A half-open range `[start, end)` of rows or columns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub struct Span {
    /// First index.
    pub start: usize,
    /// One past the last index.
    pub end: usize,
}

impl Span {
    /// `[start, end)`.
    pub fn new(start: usize, end: usize) -> Self {
        Span { start, end }
    }

    /// Number of indices.
    pub fn len(&self) -> usize {
        self.end.saturating_sub(self.start)
    }

    /// Whether the range is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether `i` is inside.
    pub fn contains(&self, i: usize) -> bool {
        self.start <= i && i < self.end
    }
}

impl std::fmt::Display for Span {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}..{}", self.start, self.end)
    }
}

/// What a card holds of one layer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum LayerShare {
    /// Experts of a MoE layer, ascending ids.
    Moe {
        /// Expert ids held by this card.
        experts: Vec<u32>,
    },
    /// Intermediate columns of a dense FFN layer.
    Dense {
        /// Columns of the intermediate dimension.
        columns: Span,
    },
}

/// One card's share of the model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CardAssignment {
    /// This card's index.
    pub card: usize,
    /// Cards in the deployment.
    pub cards: usize,
    /// One entry per decoder layer.
    pub layers: Vec<LayerShare>,
    /// Vocabulary rows of the LM head.
    pub lm_head_rows: Span,
}

impl CardAssignment {
    /// Whether this card holds `expert` of `layer`.
    pub fn holds(&self, layer: usize, expert: usize) -> bool {
        matches!(self.layers.get(layer), Some(LayerShare::Moe { experts }) if experts.contains(&(expert as u32)))
    }

    /// The expert filter for loading just this card's experts.
    pub fn expert_filter(&self) -> ExpertFilter {
        let me = self.clone();
        ExpertFilter::Only(Arc::new(move |layer, expert| me.holds(layer, expert)))
    }

    /// Experts held, summed over layers.
    pub fn expert_count(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerShare::Moe { experts } => experts.len(),
                LayerShare::Dense { .. } => 0,
            })
            .sum()
    }

    /// Checks the share against the model shape.
    pub fn validate(&self, config: &ModelConfig) -> Result<()> {
        let fail = |m: String| Err(Error::Assignment(format!("card {}: {m}", self.card)));
        if self.layers.len() != config.num_layers() {
            return fail(format!(
                "{} layer entries for a model of {} layers",
                self.layers.len(),
                config.num_layers()
            ));
        }
        for (l, (share, spec)) in self.layers.iter().zip(&config.layers).enumerate() {
            match (share, spec.ffn) {
                (LayerShare::Moe { experts }, FfnKind::Moe) => {
                    let n = config.moe.map_or(0, |m| m.num_experts);
                    if let Some(e) = experts.iter().find(|&&e| e as usize >= n) {
                        return fail(format!(
                            "layer {l}: expert {e} does not exist (the model has {n})"
                        ));
                    }
                    if experts.windows(2).any(|w| w[0] >= w[1]) {
                        return fail(format!(
                            "layer {l}: expert ids must be ascending and distinct"
                        ));
                    }
                }
                (LayerShare::Dense { columns }, FfnKind::Dense) => {
                    let i = config.dense_intermediate_size.unwrap_or(0);
                    if columns.end > i || columns.start > columns.end {
                        return fail(format!(
                            "layer {l}: columns {columns} outside the intermediate size {i}"
                        ));
                    }
                }
                (_, kind) => {
                    return fail(format!("layer {l} is {kind:?} but its share is not"));
                }
            }
        }
        let r = self.lm_head_rows;
        if r.end > config.vocab_size || r.start > r.end {
            return fail(format!(
                "LM-head rows {r} outside the vocabulary of {}",
                config.vocab_size
            ));
        }
        Ok(())
    }
}

/// A replica of a hot expert on a second card.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertReplica {
    /// The layer, or every MoE layer when `None`.
    pub layer: Option<usize>,
    /// The expert id.
    pub expert: u32,
}

impl ExpertReplica {
    /// The replicas `listed`, plus, when `every_expert`, one extra copy of every expert of
    /// every MoE layer of `config` (each on the card after its primary: with two cards, every
    /// card then holds every expert).
    pub fn placed(
        listed: Vec<ExpertReplica>,
        every_expert: bool,
        config: &ModelConfig,
    ) -> Vec<ExpertReplica> {
        let n = if every_expert {
            config.moe.map_or(0, |m| m.num_experts) as u32
        } else {
            0
        };
        let mut out = listed;
        out.extend((0..n).map(|expert| ExpertReplica {
            layer: None,
            expert,
        }));
        out
    }
}

/// How to spread the model over cards.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct PlacementOptions {
    /// Number of cards (at least 1).
    pub cards: usize,
    /// Extra copies of hot experts, each on the card after its primary.
    #[serde(default)]
    pub replicas: Vec<ExpertReplica>,
}

/// `[start, end)` of part `i` when `n` items are split into `parts` contiguous parts, the first
/// `n % parts` parts one larger.
pub fn split_even(n: usize, parts: usize, i: usize) -> Span {
    let base = n / parts;
    let extra = n % parts;
    let start = i * base + i.min(extra);
    Span::new(start, start + base + usize::from(i < extra))
}

/// The default placement: contiguous blocks of experts per card (uneven counts allowed), dense
/// layers split by intermediate columns in whole blocks of 32, LM-head rows split evenly, and
/// the requested replicas.
pub fn plan_placement(
    config: &ModelConfig,
    options: &PlacementOptions,
) -> Result<Vec<CardAssignment>> {
    let cards = options.cards;
    if cards == 0 {
        return Err(Error::Assignment("at least one card is needed".into()));
    }
    let mut out: Vec<CardAssignment> = (0..cards)
        .map(|card| CardAssignment {
            card,
            cards,
            layers: Vec::with_capacity(config.num_layers()),
            lm_head_rows: split_even(config.vocab_size, cards, card),
        })
        .collect();
    for spec in &config.layers {
        for (card, a) in out.iter_mut().enumerate() {
            a.layers.push(match spec.ffn {
                FfnKind::Moe => {
                    let n = config.moe.map_or(0, |m| m.num_experts);
                    let span = split_even(n, cards, card);
                    LayerShare::Moe {
                        experts: (span.start as u32..span.end as u32).collect(),
                    }
                }
                FfnKind::Dense => {
                    let i = config.dense_intermediate_size.unwrap_or(0);
                    let units = split_even(i.div_ceil(BLOCK), cards, card);
                    LayerShare::Dense {
                        columns: Span::new(
                            (units.start * BLOCK).min(i),
                            (units.end * BLOCK).min(i),
                        ),
                    }
                }
            });
        }
    }
    for rep in &options.replicas {
        let n = config.moe.map_or(0, |m| m.num_experts);
        if rep.expert as usize >= n {
            return Err(Error::Assignment(format!(
                "replica of expert {} asked, but the model has {n} experts",
                rep.expert
            )));
        }
        if cards == 1 {
            continue;
        }
        let primary = (0..cards)
            .find(|&c| split_even(n, cards, c).contains(rep.expert as usize))
            .unwrap_or(0);
        let target = (primary + 1) % cards;
        for (l, spec) in config.layers.iter().enumerate() {
            if spec.ffn != FfnKind::Moe || rep.layer.is_some_and(|want| want != l) {
                continue;
            }
            if let LayerShare::Moe { experts } = &mut out[target].layers[l]
                && !experts.contains(&rep.expert)
            {
                experts.push(rep.expert);
                experts.sort_unstable();
            }
        }
        if let Some(l) = rep.layer
            && config.layers.get(l).is_none_or(|s| s.ffn != FfnKind::Moe)
        {
            return Err(Error::Assignment(format!(
                "replica for layer {l}, which is not a MoE layer"
            )));
        }
    }
    for a in &out {
        a.validate(config)?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synthetic::tiny_config;
    use proptest::prelude::*;

    #[test]
    fn eight_experts_on_three_cards_is_three_three_two() {
        let cfg = tiny_config(8, 2, 64, 32, &[FfnKind::Moe]);
        let plan = plan_placement(
            &cfg,
            &PlacementOptions {
                cards: 3,
                replicas: vec![],
            },
        )
        .unwrap();
        let counts: Vec<usize> = plan.iter().map(|a| a.expert_count()).collect();
        assert_eq!(counts, vec![3, 3, 2]);
        assert!(plan[2].holds(0, 7) && !plan[2].holds(0, 5));
    }

    #[test]
    fn replicas_go_to_the_next_card() {
        let cfg = tiny_config(8, 2, 64, 32, &[FfnKind::Moe, FfnKind::Moe]);
        let opts = PlacementOptions {
            cards: 2,
            replicas: vec![ExpertReplica {
                layer: Some(1),
                expert: 6,
            }],
        };
        let plan = plan_placement(&cfg, &opts).unwrap();
        assert!(plan[0].holds(1, 6) && plan[1].holds(1, 6));
        assert!(!plan[0].holds(0, 6));
        let json = serde_json::to_string(&plan[0]).unwrap();
        assert_eq!(
            serde_json::from_str::<CardAssignment>(&json).unwrap(),
            plan[0]
        );
    }

    #[test]
    fn bad_assignments_are_rejected() {
        let cfg = tiny_config(4, 2, 64, 32, &[FfnKind::Moe]);
        let mut a = plan_placement(
            &cfg,
            &PlacementOptions {
                cards: 1,
                replicas: vec![],
            },
        )
        .unwrap()
        .remove(0);
        a.layers[0] = LayerShare::Moe { experts: vec![9] };
        assert!(
            a.validate(&cfg)
                .unwrap_err()
                .to_string()
                .contains("expert 9")
        );
    }

    proptest! {
        #[test]
        fn every_expert_column_and_row_is_placed_once(
            experts in 1usize..40, cards in 1usize..9, inter in 1usize..300, vocab in 1usize..500,
        ) {
            let mut cfg = tiny_config(experts, 1, 64, 32, &[FfnKind::Moe, FfnKind::Dense]);
            cfg.dense_intermediate_size = Some(inter);
            cfg.vocab_size = vocab;
            let plan = plan_placement(&cfg, &PlacementOptions { cards, replicas: vec![] }).unwrap();
            for e in 0..experts {
                prop_assert_eq!(plan.iter().filter(|a| a.holds(0, e)).count(), 1);
            }
            let mut next_col = 0;
            let mut next_row = 0;
            for a in &plan {
                let LayerShare::Dense { columns } = a.layers[1] else { panic!() };
                prop_assert_eq!(columns.start, next_col);
                prop_assert!(columns.is_empty() || columns.start % BLOCK == 0);
                next_col = columns.end;
                prop_assert_eq!(a.lm_head_rows.start, next_row);
                next_row = a.lm_head_rows.end;
            }
            prop_assert_eq!(next_col, inter);
            prop_assert_eq!(next_row, vocab);
        }
    }
}
