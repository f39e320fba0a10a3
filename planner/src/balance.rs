//! Expert placement by measured load (`afd plan --expert-load FILE`): which experts get extra
//! copies and which card holds each copy, so that the cards of a layer receive even shares of
//! its tokens.
//!
//! A step waits for its slowest card, and real routers are skewed: the default placement
//! (contiguous blocks of experts per card) leaves the card holding a layer's hot experts with
//! most of its rows. As DeepSeek's EPLB does, per MoE layer:
//! 1. **Replicate**: `num_redundant_experts` extra copies, each going to the expert whose load
//!    per copy is highest at that moment (never more copies than cards); then, while moving a
//!    copy from one expert to another lets the copies pack more evenly, move it.
//! 2. **Pack**: the copies, heaviest first (an expert's load split evenly over its copies), each
//!    onto the least-loaded card that does not hold that expert yet and has a slot left; every
//!    card gets the same number of slots (the copies over the cards, rounded up), so the cards'
//!    memory stays even.
//! 3. **Refine**: while swapping a copy on the most loaded card with a copy on another card (or
//!    moving it to a card with a free slot) lowers the larger of the two cards' loads, do the
//!    best such exchange. Greedy packing leaves a few percent on the table that this takes
//!    back.
//!
//! On the bundled model's own load (docs/bench/expert-load/) over 4 cards with one extra copy per
//! card, the two refinements take the mean balancedness from 0.883 (replicate and pack alone) to
//! 0.962.
//!
//! Loads are in expectation over steps: a replicated expert's tokens count evenly on each of its
//! copies, as the node's dispatcher spreads them. Balancedness is vLLM's: the mean over cards of
//! a card's load divided by the largest (1.0 is perfectly even).
//!
//! A layer whose placement by load would be less even than the one it replaces keeps the old
//! one: the result is never worse on the measured load.
//!
//! Pure and deterministic: ties go to the lower expert id and the lower card index. Whether a
//! placement fits in the cards' SRAM is the compiler's to say (the caller compiles it).

use corsair_ffn::assignment::{CardAssignment, LayerShare};
use model::ModelConfig;
use serde::Serialize;

use crate::cards::CardSet;
use crate::error::{Error, Result};
use crate::expected::expected_layer_under_load;

mod groups;

pub use groups::balance_layer_in_groups;

/// Tokens routed to each expert of each layer, as measured (`afd serve --record-routing` or
/// `afd emulate --record-routing`, summed over the record's windows).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ExpertLoad {
    /// `layers[layer][expert]`; empty for a dense layer.
    pub layers: Vec<Vec<u64>>,
}

/// Which cards hold a copy of each expert of one MoE layer: `holders[expert]`, ascending.
pub type LayerHolders = Vec<Vec<usize>>;

/// A placement computed from measured load, with how even it leaves the cards.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BalancedPlacement {
    /// Number of cards.
    pub cards: usize,
    /// Per decoder layer, the holders of each expert (`None` for a dense layer).
    #[serde(skip)]
    pub layers: Vec<Option<LayerHolders>>,
    /// Extra copies per MoE layer (beyond one of each expert) in this placement.
    pub redundant_experts: usize,
    /// Per MoE layer (in layer order), balancedness under the placement it replaces.
    pub before: Vec<f64>,
    /// Per MoE layer, balancedness under this placement.
    pub after: Vec<f64>,
}

impl BalancedPlacement {
    /// The mean of [`Self::before`].
    pub fn mean_before(&self) -> f64 {
        mean(&self.before)
    }

    /// The mean of [`Self::after`].
    pub fn mean_after(&self) -> f64 {
        mean(&self.after)
    }

    /// Each card's share: the experts of this placement, and the dense columns and LM-head
    /// rows of `default` (the placement it replaces, one entry per card).
    pub fn assignments(&self, default: &[CardAssignment]) -> Vec<CardAssignment> {
        default
            .iter()
            .map(|a| {
                let mut a = a.clone();
                for (share, holders) in a.layers.iter_mut().zip(&self.layers) {
                    if let (LayerShare::Moe { experts }, Some(holders)) = (share, holders) {
                        *experts = holders
                            .iter()
                            .enumerate()
                            .filter(|(_, cards)| cards.contains(&a.card))
                            .map(|(e, _)| e as u32)
                            .collect();
                    }
                }
                a
            })
            .collect()
    }
}

fn mean(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        1.0
    } else {
        xs.iter().sum::<f64>() / xs.len() as f64
    }
}

pub use step::replicas::balancedness;

/// Each card's load of one layer: every expert's tokens split evenly over its holders.
pub fn card_loads(load: &[u64], holders: &[Vec<usize>], cards: usize) -> Vec<f64> {
    let mut out = vec![0.0; cards];
    for (l, h) in load.iter().zip(holders) {
        for &card in h {
            if let Some(slot) = out.get_mut(card) {
                *slot += *l as f64 / h.len() as f64;
            }
        }
    }
    out
}

/// The holders of each expert of `layer` in `assignments` (one entry per card).
pub fn holders_of(assignments: &[CardAssignment], layer: usize, experts: usize) -> LayerHolders {
    let mut holders = vec![Vec::new(); experts];
    for a in assignments {
        if let Some(LayerShare::Moe { experts: held }) = a.layers.get(layer) {
            for &e in held {
                if let Some(h) = holders.get_mut(e as usize) {
                    h.push(a.card);
                }
            }
        }
    }
    holders
}

/// One layer's placement by load on `cards` cards with `redundant` extra copies (fewer where
/// every expert already has a copy on every card).
pub fn balance_layer(load: &[u64], cards: usize, redundant: usize) -> LayerHolders {
    layer_placement(load, cards, redundant, true)
}

/// [`balance_layer`], with or without its refinements (the copies' reassignment of step 1 and
/// step 3).
fn layer_placement(load: &[u64], cards: usize, redundant: usize, refined: bool) -> LayerHolders {
    let n = load.len();
    if n == 0 || cards == 0 {
        return vec![Vec::new(); n];
    }
    let mut copies = replicate(load, cards, redundant);
    if refined {
        reassign_copies(load, cards, &mut copies);
    }
    let mut packed = pack(load, cards, &copies);
    if refined {
        let weight = |e: usize| load[e] as f64 / copies[e] as f64;
        refine(
            &mut packed.holders,
            &mut packed.card_load,
            &mut packed.held,
            packed.slots,
            weight,
        );
    }
    let mut holders = packed.holders;
    for h in &mut holders {
        h.sort_unstable();
    }
    holders
}

/// Step 1: `redundant` extra copies, each to the expert with the most load per copy (at most
/// one copy per card). `copies[expert]`.
fn replicate(load: &[u64], cards: usize, redundant: usize) -> Vec<usize> {
    let n = load.len();
    let mut copies = vec![1usize; n];
    for _ in 0..redundant {
        let best = (0..n).filter(|&e| copies[e] < cards).max_by(|&a, &b| {
            let per = |e: usize| load[e] as f64 / copies[e] as f64;
            per(a).total_cmp(&per(b)).then(b.cmp(&a))
        });
        match best {
            Some(e) => copies[e] += 1,
            None => break,
        }
    }
    copies
}

/// Step 1's refinement: while moving one extra copy from one expert to another lowers the
/// packed placement's most loaded card, make the first such move (experts in id order). Most
/// load per copy is the right rule for which expert to copy in the limit of many slots; with few
/// slots per card what matters is whether the copies pack evenly, which only packing them says.
/// Each move strictly lowers the peak, and the loop is capped.
fn reassign_copies(load: &[u64], cards: usize, copies: &mut [usize]) {
    let n = load.len();
    // A reassignment whose copies pack past a card's slots is not one (uneven memory).
    let peak = |copies: &[usize]| {
        let p = pack(load, cards, copies);
        if p.held.iter().any(|&h| h > p.slots) {
            f64::INFINITY
        } else {
            p.card_load.into_iter().fold(0.0f64, f64::max)
        }
    };
    let eps = 1e-9 * load.iter().sum::<u64>().max(1) as f64;
    let mut best = peak(copies);
    for _ in 0..4 * n {
        let mut moved = false;
        'search: for from in 0..n {
            for to in 0..n {
                if copies[from] <= 1 || to == from || copies[to] >= cards {
                    continue;
                }
                copies[from] -= 1;
                copies[to] += 1;
                let p = peak(copies);
                if p < best - eps {
                    best = p;
                    moved = true;
                    break 'search;
                }
                copies[from] += 1;
                copies[to] -= 1;
            }
        }
        if !moved {
            return;
        }
    }
}

/// A layer's copies on the cards, as step 2 packs them.
struct Packed {
    holders: LayerHolders,
    card_load: Vec<f64>,
    held: Vec<usize>,
    slots: usize,
}

/// Step 2: every copy, heaviest first (an expert's load split evenly over its copies), onto the
/// least-loaded card that lacks the expert and has a slot left.
fn pack(load: &[u64], cards: usize, copies: &[usize]) -> Packed {
    let n = load.len();
    let mut items: Vec<(usize, f64)> = (0..n)
        .flat_map(|e| {
            let w = load[e] as f64 / copies[e] as f64;
            std::iter::repeat_n((e, w), copies[e])
        })
        .collect();
    items.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let slots = items.len().div_ceil(cards);
    let mut card_load = vec![0.0f64; cards];
    let mut held = vec![0usize; cards];
    let mut holders: LayerHolders = vec![Vec::new(); n];
    for (e, w) in items {
        let free = |c: &usize| !holders[e].contains(c);
        let pick = |room: bool| {
            (0..cards)
                .filter(free)
                .filter(|&c| !room || held[c] < slots)
                .min_by(|&a, &b| {
                    card_load[a]
                        .total_cmp(&card_load[b])
                        .then(held[a].cmp(&held[b]))
                        .then(a.cmp(&b))
                })
        };
        // A card with room always lacks the expert unless every card with room holds it;
        // then the copy goes over a card's slots rather than nowhere.
        let Some(card) = pick(true).or_else(|| pick(false)) else {
            continue;
        };
        holders[e].push(card);
        card_load[card] += w;
        held[card] += 1;
    }
    Packed {
        holders,
        card_load,
        held,
        slots,
    }
}

/// Lowers the most loaded card's load by exchanges while one helps: the best swap of one of its
/// copies with a copy on another card, or move of one to a card with a free slot (the
/// exchange whose larger resulting load is smallest; ties to the lower expert and card). Each
/// exchange strictly lowers the larger of the two cards' loads below the maximum, so the
/// sorted load vector decreases and the loop ends; it is also capped.
fn refine(
    holders: &mut LayerHolders,
    card_load: &mut [f64],
    held: &mut [usize],
    slots: usize,
    weight: impl Fn(usize) -> f64,
) {
    let cards = card_load.len();
    // Only improvements larger than rounding count, so float noise cannot cycle.
    let eps = 1e-9 * card_load.iter().sum::<f64>().max(1.0);
    for _ in 0..holders.len() * cards * 4 {
        let Some(hi) =
            (0..cards).max_by(|&a, &b| card_load[a].total_cmp(&card_load[b]).then(b.cmp(&a)))
        else {
            return;
        };
        let on = |c: usize| -> Vec<usize> {
            (0..holders.len())
                .filter(|&e| holders[e].contains(&c))
                .collect()
        };
        let mine = on(hi);
        // (new max of the pair, expert leaving hi, card, expert coming back or none)
        let mut best: Option<(f64, usize, usize, Option<usize>)> = None;
        let mut consider = |peak: f64, e: usize, c: usize, f: Option<usize>| {
            if peak < card_load[hi] - eps && best.is_none_or(|b| peak < b.0) {
                best = Some((peak, e, c, f));
            }
        };
        for c in (0..cards).filter(|&c| c != hi) {
            let theirs = on(c);
            for &e in mine.iter().filter(|&&e| !holders[e].contains(&c)) {
                let we = weight(e);
                if held[c] < slots {
                    consider((card_load[hi] - we).max(card_load[c] + we), e, c, None);
                }
                for &f in theirs.iter().filter(|&&f| !holders[f].contains(&hi)) {
                    let wf = weight(f);
                    let peak = (card_load[hi] - we + wf).max(card_load[c] - wf + we);
                    consider(peak, e, c, Some(f));
                }
            }
        }
        let Some((_, e, c, f)) = best else {
            return;
        };
        let we = weight(e);
        move_copy(&mut holders[e], hi, c);
        card_load[hi] -= we;
        card_load[c] += we;
        match f {
            Some(f) => {
                let wf = weight(f);
                move_copy(&mut holders[f], c, hi);
                card_load[c] -= wf;
                card_load[hi] += wf;
            }
            None => {
                held[hi] -= 1;
                held[c] += 1;
            }
        }
    }
}

/// Moves an expert's copy from card `from` to card `to`.
fn move_copy(holders: &mut [usize], from: usize, to: usize) {
    if let Some(slot) = holders.iter_mut().find(|c| **c == from) {
        *slot = to;
    }
}

/// The placement of `config`'s experts on `cards` cards by `load`, with `redundant` extra
/// copies per MoE layer, against the placement it replaces (`current`: one assignment per
/// card, as the compiler's default placement gives). With `groups` of 2 or more the cards form
/// that many equal groups and every copy of an expert stays in one ([`balance_layer_in_groups`]);
/// 0 or 1 places globally.
pub fn balance(
    config: &ModelConfig,
    load: &ExpertLoad,
    current: &[CardAssignment],
    redundant: usize,
    groups: usize,
) -> Result<BalancedPlacement> {
    let experts = config.moe.map_or(0, |m| m.num_experts);
    let cards = current.len();
    if cards == 0 {
        return Err(Error::Config(
            "placement by load needs at least one card".into(),
        ));
    }
    if groups > 1 && !cards.is_multiple_of(groups) {
        return Err(Error::Config(format!(
            "{cards} cards cannot form {groups} equal groups: make the card groups divide the cards"
        )));
    }
    let moe = config.moe_layers();
    if load.layers.len() != moe.len() {
        return Err(Error::Config(format!(
            "the expert load has {} layers, the model {}: measure the load of the same model",
            load.layers.len(),
            moe.len()
        )));
    }
    let mut out = BalancedPlacement {
        cards,
        layers: Vec::with_capacity(moe.len()),
        redundant_experts: redundant.min(experts * cards.saturating_sub(1)),
        before: Vec::new(),
        after: Vec::new(),
    };
    for (layer, (&is_moe, counts)) in moe.iter().zip(&load.layers).enumerate() {
        if !is_moe {
            out.layers.push(None);
            continue;
        }
        if counts.len() != experts {
            return Err(Error::Config(format!(
                "layer {layer} of the expert load has {} experts, the model {experts}",
                counts.len()
            )));
        }
        let was = holders_of(current, layer, experts);
        let before = balancedness(&card_loads(counts, &was, cards));
        let now = balance_layer_in_groups(counts, cards, groups, redundant);
        let after = balancedness(&card_loads(counts, &now, cards));
        out.before.push(before);
        // Greedy packing can come out behind the placement it replaces (with few or no copies
        // and experts that divide evenly); a layer then keeps what it had.
        if after < before {
            out.after.push(before);
            out.layers.push(Some(was));
        } else {
            out.after.push(after);
            out.layers.push(Some(now));
        }
    }
    Ok(out)
}

/// The cards' time of a decode step of `tokens` tokens (one micro-batch) under measured `load`
/// (seconds): per MoE layer, the slowest card's time in expectation over routings drawn from
/// the load ([`expected_layer_under_load`]), summed over the layers.
pub fn cards_step_seconds(cards: &CardSet, load: &ExpertLoad, tokens: usize) -> f64 {
    load.layers
        .iter()
        .enumerate()
        .filter(|(_, counts)| !counts.is_empty())
        .map(|(layer, counts)| {
            expected_layer_under_load(cards, layer, tokens, counts)
                .slowest
                .seconds
        })
        .sum()
}

#[cfg(test)]
mod tests;
