//! The LM-head shard's proposals: per token, the shard's best candidates, its log-sum-exp and a
//! Gumbel-max winner, so that the attention node can pick the next token without the full
//! logits (DESIGN.md, step 5).
//!
//! What the attention node can compute exactly from the cards' proposals (each card's logits
//! are the same bits whatever the card count, since a row's dot product does not depend on how
//! the vocabulary is split):
//! - **greedy**: the best candidate over all cards (highest logit, lowest id on ties);
//! - **seeded sampling without filters**: the best `gumbel.score` over all cards (lowest id on
//!   ties) is exactly [`model::sampling::sample`]'s token, since every token's score depends only
//!   on (seed, position, token id) and its logit;
//! - **logprobs** (rows that ask for them; other rows skip the shard's log-sum-exp): the
//!   global log-sum-exp is `logsumexp` of the cards' `log_sum_exp`, so any candidate's
//!   log-probability is exact up to rounding;
//! - **top-k** (k at most the candidates returned; a card returns at least `top_k`): exact,
//!   the global top k is inside the union of every card's top k;
//! - **min-p**: a card returns every token whose scaled logit is within `ln(min_p)` of its own
//!   best, a superset of the global survivors, so the filter is exact when no card hit the
//!   `max_candidates` cap;
//! - **top-p**: exact whenever the nucleus cut-off (the smallest logit kept, with probabilities
//!   from the global `scaled_log_sum_exp`) is strictly above the last candidate logit of every
//!   card whose list is truncated (`candidates.len() < shard_rows`); otherwise the node falls
//!   back to gathering the full logits ([`crate::Card::lm_head_logits`]).
//!
//! For filtered sampling the node recomputes the Gumbel scores of the allowed candidates with
//! [`model::sampling::gumbel_score`] and takes the best; the cards' `gumbel` is for unfiltered rows.

use model::sampling::{SamplingParams, gumbel_winner, log_sum_exp};
use serde::{Deserialize, Serialize};

/// How one token row picks its next token.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RowSampling {
    /// Temperature, filters and seed (greedy by default).
    pub params: SamplingParams,
    /// Position of the token in its sequence (the Gumbel counter).
    pub position: u64,
    /// Whether the row's log-probabilities are wanted (the proposal's `log_sum_exp`).
    pub logprobs: bool,
}

/// A candidate token.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Candidate {
    /// Its raw logit.
    pub logit: f32,
    /// Its vocabulary id.
    pub token: u32,
}

/// The shard's Gumbel-max winner.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GumbelWinner {
    /// Vocabulary id.
    pub token: u32,
    /// Its raw logit (its log-probability is known even when it is not a candidate).
    pub logit: f32,
    /// `logit / temperature + gumbel(seed, position, token)`.
    pub score: f64,
}

/// One token's proposal from one card.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LmProposal {
    /// Best candidates, highest logit first (lowest id first on ties).
    pub candidates: Vec<Candidate>,
    /// Vocabulary rows of the shard (the list is complete when it has this many).
    pub shard_rows: u32,
    /// `ln(sum(exp(logits)))` over the shard, for rows that want logprobs.
    pub log_sum_exp: Option<f64>,
    /// Same over `logits / temperature` (sampled rows).
    pub scaled_log_sum_exp: Option<f64>,
    /// Gumbel-max winner over the shard (sampled rows).
    pub gumbel: Option<GumbelWinner>,
}

/// How many candidates to return.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CandidateOptions {
    /// Candidates per token by default. Default 64.
    pub candidates: usize,
    /// Most candidates a row with filters may ask for. Default 4096.
    pub max_candidates: usize,
}

impl Default for CandidateOptions {
    fn default() -> Self {
        CandidateOptions {
            candidates: 64,
            max_candidates: 4096,
        }
    }
}

/// The proposal of a shard whose first vocabulary id is `first_id`, from its logits.
pub fn propose(
    logits: &[f32],
    first_id: u32,
    row: &RowSampling,
    options: &CandidateOptions,
) -> LmProposal {
    let p = &row.params;
    let sampled = !p.is_greedy();
    let mut want = options.candidates;
    if p.top_k > 0 {
        want = want.max(p.top_k);
    }
    let scaled: Option<Vec<f32>> =
        sampled.then(|| logits.iter().map(|&l| l / p.temperature).collect());
    if let (Some(s), true) = (&scaled, p.min_p > 0.0) {
        // Every token within ln(min_p) of the shard's best survives some global maximum.
        let best = s.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let floor = best + (p.min_p as f64).ln();
        want = want.max(s.iter().filter(|&&v| v as f64 >= floor).count());
    }
    let want = want
        .min(options.max_candidates.max(options.candidates))
        .min(logits.len());
    let order = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    let idx: Vec<u32> = if want == 1 {
        // The usual greedy row: one scan, no index list (first of equal logits wins).
        let best =
            logits
                .iter()
                .enumerate()
                .fold(None::<(usize, f32)>, |best, (i, &l)| match best {
                    Some((_, b)) if l.total_cmp(&b).is_le() => best,
                    _ => Some((i, l)),
                });
        best.map(|(i, _)| i as u32).into_iter().collect()
    } else {
        let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
        if want < idx.len() && want > 0 {
            idx.select_nth_unstable_by(want - 1, order);
            idx.truncate(want);
        }
        idx.sort_unstable_by(order);
        idx.truncate(want);
        idx
    };
    let gumbel = sampled
        .then(|| gumbel_winner(logits, p, row.position, first_id))
        .flatten()
        .map(|(i, score)| GumbelWinner {
            token: first_id + i as u32,
            logit: logits[i],
            score,
        });
    LmProposal {
        candidates: idx
            .iter()
            .map(|&i| Candidate {
                logit: logits[i as usize],
                token: first_id + i,
            })
            .collect(),
        shard_rows: logits.len() as u32,
        log_sum_exp: row.logprobs.then(|| log_sum_exp(logits)),
        scaled_log_sum_exp: scaled.as_deref().map(log_sum_exp),
        gumbel,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use model::sampling::sample;

    fn logits(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = crate::synthetic::SplitMix::new(seed, 7);
        (0..n).map(|_| rng.symmetric() * 4.0).collect()
    }

    #[test]
    fn merged_proposals_reproduce_the_monolithic_sample_for_any_split() {
        let all = logits(1000, 3);
        for seed in 0..20u64 {
            let row = RowSampling {
                params: SamplingParams {
                    temperature: 0.8,
                    seed,
                    ..Default::default()
                },
                position: 17 + seed,
                logprobs: false,
            };
            let want = sample(&all, &row.params, row.position);
            for cards in [1usize, 3, 8] {
                let mut best: Option<GumbelWinner> = None;
                for c in 0..cards {
                    let span = crate::assignment::split_even(all.len(), cards, c);
                    let p = propose(
                        &all[span.start..span.end],
                        span.start as u32,
                        &row,
                        &CandidateOptions::default(),
                    );
                    let g = p.gumbel.unwrap();
                    if best.is_none_or(|b| {
                        g.score > b.score || (g.score == b.score && g.token < b.token)
                    }) {
                        best = Some(g);
                    }
                }
                assert_eq!(best.unwrap().token, want, "seed {seed}, {cards} cards");
            }
        }
    }

    #[test]
    fn a_single_candidate_is_the_head_of_the_full_list() {
        // Coarse logits, so ties (lowest id first) occur.
        for seed in 0..10 {
            let all: Vec<f32> = logits(300, seed).iter().map(|l| l.round()).collect();
            let one = CandidateOptions {
                candidates: 1,
                ..Default::default()
            };
            let row = RowSampling::default();
            let single = propose(&all, 5, &row, &one);
            let full = propose(&all, 5, &row, &CandidateOptions::default());
            assert_eq!(single.candidates.len(), 1);
            assert_eq!(single.candidates[0], full.candidates[0], "seed {seed}");
        }
    }

    #[test]
    fn greedy_candidates_and_lse_merge_exactly() {
        let all = logits(500, 9);
        let row = RowSampling {
            logprobs: true,
            ..Default::default()
        };
        let mut merged = Vec::new();
        let mut lses = Vec::new();
        for c in 0..4 {
            let span = crate::assignment::split_even(all.len(), 4, c);
            let p = propose(
                &all[span.start..span.end],
                span.start as u32,
                &row,
                &CandidateOptions::default(),
            );
            assert!(p.gumbel.is_none());
            assert!(p.candidates.windows(2).all(|w| w[0].logit >= w[1].logit));
            merged.extend(p.candidates);
            lses.push(p.log_sum_exp.unwrap() as f32);
        }
        let best = merged
            .iter()
            .max_by(|a, b| a.logit.total_cmp(&b.logit).then(b.token.cmp(&a.token)))
            .unwrap();
        assert_eq!(best.token, model::sampling::argmax(&all));
        let global = log_sum_exp(&lses);
        assert!((global - log_sum_exp(&all)).abs() < 1e-5);
    }

    #[test]
    fn filters_widen_the_candidate_list() {
        let all = logits(3000, 1);
        let row = RowSampling {
            params: SamplingParams {
                temperature: 1.0,
                top_k: 200,
                min_p: 0.05,
                ..Default::default()
            },
            position: 0,
            logprobs: false,
        };
        let p = propose(&all, 0, &row, &CandidateOptions::default());
        assert!(p.candidates.len() >= 200);
        let allowed = model::sampling::allowed_tokens(
            &all,
            &SamplingParams {
                top_k: 0,
                ..row.params
            },
        );
        assert!(
            allowed
                .iter()
                .all(|t| p.candidates.iter().any(|c| c.token == *t))
        );
    }
}
