//! The cards' side of the system model: each card's share compiled by corsair-ffn's compiler
//! (placement, SRAM plan, spills) and timed by its performance model.

use std::collections::BTreeMap;

use corsair_ffn::perf::{LayerLoad, LayerTime, layer_time, lm_head_time};
use corsair_ffn::program::{LayerKind, Program};
use corsair_ffn::report::{CardSummary, summarize};
use serde::{Deserialize, Serialize};

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

/// Every card's compiled program.
#[derive(Debug, Clone)]
pub struct CardSet {
    programs: Vec<Program>,
}

/// The `k` of `e` experts per token.
fn choose(n: usize, k: usize) -> f64 {
    if k > n {
        return 0.0;
    }
    (0..k).fold(1.0, |acc, i| acc * (n - i) as f64 / (k - i) as f64)
}

impl CardSet {
    /// The cards of a deployment (every share compiled).
    pub fn new(programs: Vec<Program>) -> Self {
        CardSet { programs }
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

    fn local_experts(program: &Program, layer: usize) -> usize {
        match program.layers.get(layer).map(|l| &l.kind) {
            Some(LayerKind::Moe { experts, .. }) => experts.len(),
            _ => 0,
        }
    }

    /// Expected number of cards one token's rows go to in `layer` (uniform routing: a card
    /// gets the row when any of the token's top-k experts is local to it), in thousandths.
    pub fn cards_per_token_milli(&self, layer: usize) -> u64 {
        let Some(p) = self.programs.first() else {
            return 0;
        };
        let (e, k) = (p.num_experts, p.top_k);
        if let Some(LayerKind::Dense { .. }) = p.layers.get(layer).map(|l| &l.kind) {
            // A dense layer: every card holding columns gets every row.
            let holding = self
                .programs
                .iter()
                .filter(|p| {
                    matches!(
                        p.layers.get(layer).map(|l| &l.kind),
                        Some(LayerKind::Dense { columns, .. }) if !columns.is_empty()
                    )
                })
                .count();
            return 1000 * holding as u64;
        }
        if e == 0 {
            return 0;
        }
        let all = choose(e, k);
        let d: f64 = self
            .programs
            .iter()
            .map(|p| {
                let local = Self::local_experts(p, layer);
                1.0 - choose(e - local.min(e), k) / all
            })
            .sum();
        (d * 1000.0).round() as u64
    }

    /// Modeled time of `layer` for `tokens` tokens on one card under balanced routing. With
    /// at least as many rows (`tokens * k`) as experts, every local expert gets
    /// `ceil(rows / experts)` rows. With fewer, the rows spread one per expert over the cards
    /// and the busiest card has `b = ceil(rows / cards)` busy experts, any `b` of its local
    /// ones: per-expert costs add up (the card runs instructions one after the other), so the
    /// expected time is the idle time plus `b / local` of the extra time with every local
    /// expert busy, whichever experts are resident and whichever spilled.
    fn card_layer_time(&self, program: &Program, layer: usize, tokens: usize) -> LayerTime {
        let local = Self::local_experts(program, layer);
        let rows = tokens * program.top_k;
        let e = program.num_experts.max(1);
        let load = |per_expert: usize| LayerLoad {
            tokens,
            expert_rows: vec![per_expert; local],
        };
        if rows >= e || local == 0 {
            return layer_time(program, layer, &load(rows.div_ceil(e).min(tokens)));
        }
        let busy = rows.div_ceil(self.programs.len().max(1)).min(local);
        let idle = layer_time(program, layer, &load(0));
        let all = layer_time(program, layer, &load(1));
        let f = busy as f64 / local as f64;
        let mix = |a: f64, b: f64| a + f * (b - a);
        LayerTime {
            seconds: mix(idle.seconds, all.seconds),
            lpddr_seconds: mix(idle.lpddr_seconds, all.lpddr_seconds),
            matmul_seconds: mix(idle.matmul_seconds, all.matmul_seconds),
            io_seconds: mix(idle.io_seconds, all.io_seconds),
        }
    }

    /// Modeled time of `layer` for `tokens` tokens on the slowest card.
    pub fn layer_time(&self, layer: usize, tokens: usize) -> LayerTime {
        self.programs
            .iter()
            .map(|p| self.card_layer_time(p, layer, tokens))
            .max_by(|a, b| a.seconds.total_cmp(&b.seconds))
            .unwrap_or_default()
    }

    /// Modeled time of `layer` on every card, for `tokens` tokens under uniform routing
    /// (expected, as [`CardSet::layer_time`] takes the slowest of them).
    pub fn expected_layer_times(&self, layer: usize, tokens: usize) -> Vec<LayerTime> {
        self.programs
            .iter()
            .map(|p| self.card_layer_time(p, layer, tokens))
            .collect()
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
        match self.programs.get(card) {
            Some(p) if rows > 0 => layer_time(
                p,
                layer,
                &LayerLoad {
                    tokens: rows,
                    expert_rows: expert_rows.to_vec(),
                },
            ),
            _ => LayerTime::default(),
        }
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

#[cfg(test)]
mod tests {
    use super::choose;

    #[test]
    fn binomials() {
        assert_eq!(choose(32, 4), 35960.0);
        assert_eq!(choose(28, 4), 20475.0);
        assert_eq!(choose(3, 4), 0.0);
    }
}
