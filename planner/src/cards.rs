//! The cards' side of the system model: each card's share compiled by corsair-ffn's compiler
//! (placement, SRAM plan, spills) and timed by its performance model, through a table by
//! count per card and layer ([`LayerCosts`]) so that timing many loads stays cheap.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};

use corsair_ffn::perf::{LayerCosts, LayerLoad, LayerTime, lm_head_time};
use corsair_ffn::program::{LayerKind, Program};
use corsair_ffn::report::{CardSummary, summarize};
use serde::{Deserialize, Serialize};

use crate::expected::ExpectedLayer;

/// One card's memory as the plan reports it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CardMemory {
    /// The card's index.
    pub card: usize,
    /// Its share in words (experts, dense columns, LM-head rows).
    pub share: String,
    /// SRAM the program needs: resident weights and biases plus the transient pool.
    pub sram_bytes_needed: u64,
    /// SRAM on the card.
    pub sram_bytes_available: u64,
    /// SRAM by region kind (expert weights, dense weights, biases, I/O, activations, partial
    /// sums, staging, logits); transient kinds at their peak of live bytes.
    pub sram_by_kind: BTreeMap<String, u64>,
    /// LPDDR by region kind (the LM-head shard, spilled weights).
    pub lpddr_by_kind: BTreeMap<String, u64>,
    /// Matrices streamed from LPDDR every step because they did not fit in SRAM.
    pub spilled_matrices: usize,
    /// Their bytes.
    pub spilled_bytes: u64,
    /// Why the share does not fit (then the other fields are empty).
    pub error: Option<String>,
}

impl CardMemory {
    /// The report of a compiled card.
    pub fn from_summary(s: &CardSummary) -> Self {
        CardMemory {
            card: s.card,
            share: s.share.clone(),
            sram_bytes_needed: s.sram_used,
            sram_bytes_available: s.sram_capacity,
            sram_by_kind: s
                .sram
                .iter()
                .map(|u| (u.kind.to_string(), u.bytes))
                .collect(),
            lpddr_by_kind: s
                .lpddr
                .iter()
                .map(|u| (u.kind.to_string(), u.bytes))
                .collect(),
            spilled_matrices: s.spilled.len(),
            spilled_bytes: s.spilled_bytes,
            error: None,
        }
    }

    /// The report of a card whose share did not compile.
    pub fn failed(card: usize, sram_bytes_available: u64, error: String) -> Self {
        CardMemory {
            card,
            share: String::new(),
            sram_bytes_needed: 0,
            sram_bytes_available,
            sram_by_kind: BTreeMap::new(),
            lpddr_by_kind: BTreeMap::new(),
            spilled_matrices: 0,
            spilled_bytes: 0,
            error: Some(error),
        }
    }
}

/// Every card's compiled program, with the tables that time its layers by count.
#[derive(Debug)]
pub struct CardSet {
    programs: Vec<Program>,
    /// Per card and layer, its modeled time by count, filled as loads are timed.
    costs: Mutex<Vec<Vec<Option<LayerCosts>>>>,
    /// Uniform routing's expected figures of a layer, by (layer, tokens).
    expected: Mutex<HashMap<(usize, usize), Arc<ExpectedLayer>>>,
}

impl Clone for CardSet {
    fn clone(&self) -> Self {
        CardSet::new(self.programs.clone())
    }
}

impl CardSet {
    /// The cards of a deployment (every share compiled).
    pub fn new(programs: Vec<Program>) -> Self {
        let costs = programs
            .iter()
            .map(|p| vec![None; p.layers.len()])
            .collect();
        CardSet {
            programs,
            costs: Mutex::new(costs),
            expected: Mutex::new(HashMap::new()),
        }
    }

    /// The memory report of every card.
    pub fn memory(compiled: &[corsair_ffn::Compiled]) -> Vec<CardMemory> {
        compiled
            .iter()
            .map(|c| CardMemory::from_summary(&summarize(c)))
            .collect()
    }

    /// Number of cards.
    pub fn len(&self) -> usize {
        self.programs.len()
    }

    /// Whether there are no cards.
    pub fn is_empty(&self) -> bool {
        self.programs.is_empty()
    }

    /// Experts per token (0 without MoE layers).
    pub fn top_k(&self) -> usize {
        self.programs.first().map_or(0, |p| p.top_k)
    }

    /// Experts per MoE layer.
    pub fn num_experts(&self) -> usize {
        self.programs.first().map_or(0, |p| p.num_experts)
    }

    /// The rows one pass over an expert's weights of `layer` is worth, as the cards report it
    /// to the attention node (the least over the cards; `u32::MAX` where none has experts):
    /// what the dispatcher splits a replicated expert's rows by ([`step::replicas`]).
    pub fn rows_per_weight_read(&self, layer: usize) -> u32 {
        self.split_figures(layer).0
    }

    /// Of [`Self::rows_per_weight_read`], the rows a copy costs however many it computes, from
    /// the same card (as the node takes them:
    /// `gpu_attention::dispatch::ExpertPlacement::with_card_reports`); 0 where none has experts.
    pub fn fixed_rows_per_copy(&self, layer: usize) -> u32 {
        self.split_figures(layer).1
    }

    /// The least `(rows_per_weight_read, fixed_rows_per_copy)` of `layer` over the cards.
    fn split_figures(&self, layer: usize) -> (u32, u32) {
        let mut costs = self.costs.lock().unwrap_or_else(PoisonError::into_inner);
        self.programs
            .iter()
            .zip(costs.iter_mut())
            .filter_map(|(program, per_layer)| {
                per_layer.get_mut(layer).map(|slot| {
                    let costs = slot.get_or_insert_with(|| LayerCosts::new(program, layer));
                    (
                        costs.rows_per_weight_read(program),
                        costs.fixed_rows_per_copy(program),
                    )
                })
            })
            .min()
            .unwrap_or((u32::MAX, 0))
    }

    /// Modeled time of `layer` on `card` for the rows it was sent: `rows` tokens, of which
    /// `expert_rows[i]` went to its `i`-th local expert (its program's order; see
    /// [`CardSet::local_experts_of`]). A card sent nothing is not called.
    pub fn observed_layer_time(
        &self,
        card: usize,
        layer: usize,
        rows: usize,
        expert_rows: &[usize],
    ) -> LayerTime {
        let Some(program) = self.programs.get(card).filter(|_| rows > 0) else {
            return LayerTime::default();
        };
        let load = LayerLoad {
            tokens: rows,
            expert_rows: expert_rows.to_vec(),
        };
        let mut costs = self.costs.lock().unwrap_or_else(PoisonError::into_inner);
        match costs.get_mut(card).and_then(|c| c.get_mut(layer)) {
            Some(slot) => slot
                .get_or_insert_with(|| LayerCosts::new(program, layer))
                .time(program, &load),
            None => LayerTime::default(),
        }
    }

    /// Uniform routing's expected figures of `layer` for a micro-batch of `tokens` tokens:
    /// each card's mean time, the mean time of the slowest card, and the mean rows sent
    /// (see [`crate::expected`]).
    pub fn expected_layer(&self, layer: usize, tokens: usize) -> Arc<ExpectedLayer> {
        let key = (layer, tokens);
        if let Some(e) = self
            .expected
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&key)
        {
            return Arc::clone(e);
        }
        let e = Arc::new(crate::expected::expected_layer(self, layer, tokens));
        self.expected
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(key, Arc::clone(&e));
        e
    }

    /// The experts of `layer` that `card` holds, in its program's order (empty for a dense
    /// layer or an unknown card).
    pub fn local_experts_of(&self, card: usize, layer: usize) -> &[u32] {
        match self
            .programs
            .get(card)
            .and_then(|p| p.layers.get(layer))
            .map(|l| &l.kind)
        {
            Some(LayerKind::Moe { experts, .. }) => experts,
            _ => &[],
        }
    }

    /// The cards holding columns of dense layer `layer`, ascending (empty for a MoE layer).
    pub fn dense_cards(&self, layer: usize) -> Vec<usize> {
        self.programs
            .iter()
            .enumerate()
            .filter(|(_, p)| {
                matches!(
                    p.layers.get(layer).map(|l| &l.kind),
                    Some(LayerKind::Dense { columns, .. }) if !columns.is_empty()
                )
            })
            .map(|(c, _)| c)
            .collect()
    }

    /// The programs, in card order.
    pub fn programs(&self) -> &[Program] {
        &self.programs
    }

    /// Modeled time of the LM head for `tokens` rows on the slowest card.
    pub fn lm_head_time(&self, tokens: usize) -> LayerTime {
        self.programs
            .iter()
            .map(|p| lm_head_time(p, tokens))
            .max_by(|a, b| a.seconds.total_cmp(&b.seconds))
            .unwrap_or_default()
    }
}
