//! The modeled time of a step a scheduler made: the planner's system model
//! ([`planner::System::step_time`]) applied to the step's real batch and to the routing its
//! tokens took, dispatched as the attention node dispatches (gpu-attention's
//! [`plan_dispatch`], replicas included).
//!
//! The micro-batches are cut as the node cuts them ([`micro_batch_ranges`]); under `auto` the
//! step is timed both ways and the faster taken, as the node on that hardware would learn to
//! (the host's own choice, made on the CPU that simulates the cards, is not what is modeled).

use std::time::Duration;

use corsair_ffn::compiler::StoredFormats;
use gpu_attention::dispatch::{ExpertPlacement, plan_dispatch};
use gpu_attention::node::micro_batch_ranges;
use model::ModelConfig;
use model::config::FfnKind;
use model::forward::moe::Routing as TokenRouting;
use planner::{
    Attending, CardRows, CardSet, MicroBatchShape, Profiles, Routing, Span, StepDetail, StepShape,
    System, Target, TokenGroup,
};
use proto::data::NO_EXPERT;
use step::{MicroBatches, StepBatch, StepRouting, StepTimer};

use crate::error::{Error, Result};

/// A deployment's hardware, for timing steps: the model, the profiles, the cards' programs and
/// where their experts are.
#[derive(Debug, Clone)]
pub struct StepModel {
    config: ModelConfig,
    profiles: Profiles,
    cards: Option<CardSet>,
    placement: Option<ExpertPlacement>,
    micro_batches: MicroBatches,
    nodes: usize,
    wire_bytes: usize,
    chunk_tokens: usize,
}

/// One step as the model times it.
#[derive(Debug, Clone, PartialEq)]
pub struct ModeledStep {
    /// The time and its breakdown, layer by layer.
    pub detail: StepDetail,
    /// The micro-batches' entry ranges as timed.
    pub micro_batches: Vec<std::ops::Range<usize>>,
}

impl ModeledStep {
    /// The step's modeled duration (to the nanosecond).
    pub fn duration(&self) -> Duration {
        Duration::from_secs_f64(self.detail.time.seconds.max(0.0))
    }
}

impl StepModel {
    /// The step model of `target` (its cards compiled as the planner compiles them).
    pub fn new(
        target: &Target,
        config: ModelConfig,
        stored: &StoredFormats,
        profiles: Profiles,
    ) -> Result<Self> {
        let (cards, placement) = if target.is_monolithic() {
            (None, None)
        } else {
            let compiled = planner::compile_cards(target, &config, stored, &profiles.card)?;
            let Some(set) = compiled.set else {
                return Err(Error::Config(format!(
                    "{}: the cards' shares do not compile: {}",
                    target.source,
                    compiled.problems.join("; ")
                )));
            };
            let placement = placement_of(&config, &set)?;
            (Some(set), Some(placement))
        };
        Ok(StepModel {
            config,
            profiles,
            cards,
            placement,
            micro_batches: target.micro_batches,
            nodes: target.attention.nodes,
            wire_bytes: target.attention.wire_bytes,
            chunk_tokens: target.attention.max_num_batched_tokens,
        })
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The cards' programs (`None`: the attention device alone).
    pub fn cards(&self) -> Option<&CardSet> {
        self.cards.as_ref()
    }

    /// Where the experts are (`None` without cards).
    pub fn placement(&self) -> Option<&ExpertPlacement> {
        self.placement.as_ref()
    }

    /// The profiles.
    pub fn profiles(&self) -> &Profiles {
        &self.profiles
    }

    /// The planner's system model of this deployment.
    pub fn system(&self) -> System<'_> {
        System {
            model: &self.config,
            device: &self.profiles.device,
            network: &self.profiles.network,
            cards: self.cards.as_ref(),
            nodes: self.nodes,
            micro_batches: self.micro_batches,
            wire_bytes: self.wire_bytes,
            chunk_tokens: self.chunk_tokens,
            lm_head_candidates: planner::LM_HEAD_CANDIDATES,
        }
    }

    /// Times `batch` with the routing its tokens took (`None`: uniform routing in expectation,
    /// for nodes that do not report routing), while `placement` holds the experts (the
    /// deployment's, or the live cards' after a failure) and `nodes_busy` attention nodes share
    /// the cards.
    pub fn time_with(
        &self,
        batch: &StepBatch,
        routing: Option<&StepRouting>,
        placement: Option<&ExpertPlacement>,
        nodes_busy: usize,
    ) -> ModeledStep {
        let tokens: Vec<usize> = batch.entries.iter().map(|e| e.tokens.len()).collect();
        let choices: &[bool] = if self.cards.is_none() || batch.entries.len() < 2 {
            &[false]
        } else {
            match self.micro_batches {
                MicroBatches::One => &[false],
                MicroBatches::Two => &[true],
                MicroBatches::Auto => &[false, true],
            }
        };
        let mut best: Option<ModeledStep> = None;
        for &two in choices {
            let ranges = micro_batch_ranges(&tokens, two);
            let detail = self.time_split(batch, routing, placement, nodes_busy, &ranges);
            if best
                .as_ref()
                .is_none_or(|b| detail.time.seconds < b.detail.time.seconds)
            {
                best = Some(ModeledStep {
                    detail,
                    micro_batches: ranges,
                });
            }
        }
        best.unwrap_or_else(|| ModeledStep {
            detail: StepDetail::default(),
            micro_batches: Vec::new(),
        })
    }

    /// [`StepModel::time_with`] on the deployment's own placement.
    pub fn time(
        &self,
        batch: &StepBatch,
        routing: Option<&StepRouting>,
        nodes_busy: usize,
    ) -> ModeledStep {
        self.time_with(batch, routing, self.placement.as_ref(), nodes_busy)
    }

    fn time_split(
        &self,
        batch: &StepBatch,
        routing: Option<&StepRouting>,
        placement: Option<&ExpertPlacement>,
        nodes_busy: usize,
        ranges: &[std::ops::Range<usize>],
    ) -> StepDetail {
        // Per micro-batch: its spans, and (observed) its per-layer card rows.
        let mut spans: Vec<Vec<Span>> = Vec::with_capacity(ranges.len());
        let mut loads: Vec<Option<Vec<Vec<CardRows>>>> = Vec::with_capacity(ranges.len());
        let mut row = 0;
        for range in ranges {
            let entries = &batch.entries[range.clone()];
            spans.push(
                entries
                    .iter()
                    .map(|e| Span {
                        new: e.tokens.len(),
                        past: e.start,
                    })
                    .collect(),
            );
            let rows: usize = entries.iter().map(|e| e.tokens.len()).sum();
            let keys: Vec<u64> = entries
                .iter()
                .flat_map(|e| (e.start..e.start + e.tokens.len()).map(|p| p as u64))
                .collect();
            loads.push(match (routing, placement, &self.cards) {
                (Some(r), Some(p), Some(cards)) => Some(self.card_rows(r, p, cards, row, &keys)),
                _ => None,
            });
            row += rows;
        }
        let micro_batches: Vec<MicroBatchShape<'_>> = spans
            .iter()
            .zip(&loads)
            .map(|(spans, load)| MicroBatchShape {
                group: TokenGroup {
                    tokens: spans.iter().map(|s| s.new).sum(),
                    sequences: spans.len(),
                    attending: Attending::Spans(spans),
                },
                routing: match load {
                    Some(l) => Routing::Observed(l),
                    None => Routing::Expected,
                },
            })
            .collect();
        self.system().step_time(&StepShape {
            micro_batches,
            sample_rows: batch.entries.iter().filter(|e| e.sample.is_some()).count(),
            nodes: nodes_busy.max(1),
        })
    }

    /// The rows each card gets in every layer for the tokens `first..first + keys.len()` of
    /// the step (keys: their positions, which pick among replicas as the node picks).
    fn card_rows(
        &self,
        routing: &StepRouting,
        placement: &ExpertPlacement,
        cards: &CardSet,
        first: usize,
        keys: &[u64],
    ) -> Vec<Vec<CardRows>> {
        let k = routing.top_k;
        let n = keys.len();
        (0..self.config.num_layers())
            .map(|layer| {
                let is_moe = self.config.layers.get(layer).map(|l| l.ffn) == Some(FfnKind::Moe);
                match routing.layers.get(layer) {
                    Some(Some(experts)) if is_moe && k > 0 => {
                        let Some(mine) = experts.get(first * k..(first + n) * k) else {
                            return Vec::new();
                        };
                        let token_routing = TokenRouting {
                            top_k: k,
                            experts: mine.to_vec(),
                            weights: vec![0.0; mine.len()],
                        };
                        let plan = plan_dispatch(&token_routing, layer, placement, keys);
                        plan.cards
                            .iter()
                            .map(|c| {
                                let local = cards.local_experts_of(c.card, layer);
                                let mut expert_rows = vec![0usize; local.len()];
                                for &e in c.experts.iter().filter(|&&e| e != NO_EXPERT) {
                                    if let Ok(i) = local.binary_search(&e) {
                                        expert_rows[i] += 1;
                                    }
                                }
                                CardRows {
                                    card: c.card,
                                    rows: c.rows.len(),
                                    expert_rows,
                                }
                            })
                            .collect()
                    }
                    // A dense layer: every card holding its columns gets every row.
                    _ => cards
                        .dense_cards(layer)
                        .into_iter()
                        .map(|card| CardRows {
                            card,
                            rows: n,
                            expert_rows: Vec::new(),
                        })
                        .collect(),
                }
            })
            .collect()
    }
}

/// Which cards hold each expert, from the cards' programs.
pub fn placement_of(config: &ModelConfig, cards: &CardSet) -> Result<ExpertPlacement> {
    let layers = config.num_layers();
    let card_experts: Vec<Vec<Vec<u32>>> = (0..cards.len())
        .map(|c| {
            (0..layers)
                .map(|l| cards.local_experts_of(c, l).to_vec())
                .collect()
        })
        .collect();
    let per_layer: Vec<u32> = (0..layers).map(|l| cards.rows_per_weight_read(l)).collect();
    let fixed: Vec<u32> = (0..layers).map(|l| cards.fixed_rows_per_copy(l)).collect();
    ExpertPlacement::for_model(config, &card_experts)
        .map(|p| {
            p.with_rows_per_weight_read(&per_layer)
                .with_fixed_rows_per_copy(&fixed)
        })
        .map_err(|e| Error::Config(format!("the cards' programs place the experts so: {e}")))
}

/// A [`StepModel`] as the step timer of a modeled clock.
#[derive(Debug, Clone)]
pub struct ModeledTimer {
    /// The model.
    pub model: std::sync::Arc<StepModel>,
}

impl StepTimer for ModeledTimer {
    fn step_duration(
        &mut self,
        batch: &StepBatch,
        routing: Option<&StepRouting>,
        nodes_busy: usize,
    ) -> Duration {
        self.model.time(batch, routing, nodes_busy).duration()
    }
}
