//! The dispatch planner and the combine step (no I/O).
//!
//! After routing, each token's (expert, weight) slots are grouped by the card computing the
//! expert: each card receives only the rows it needs, each row with its local slots in the
//! token's top-k order. Partial sums come back per card and are added in ascending card order,
//! so the result never depends on which card answers first. An expert without replicas always
//! goes to its one card, so a token's arithmetic is the same alone or in any batch. The rows of
//! an expert with replicas go to the fewest of its holders that finish them soonest
//! ([`step::replicas`], the rule the planner models too): one holder while the expert's rows
//! cost less than a pass over its weights (the card then reads them once, and a token whose two
//! experts share a primary card still has them computed side by side), split over several
//! when it is compute bound. Such a token's f32 rounding can then depend on its batch (which
//! partial sums its experts' outputs are added in), as in engines that balance experts; the
//! split itself is a function of the step's routing alone.

use model::forward::moe::Routing;
use proto::data::NO_EXPERT;
use step::replicas::{RowShare, ShareCursor, SplitInput};

/// Which cards hold each expert of each layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertPlacement {
    /// `holders[layer][expert]`: cards holding that expert, ascending.
    holders: Vec<Vec<Vec<usize>>>,
    cards: usize,
    /// Per layer, the rows one pass over an expert's weights is worth on its cards
    /// ([`step::replicas`]); `u32::MAX` (the default) never splits an expert's rows.
    rows_per_weight_read: Vec<u32>,
    /// Per layer, the part of that a copy costs however many rows it computes (0 by default).
    fixed_rows_per_copy: Vec<u32>,
}

/// Why a placement is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    /// An expert no card holds.
    #[error("expert {expert} of layer {layer} is held by no card; every expert needs at least one")]
    Orphan {
        /// Layer.
        layer: usize,
        /// Expert.
        expert: usize,
    },
    /// A card claims an expert that does not exist.
    #[error(
        "card {card} claims expert {expert} of layer {layer}, but layers have {experts} experts"
    )]
    Unknown {
        /// Card.
        card: usize,
        /// Layer.
        layer: usize,
        /// Expert.
        expert: usize,
        /// Experts per layer.
        experts: usize,
    },
    /// A placement for another number of cards than the node's.
    #[error("a placement over {placement} cards for a node with {cards}")]
    Cards {
        /// Cards the placement names.
        placement: usize,
        /// Cards the node has.
        cards: usize,
    },
    /// Every card holding an expert is down.
    #[error(
        "expert {expert} of layer {layer} is held only by card(s) {cards:?}, which are down, and no \
         live card has a replica (add replicas under [cards] replicas to survive this)"
    )]
    Uncovered {
        /// Layer.
        layer: usize,
        /// Expert.
        expert: usize,
        /// The cards that hold it, all down.
        cards: Vec<usize>,
    },
}

impl ExpertPlacement {
    /// Builds the placement from each card's experts per layer (`card_experts[card][layer]`);
    /// layers that are not MoE have empty lists on every card.
    pub fn new(
        layers: usize,
        experts: usize,
        moe_layers: &[bool],
        card_experts: &[Vec<Vec<u32>>],
    ) -> Result<Self, PlacementError> {
        let mut holders = vec![vec![Vec::new(); experts]; layers];
        for (card, per_layer) in card_experts.iter().enumerate() {
            for (layer, list) in per_layer.iter().enumerate().take(layers) {
                for &e in list {
                    let e = e as usize;
                    if e >= experts {
                        return Err(PlacementError::Unknown {
                            card,
                            layer,
                            expert: e,
                            experts,
                        });
                    }
                    holders[layer][e].push(card);
                }
            }
        }
        for (layer, per_expert) in holders.iter_mut().enumerate() {
            if !moe_layers.get(layer).copied().unwrap_or(false) {
                continue;
            }
            for (expert, cards) in per_expert.iter_mut().enumerate() {
                if cards.is_empty() {
                    return Err(PlacementError::Orphan { layer, expert });
                }
                cards.sort_unstable();
                cards.dedup();
            }
        }
        Ok(ExpertPlacement {
            rows_per_weight_read: vec![u32::MAX; holders.len()],
            fixed_rows_per_copy: vec![0; holders.len()],
            holders,
            cards: card_experts.len(),
        })
    }

    /// The same placement splitting replicated experts' rows by what the cards report: per
    /// layer, the rows one pass over an expert's weights is worth (missing layers, and 0,
    /// never split).
    pub fn with_rows_per_weight_read(mut self, per_layer: &[u32]) -> Self {
        for (slot, &rows) in self.rows_per_weight_read.iter_mut().zip(per_layer) {
            *slot = if rows == 0 { u32::MAX } else { rows };
        }
        self
    }

    /// Per layer, the rows one pass over an expert's weights is worth (`u32::MAX`: never
    /// split).
    pub fn rows_per_weight_read(&self) -> &[u32] {
        &self.rows_per_weight_read
    }

    /// The same placement knowing, per layer, what part of a row's cost a copy pays however
    /// many rows it computes (missing layers: 0), as the cards report it.
    pub fn with_fixed_rows_per_copy(mut self, per_layer: &[u32]) -> Self {
        for (slot, &rows) in self.fixed_rows_per_copy.iter_mut().zip(per_layer) {
            *slot = rows;
        }
        self
    }

    /// Per layer, the rows a copy of an expert costs however many rows it computes.
    pub fn fixed_rows_per_copy(&self) -> &[u32] {
        &self.fixed_rows_per_copy
    }

    /// The same placement splitting by what its cards report, each card's per-layer
    /// `(rows_per_weight_read, fixed_rows_per_copy)`: per layer, the figures of the card whose
    /// rows per weight read are fewest (they share one profile; a card without experts in a
    /// layer reports `u32::MAX` there, and 0 is no report). No card reporting: never split.
    pub fn with_card_reports<'r>(
        self,
        cards: impl IntoIterator<Item = (&'r [u32], &'r [u32])>,
    ) -> Self {
        let layers = self.rows_per_weight_read.len();
        let mut best: Vec<(u32, u32)> = vec![(u32::MAX, 0); layers];
        for (rows, fixed) in cards {
            for (layer, slot) in best.iter_mut().enumerate() {
                let r = rows.get(layer).copied().unwrap_or(0);
                let f = fixed.get(layer).copied().unwrap_or(0);
                if r > 0 && (r, f) < *slot {
                    *slot = (r, f);
                }
            }
        }
        let (rows, fixed): (Vec<u32>, Vec<u32>) = best.into_iter().unzip();
        self.with_rows_per_weight_read(&rows)
            .with_fixed_rows_per_copy(&fixed)
    }

    /// [`ExpertPlacement::new`] for `config`'s layers and experts.
    pub fn for_model(
        config: &model::ModelConfig,
        card_experts: &[Vec<Vec<u32>>],
    ) -> Result<Self, PlacementError> {
        Self::new(
            config.num_layers(),
            config.moe.map_or(0, |m| m.num_experts),
            &config.moe_layers(),
            card_experts,
        )
    }

    /// Number of cards.
    pub fn cards(&self) -> usize {
        self.cards
    }

    /// The same placement with the cards in `down` gone: each expert is served by its live
    /// holders only (the replica key then picks among those). Fails when an expert of a MoE
    /// layer would be left without a holder.
    pub fn without(&self, down: &[usize]) -> Result<Self, PlacementError> {
        let mut holders = self.holders.clone();
        for (layer, per_expert) in holders.iter_mut().enumerate() {
            for (expert, cards) in per_expert.iter_mut().enumerate() {
                if cards.is_empty() {
                    continue;
                }
                let all = cards.clone();
                cards.retain(|c| !down.contains(c));
                if cards.is_empty() {
                    return Err(PlacementError::Uncovered {
                        layer,
                        expert,
                        cards: all,
                    });
                }
            }
        }
        Ok(ExpertPlacement {
            holders,
            cards: self.cards,
            rows_per_weight_read: self.rows_per_weight_read.clone(),
            fixed_rows_per_copy: self.fixed_rows_per_copy.clone(),
        })
    }

    /// Whether every expert keeps a holder when `card` alone is lost.
    pub fn survives_loss_of(&self, card: usize) -> bool {
        self.without(&[card]).is_ok()
    }

    /// Which cards compute each expert's rows of `layer` in a step with `routing` (indexed by
    /// expert; empty for experts no row routes to), by [`step::replicas::split_rows`]: `keys[t]`
    /// is row `t`'s key, and an expert's first row's key breaks ties between its holders.
    pub fn serving(&self, layer: usize, routing: &Routing, keys: &[u64]) -> Vec<Vec<RowShare>> {
        let holders = &self.holders[layer];
        let mut rows = vec![0usize; holders.len()];
        let mut first_key = vec![0u64; holders.len()];
        for (t, &key) in keys.iter().enumerate().take(routing.tokens()) {
            for (e, _) in routing.token(t) {
                let e = e as usize;
                if rows[e] == 0 {
                    first_key[e] = key;
                }
                rows[e] += 1;
            }
        }
        step::replicas::split_rows(SplitInput {
            holders,
            rows: &rows,
            keys: &first_key,
            cards: self.cards,
            rows_per_weight_read: self.rows_per_weight_read[layer],
            fixed_rows_per_copy: self.fixed_rows_per_copy[layer],
        })
    }
}

/// The rows one card receives for one layer.
#[derive(Debug, Clone, PartialEq)]
pub struct CardRows {
    /// The card.
    pub card: usize,
    /// Row indices (into the micro-batch) of the tokens sent, ascending.
    pub rows: Vec<usize>,
    /// `[rows.len(), slots]` local expert ids (`NO_EXPERT` pads).
    pub experts: Vec<u32>,
    /// `[rows.len(), slots]` routing weights (0 for padding).
    pub weights: Vec<f32>,
}

/// Where every token of one layer goes.
#[derive(Debug, Clone, PartialEq)]
pub struct DispatchPlan {
    /// Slots per row (the model's top-k).
    pub slots: usize,
    /// Cards that receive rows, ascending; cards with no rows are absent.
    pub cards: Vec<CardRows>,
    /// Experts whose rows were split over two or more of their copies.
    pub split_experts: usize,
}

/// Groups routed tokens by card. `keys[t]` breaks ties between replicas (use the token's
/// position).
pub fn plan_dispatch(
    routing: &Routing,
    layer: usize,
    placement: &ExpertPlacement,
    keys: &[u64],
) -> DispatchPlan {
    let k = routing.top_k;
    let serving = placement.serving(layer, routing, keys);
    let mut cursor = ShareCursor::new(&serving);
    let mut per_card: Vec<CardRows> = (0..placement.cards())
        .map(|card| CardRows {
            card,
            rows: Vec::new(),
            experts: Vec::new(),
            weights: Vec::new(),
        })
        .collect();
    for t in 0..keys.len().min(routing.tokens()) {
        for (e, w) in routing.token(t) {
            let Some(card) = cursor.next_card(e as usize) else {
                continue;
            };
            let c = &mut per_card[card];
            if c.rows.last() != Some(&t) {
                c.rows.push(t);
                c.experts.extend(std::iter::repeat_n(NO_EXPERT, k));
                c.weights.extend(std::iter::repeat_n(0.0, k));
            }
            // Next free slot of this row, keeping the token's top-k order (a token routes to
            // at most k experts, so its row always has one).
            let row = c.rows.len() - 1;
            let experts = &mut c.experts[row * k..(row + 1) * k];
            let Some(free) = experts.iter().position(|&x| x == NO_EXPERT) else {
                continue;
            };
            experts[free] = e;
            c.weights[row * k + free] = w;
        }
    }
    DispatchPlan {
        slots: k,
        split_experts: serving.iter().filter(|s| s.len() > 1).count(),
        cards: per_card
            .into_iter()
            .filter(|c| !c.rows.is_empty())
            .collect(),
    }
}

/// Adds partial sums into `out` (`[tokens, hidden]`), card by card in ascending order.
/// `partials[i]` belongs to `plan.cards[i]` and has one row per sent token.
pub fn combine(plan: &DispatchPlan, partials: &[Vec<f32>], hidden: usize, out: &mut [f32]) {
    for (c, partial) in plan.cards.iter().zip(partials) {
        for (r, &t) in c.rows.iter().enumerate() {
            let dst = &mut out[t * hidden..(t + 1) * hidden];
            for (d, s) in dst.iter_mut().zip(&partial[r * hidden..(r + 1) * hidden]) {
                *d += s;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn placement(experts: usize, cards: usize, replicas: bool) -> ExpertPlacement {
        // Contiguous blocks, uneven counts allowed; optionally expert 0 replicated on the last card.
        let per = experts.div_ceil(cards);
        let card_experts: Vec<Vec<Vec<u32>>> = (0..cards)
            .map(|c| {
                let mut list: Vec<u32> = ((c * per).min(experts)..((c + 1) * per).min(experts))
                    .map(|e| e as u32)
                    .collect();
                if replicas && c == cards - 1 && c != 0 {
                    list.push(0);
                }
                vec![list]
            })
            .collect();
        ExpertPlacement::new(1, experts, &[true], &card_experts).unwrap()
    }

    proptest! {
        /// Every (token, slot) lands on exactly one card holding its expert, in the token's
        /// slot order, each expert's rows on the cards its split names (all on one card when
        /// rows are never split), and combining per-card weighted sums equals the per-token
        /// weighted sum.
        #[test]
        fn plans_cover_every_slot_once(
            tokens in 1usize..12, experts in 2usize..9, cards in 1usize..5, k in 1usize..3, seed in any::<u64>(), replicas in any::<bool>(),
            split in proptest::option::of(1u32..3),
        ) {
            let k = k.min(experts);
            let cards = cards.min(experts);
            let mut p = placement(experts, cards, replicas);
            if let Some(rows) = split {
                p = p.with_rows_per_weight_read(&[rows]);
            }
            let mut ids = Vec::new();
            let mut weights = Vec::new();
            for t in 0..tokens {
                let mut chosen: Vec<u32> = Vec::new();
                let mut x = seed.wrapping_add(t as u64 * 7919);
                while chosen.len() < k {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                    let e = ((x >> 33) % experts as u64) as u32;
                    if !chosen.contains(&e) { chosen.push(e); }
                }
                for (j, e) in chosen.into_iter().enumerate() {
                    ids.push(e);
                    weights.push(1.0 + j as f32);
                }
            }
            let routing = Routing { top_k: k, experts: ids.clone(), weights: weights.clone() };
            let keys: Vec<u64> = (0..tokens as u64).map(|t| t * 3).collect();
            let plan = plan_dispatch(&routing, 0, &p, &keys);
            let shares = p.serving(0, &routing, &keys);
            let mut seen = vec![0usize; tokens * k];
            let mut served_by = vec![None; experts];
            let mut rows_on = vec![vec![0usize; cards]; experts];
            for c in &plan.cards {
                for (r, &t) in c.rows.iter().enumerate() {
                    let mut last_slot = None;
                    for s in 0..k {
                        let e = c.experts[r * k + s];
                        if e == NO_EXPERT { continue; }
                        let j = (0..k).find(|&j| ids[t * k + j] == e).unwrap();
                        prop_assert!(last_slot.is_none_or(|l| l < j), "slot order kept");
                        last_slot = Some(j);
                        prop_assert!(p.holders[0][e as usize].contains(&c.card));
                        if split.is_none() {
                            // All of a step's rows of an expert go to one card: its weights
                            // are read once.
                            prop_assert_eq!(*served_by[e as usize].get_or_insert(c.card), c.card);
                        }
                        rows_on[e as usize][c.card] += 1;
                        prop_assert_eq!(c.weights[r * k + s], weights[t * k + j]);
                        seen[t * k + j] += 1;
                    }
                }
            }
            prop_assert!(seen.iter().all(|&n| n == 1));
            for e in 0..experts {
                let mut want = vec![0usize; cards];
                for s in &shares[e] {
                    want[s.card] += s.rows;
                }
                prop_assert_eq!(&rows_on[e], &want, "expert {}", e);
            }
            // Combine: partial of a card row = sum of its weights (hidden = 1).
            let partials: Vec<Vec<f32>> = plan.cards.iter().map(|c| {
                c.rows.iter().enumerate().map(|(r, _)| c.weights[r * k..(r + 1) * k].iter().sum()).collect()
            }).collect();
            let mut out = vec![0f32; tokens];
            combine(&plan, &partials, 1, &mut out);
            for t in 0..tokens {
                let expect: f32 = weights[t * k..(t + 1) * k].iter().sum();
                prop_assert!((out[t] - expect).abs() < 1e-5);
            }
        }
    }

    proptest! {
        /// With every expert on every card, a step's experts spread over the cards evenly
        /// (counts within one of each other), whatever the routing; one token's two experts go
        /// to two cards.
        #[test]
        fn replicated_experts_spread_evenly_over_the_cards(
            tokens in 1usize..20, experts in 2usize..9, cards in 2usize..5, seed in any::<u64>(),
        ) {
            let all: Vec<Vec<Vec<u32>>> = (0..cards).map(|_| vec![(0..experts as u32).collect()]).collect();
            let p = ExpertPlacement::new(1, experts, &[true], &all).unwrap();
            let mut ids = Vec::new();
            for t in 0..tokens {
                let x = seed.wrapping_mul(t as u64 + 1).wrapping_mul(6364136223846793005) >> 33;
                let a = (x % experts as u64) as u32;
                let b = (a + 1 + ((x >> 8) % (experts as u64 - 1)) as u32) % experts as u32;
                ids.extend([a, b]);
            }
            let routing = Routing { top_k: 2, experts: ids.clone(), weights: vec![0.5; tokens * 2] };
            let keys: Vec<u64> = (0..tokens as u64).map(|t| t + seed % 7).collect();
            let plan = plan_dispatch(&routing, 0, &p, &keys);
            let mut per_card = vec![std::collections::BTreeSet::new(); cards];
            for c in &plan.cards {
                per_card[c.card].extend(c.experts.iter().copied().filter(|&e| e != NO_EXPERT));
            }
            let used: std::collections::BTreeSet<u32> = ids.iter().copied().collect();
            prop_assert_eq!(per_card.iter().map(|s| s.len()).sum::<usize>(), used.len());
            let (lo, hi) = (
                per_card.iter().map(|s| s.len()).min().unwrap_or(0),
                per_card.iter().map(|s| s.len()).max().unwrap_or(0),
            );
            prop_assert!(hi - lo <= 1, "expert counts per card {:?}", per_card);
            if tokens == 1 {
                prop_assert_eq!(plan.cards.len(), 2);
            }
        }
    }

    proptest! {
        /// Without a set of down cards, no plan sends a row to a down card; it fails exactly
        /// when some expert has no live holder; and with nothing down it is the same placement.
        #[test]
        fn plans_without_down_cards_avoid_them(
            tokens in 1usize..10, experts in 2usize..9, cards in 2usize..5, down_mask in 0u8..16,
            replicas in any::<bool>(), seed in any::<u64>(),
        ) {
            let cards = cards.min(experts);
            let p = placement(experts, cards, replicas);
            prop_assert_eq!(&p.without(&[]).unwrap(), &p);
            let down: Vec<usize> = (0..cards).filter(|c| down_mask & (1 << c) != 0).collect();
            let orphaned = (0..experts).any(|e| p.holders[0][e].iter().all(|c| down.contains(c)));
            match p.without(&down) {
                Err(PlacementError::Uncovered { expert, cards: held, .. }) => {
                    prop_assert!(orphaned);
                    prop_assert!(held.iter().all(|c| down.contains(c)));
                    prop_assert_eq!(&held, &p.holders[0][expert]);
                }
                Err(other) => prop_assert!(false, "unexpected {}", other),
                Ok(live) => {
                    prop_assert!(!orphaned);
                    let ids: Vec<u32> = (0..tokens).map(|t| ((seed >> (t % 60)) as usize % experts) as u32).collect();
                    let routing = Routing { top_k: 1, experts: ids, weights: vec![1.0; tokens] };
                    let keys: Vec<u64> = (0..tokens as u64).collect();
                    let plan = plan_dispatch(&routing, 0, &live, &keys);
                    prop_assert!(plan.cards.iter().all(|c| !down.contains(&c.card)));
                    for d in &down {
                        prop_assert_eq!(p.survives_loss_of(*d), p.without(&[*d]).is_ok());
                    }
                }
            }
        }
    }

    #[test]
    fn a_full_replica_survives_either_card_and_a_plain_split_neither() {
        let both: Vec<Vec<Vec<u32>>> = (0..2).map(|_| vec![(0..4).collect()]).collect();
        let p = ExpertPlacement::new(1, 4, &[true], &both).unwrap();
        assert!(p.survives_loss_of(0) && p.survives_loss_of(1));
        let split = placement(4, 2, false);
        assert!(!split.survives_loss_of(0) && !split.survives_loss_of(1));
        let err = split.without(&[1]).unwrap_err().to_string();
        assert!(
            err.contains("expert 2 of layer 0") && err.contains("[1]"),
            "{err}"
        );
    }

    #[test]
    fn orphans_and_unknown_experts_are_refused() {
        let err = ExpertPlacement::new(1, 3, &[true], &[vec![vec![0, 1]]]).unwrap_err();
        assert_eq!(
            err,
            PlacementError::Orphan {
                layer: 0,
                expert: 2
            }
        );
        let err = ExpertPlacement::new(1, 2, &[true], &[vec![vec![0, 1, 5]]]).unwrap_err();
        assert!(err.to_string().contains("expert 5"));
    }

    /// Per layer, the figures of the card reporting the fewest rows per weight read, its fixed
    /// part with them (a 0 is no report; a card naming fewer layers reports nothing past them).
    #[test]
    fn the_cards_reports_set_each_layers_split_figures() {
        let both: Vec<Vec<Vec<u32>>> = (0..2)
            .map(|_| vec![vec![0, 1], vec![0, 1], vec![0, 1]])
            .collect();
        let p = ExpertPlacement::new(3, 2, &[true, true, true], &both).unwrap();
        let (a_rows, a_fixed) = ([9, 0, 7], [4, 3, 2]);
        let (b_rows, b_fixed) = ([12, 5], [1, 2]);
        let p = p.with_card_reports([(&a_rows[..], &a_fixed[..]), (&b_rows[..], &b_fixed[..])]);
        assert_eq!(p.rows_per_weight_read(), [9, 5, 7]);
        assert_eq!(p.fixed_rows_per_copy(), [4, 2, 2]);
        let none = ExpertPlacement::new(3, 2, &[true, true, true], &both)
            .unwrap()
            .with_card_reports(std::iter::empty());
        assert_eq!(none.rows_per_weight_read(), [u32::MAX; 3]);
        assert_eq!(none.fixed_rows_per_copy(), [0; 3]);
    }

    /// The cards' break-even figures become the split thresholds (0, and layers they do not
    /// name, never split), and a plan counts the experts whose rows it split.
    #[test]
    fn rows_per_weight_read_sets_the_split_and_plans_count_split_experts() {
        let both: Vec<Vec<Vec<u32>>> = (0..2).map(|_| vec![vec![0, 1], vec![0, 1]]).collect();
        let p = ExpertPlacement::new(2, 2, &[true, true], &both).unwrap();
        assert_eq!(
            p.rows_per_weight_read(),
            [u32::MAX, u32::MAX],
            "never split by default"
        );
        let p = p.with_rows_per_weight_read(&[0]);
        assert_eq!(
            p.rows_per_weight_read(),
            [u32::MAX, u32::MAX],
            "0 never splits"
        );
        let p = p.with_rows_per_weight_read(&[2, 3]);
        assert_eq!(p.rows_per_weight_read(), [2, 3]);
        // Eight tokens all routed to expert 0: past 2 rows per weight read its rows split over
        // both copies; expert 1's single row is not split.
        let routing = Routing {
            top_k: 1,
            experts: vec![0, 0, 0, 0, 0, 0, 0, 1],
            weights: vec![1.0; 8],
        };
        let keys: Vec<u64> = (0..8).collect();
        let plan = plan_dispatch(&routing, 0, &p, &keys);
        assert_eq!(plan.split_experts, 1, "{plan:?}");
        assert_eq!(plan.cards.len(), 2, "both copies of expert 0 compute");
        let whole = plan_dispatch(&routing, 0, &p.with_rows_per_weight_read(&[100]), &keys);
        assert_eq!(whole.split_experts, 0);
    }

    /// Which copy computes an unsplit expert follows the key of its first row: moving the
    /// first row's key moves the expert, later rows' keys do not.
    #[test]
    fn an_unsplit_expert_goes_where_its_first_rows_key_points() {
        let both: Vec<Vec<Vec<u32>>> = (0..2).map(|_| vec![vec![0]]).collect();
        let p = ExpertPlacement::new(1, 1, &[true], &both).unwrap();
        let routing = Routing {
            top_k: 1,
            experts: vec![0, 0],
            weights: vec![1.0, 1.0],
        };
        let card = |keys: &[u64]| {
            let shares = p.serving(0, &routing, keys);
            assert_eq!(shares[0].len(), 1, "never split: one copy");
            shares[0][0].card
        };
        assert_eq!(
            card(&[0, 0]),
            card(&[0, 1]),
            "the second row's key does not matter"
        );
        assert_ne!(card(&[0, 0]), card(&[1, 0]), "the first row's key does");
    }
}
