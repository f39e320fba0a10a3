//! The LM-head shard's proposals: per token, the shard's best candidates, its log-sum-exps and a
//! Gumbel-max winner, so that the attention node can pick the next token without the full
//! logits (DESIGN.md, step 5; the node's merge is `gpu_attention::merge`).
//!
//! Each card's logits are the same bits whatever the card count (a row's dot product does not
//! depend on how the vocabulary is split), and a proposal carries:
//! - the `candidates` best tokens of the shard (logit descending, lowest id first on ties):
//!   one for a greedy row, the row's top-k (and one more), top logprobs, or the node's
//!   candidate count for top-p and min-p rows, as the node asks;
//! - the shard's log-sum-exp (rows that want logprobs: any candidate's logprob is then exact
//!   up to rounding) and, for sampled rows, the log-sum-exp of `logits / temperature`: the
//!   node combines the cards' into the probability of every candidate under the distribution
//!   the row samples from, and bounds what the candidates leave out by each card's last one;
//! - the shard's Gumbel-max winner (sampled rows): the best score over all cards is exactly
//!   [`model::sampling::sample`]'s token for unfiltered rows, since every token's score depends
//!   only on (seed, position, token id) and its logit.
//!
//! - for a scored row (prompt logprobs), the logit of the row's target token when the shard
//!   holds it: with the cards' log-sum-exps, its logprob, exactly, without the full logits.
//!
//! The card needs only the row's temperature and seed ([`RowSampling::params`]); filters are
//! the node's to apply.

use model::sampling::{SamplingParams, gumbel_winner, log_sum_exp};
use serde::{Deserialize, Serialize};

/// How one token row picks its next token.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RowSampling {
    /// Temperature and seed (greedy by default); the filters are not the card's to apply.
    pub params: SamplingParams,
    /// Position of the token in its sequence (the Gumbel counter).
    pub position: u64,
    /// Whether the row's log-probabilities are wanted (the proposal's `log_sum_exp`).
    pub logprobs: bool,
    /// Whether the node samples the row with top-k, top-p or min-p (the proposal's
    /// `scaled_log_sum_exp`).
    pub filtered: bool,
    /// A token whose logit the proposal returns when the shard holds it (the prompt token a
    /// scored row asks the logprob of; [`LmProposal::target_logit`]).
    pub target: Option<u32>,
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
    /// Same over `logits / temperature` (sampled rows the node filters:
    /// [`RowSampling::filtered`]).
    pub scaled_log_sum_exp: Option<f64>,
    /// Gumbel-max winner over the shard (sampled rows).
    pub gumbel: Option<GumbelWinner>,
    /// The logit of the row's [`RowSampling::target`] when this shard holds it.
    pub target_logit: Option<f32>,
}

/// How many candidates to return.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CandidateOptions {
    /// Candidates per token. Default 64.
    pub candidates: usize,
}

impl Default for CandidateOptions {
    fn default() -> Self {
        CandidateOptions { candidates: 64 }
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
    let want = options.candidates.min(logits.len());
    // Only filtered sampling (top-k, top-p, min-p) needs the scaled distribution's normalizer;
    // plain sampling takes the Gumbel winners alone, and an exp of every logit of the shard
    // is a large part of a row's LM head.
    let scaled_log_sum_exp = (sampled && row.filtered).then(|| {
        let scaled: Vec<f32> = logits.iter().map(|&l| l / p.temperature).collect();
        log_sum_exp(&scaled)
    });
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
        scaled_log_sum_exp,
        gumbel,
        target_logit: row
            .target
            .and_then(|t| t.checked_sub(first_id))
            .and_then(|i| logits.get(i as usize).copied()),
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
                filtered: false,
                target: None,
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
            let one = CandidateOptions { candidates: 1 };
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
    fn filtered_rows_carry_the_log_sum_exp_of_the_scaled_logits() {
        let all = logits(3000, 1);
        let row = RowSampling {
            params: SamplingParams {
                temperature: 0.7,
                seed: 3,
                ..Default::default()
            },
            position: 0,
            logprobs: false,
            // The filters are the node's to apply; the card only hears that there are some.
            filtered: true,
            target: None,
        };
        let p = propose(&all, 0, &row, &CandidateOptions { candidates: 10 });
        assert_eq!(p.candidates.len(), 10);
        assert_eq!(p.shard_rows, 3000);
        assert!(p.log_sum_exp.is_none());
        let scaled: Vec<f32> = all.iter().map(|l| l / 0.7).collect();
        assert_eq!(p.scaled_log_sum_exp, Some(log_sum_exp(&scaled)));
        let greedy = propose(
            &all,
            0,
            &RowSampling::default(),
            &CandidateOptions { candidates: 10 },
        );
        assert!(greedy.scaled_log_sum_exp.is_none() && greedy.gumbel.is_none());
        assert_eq!(greedy.candidates, p.candidates);
        // Plain sampling needs only the Gumbel winner.
        let plain = RowSampling {
            filtered: false,
            ..row
        };
        let q = propose(&all, 0, &plain, &CandidateOptions { candidates: 10 });
        assert!(q.scaled_log_sum_exp.is_none());
        assert_eq!(q.gumbel, p.gumbel);
    }

    /// A scored row's target logit comes from exactly the card whose shard holds it, the same
    /// bits as the full row's; with the cards' log-sum-exps it gives the token's logprob.
    #[test]
    fn the_target_logit_comes_from_the_shard_holding_it() {
        let all = logits(700, 4);
        for target in [0u32, 1, 233, 234, 699] {
            let row = RowSampling {
                logprobs: true,
                target: Some(target),
                ..Default::default()
            };
            let mut found = Vec::new();
            let mut lses = Vec::new();
            for c in 0..3 {
                let span = crate::assignment::split_even(all.len(), 3, c);
                let p = propose(
                    &all[span.start..span.end],
                    span.start as u32,
                    &row,
                    &CandidateOptions { candidates: 2 },
                );
                lses.push(p.log_sum_exp.unwrap() as f32);
                if let Some(l) = p.target_logit {
                    found.push((c, l));
                }
            }
            assert_eq!(found.len(), 1, "target {target}: one card holds it");
            assert_eq!(found[0].1.to_bits(), all[target as usize].to_bits());
            let logprob = all[target as usize] as f64 - log_sum_exp(&lses);
            let want = model::sampling::log_softmax(&all)[target as usize] as f64;
            assert!((logprob - want).abs() < 1e-5, "target {target}");
        }
        let beyond = RowSampling {
            target: Some(700),
            ..Default::default()
        };
        assert_eq!(
            propose(&all, 0, &beyond, &CandidateOptions::default()).target_logit,
            None
        );
        let unscored = propose(
            &all,
            0,
            &RowSampling::default(),
            &CandidateOptions::default(),
        );
        assert_eq!(unscored.target_logit, None, "a sampled row has no target");
    }
}
