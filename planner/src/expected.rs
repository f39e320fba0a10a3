//! What uniform routing costs the cards in expectation: the planner's routing.
//!
//! A step waits for its slowest card, so a layer's card time is the expected time of the
//! slowest card, not the time of a card under its expected load: at one token of four experts
//! over eight cards, two or more of the token's experts share a card about two times in three.
//! [`expected_layer`] draws the layer's routing many times (each token's top-k experts, distinct,
//! every expert equally likely, from a generator with a fixed seed, so a plan is the same
//! every time), dispatches each draw as the node does (an expert to its card; a replicated
//! expert's rows over its holders by [`step::replicas::split_rows`], the node's own rule) and
//! averages each card's time, the slowest card's time and the rows sent.
//! The draws per layer shrink as the micro-batch grows, since large batches vary little.

use corsair_ffn::perf::LayerTime;
use step::replicas::{ShareCursor, SplitInput};

use crate::cards::CardSet;

/// Draws of one layer's routing per (layer, tokens): enough that the slowest card's mean is
/// within a fraction of a percent, at most this many token-expert picks in all.
const PICKS: usize = 1 << 16;
/// Fewest and most draws.
const DRAWS: (usize, usize) = (16, 512);

/// Uniform routing's expected figures of one layer for one micro-batch.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ExpectedLayer {
    /// Each card's mean time (0 where it holds nothing of the layer).
    pub per_card: Vec<LayerTime>,
    /// The mean time of the slowest card.
    pub slowest: LayerTime,
    /// The mean number of rows sent, over every card.
    pub rows: f64,
}

/// A small generator with a fixed seed (SplitMix64): the planner draws without `rand`, and
/// the same plan draws the same routings.
struct Draws(u64);

impl Draws {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        ((self.next() >> 11) as f64 / (1u64 << 53) as f64 * n as f64) as usize % n.max(1)
    }
}

fn add(a: &mut LayerTime, b: &LayerTime) {
    a.seconds += b.seconds;
    a.lpddr_seconds += b.lpddr_seconds;
    a.matmul_seconds += b.matmul_seconds;
    a.io_seconds += b.io_seconds;
}

fn scaled(a: &LayerTime, f: f64) -> LayerTime {
    LayerTime {
        seconds: a.seconds * f,
        lpddr_seconds: a.lpddr_seconds * f,
        matmul_seconds: a.matmul_seconds * f,
        io_seconds: a.io_seconds * f,
    }
}

/// Uniform routing's expected figures of `layer` of `cards` for `tokens` tokens.
pub fn expected_layer(cards: &CardSet, layer: usize, tokens: usize) -> ExpectedLayer {
    let e = cards.num_experts();
    expected_layer_by(cards, layer, tokens, |rng, _| rng.below(e))
}

/// The expected figures of `layer` for `tokens` tokens whose experts are drawn in proportion to
/// `load` (tokens each expert received, as measured): each token's k distinct experts, one at
/// a time, each among those it has not chosen yet. An expert never measured is never drawn,
/// unless every expert left is such (then they are equally likely).
pub fn expected_layer_under_load(
    cards: &CardSet,
    layer: usize,
    tokens: usize,
    load: &[u64],
) -> ExpectedLayer {
    let e = cards.num_experts();
    expected_layer_by(cards, layer, tokens, |rng, taken| {
        let weight = |x: usize| {
            if taken.contains(&x) {
                0
            } else {
                load.get(x).copied().unwrap_or(0)
            }
        };
        let total: u64 = (0..e).map(weight).sum();
        if total == 0 {
            return loop {
                let x = rng.below(e);
                if !taken.contains(&x) {
                    break x;
                }
            };
        }
        let mut at = (((rng.next() >> 11) as f64 / (1u64 << 53) as f64) * total as f64) as u64;
        for x in 0..e {
            let w = weight(x);
            if at < w {
                return x;
            }
            at -= w;
        }
        (0..e).rev().find(|&x| weight(x) > 0).unwrap_or(0)
    })
}

/// [`expected_layer`] with each token's `j`-th expert drawn by `draw(rng, the j chosen so
/// far)`; a draw that repeats one of them is drawn again.
fn expected_layer_by(
    cards: &CardSet,
    layer: usize,
    tokens: usize,
    mut draw: impl FnMut(&mut Draws, &[usize]) -> usize,
) -> ExpectedLayer {
    let n = cards.len();
    let dense = cards.dense_cards(layer);
    if !dense.is_empty() || tokens == 0 {
        // A dense layer: every card holding columns gets every row; nothing to draw.
        let per_card: Vec<LayerTime> = (0..n)
            .map(|c| {
                if dense.contains(&c) {
                    cards.observed_layer_time(c, layer, tokens, &[])
                } else {
                    LayerTime::default()
                }
            })
            .collect();
        let slowest = per_card
            .iter()
            .max_by(|a, b| a.seconds.total_cmp(&b.seconds))
            .cloned()
            .unwrap_or_default();
        return ExpectedLayer {
            per_card,
            slowest,
            rows: (dense.len() * tokens) as f64,
        };
    }
    let (e, k) = (cards.num_experts(), cards.top_k());
    if e == 0 || k == 0 {
        return ExpectedLayer {
            per_card: vec![LayerTime::default(); n],
            ..ExpectedLayer::default()
        };
    }
    // Who holds each expert, ascending.
    let mut holders: Vec<Vec<usize>> = vec![Vec::new(); e];
    for c in 0..n {
        for &x in cards.local_experts_of(c, layer) {
            if let Some(h) = holders.get_mut(x as usize) {
                h.push(c);
            }
        }
    }
    let draws = (PICKS / (tokens * k).max(1)).clamp(DRAWS.0, DRAWS.1);
    let mut rng = Draws(0x0070_6c61_6e6e_6572 ^ ((layer as u64) << 32) ^ tokens as u64);
    let mut per_card = vec![LayerTime::default(); n];
    let mut slowest = LayerTime::default();
    let mut rows_total = 0usize;
    let mut chosen = vec![0usize; tokens * k];
    let mut expert_rows = vec![0usize; e];
    let no_keys = vec![0u64; e];
    let rows_per_weight_read = cards.rows_per_weight_read(layer);
    let fixed_rows_per_copy = cards.fixed_rows_per_copy(layer);
    let mut card_rows = vec![0usize; n];
    let mut last_token = vec![usize::MAX; n];
    let mut rows_on = vec![0usize; n * e];
    for _ in 0..draws {
        // Each token's k distinct experts.
        expert_rows.iter_mut().for_each(|r| *r = 0);
        for t in 0..tokens {
            let row = &mut chosen[t * k..(t + 1) * k];
            for j in 0..k {
                row[j] = loop {
                    let x = draw(&mut rng, &row[..j]);
                    if !row[..j].contains(&x) {
                        break x;
                    }
                };
                expert_rows[row[j]] += 1;
            }
        }
        // Each routed expert's rows to cards, as the node's dispatcher splits them (every row
        // keyed 0: the node's keys only break ties, and a plan must not depend on them).
        let shares = step::replicas::split_rows(SplitInput {
            holders: &holders,
            rows: &expert_rows,
            keys: &no_keys,
            cards: n,
            rows_per_weight_read,
            fixed_rows_per_copy,
        });
        // Each card's rows (tokens with an expert there) and rows per expert there.
        card_rows.fill(0);
        last_token.fill(usize::MAX);
        rows_on.fill(0);
        let mut cursor = ShareCursor::new(&shares);
        for t in 0..tokens {
            for &x in &chosen[t * k..(t + 1) * k] {
                let Some(c) = cursor.next_card(x) else {
                    continue;
                };
                rows_on[c * e + x] += 1;
                if last_token[c] != t {
                    last_token[c] = t;
                    card_rows[c] += 1;
                }
            }
        }
        let mut worst = LayerTime::default();
        for c in 0..n {
            let local = cards.local_experts_of(c, layer);
            let rows: Vec<usize> = local
                .iter()
                .map(|&x| rows_on.get(c * e + x as usize).copied().unwrap_or(0))
                .collect();
            let time = cards.observed_layer_time(c, layer, card_rows[c], &rows);
            if time.seconds > worst.seconds {
                worst = time.clone();
            }
            add(&mut per_card[c], &time);
            rows_total += card_rows[c];
        }
        add(&mut slowest, &worst);
    }
    let f = 1.0 / draws as f64;
    ExpectedLayer {
        per_card: per_card.iter().map(|t| scaled(t, f)).collect(),
        slowest: scaled(&slowest, f),
        rows: rows_total as f64 * f,
    }
}
