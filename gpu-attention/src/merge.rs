//! Merging the cards' LM-head proposals into one sampled token (no I/O).
//!
//! Each card holds a slice of the vocabulary and returns, per row, its best candidates
//! (logit, id), the log-sum-exp of its slice, and its Gumbel-max winner. What the merge gets
//! exactly from those:
//! - the log-sum-exp of the whole vocabulary (log-sum-exp of the cards' values), hence the exact
//!   logprob of any token whose logit is known;
//! - greedy: the best candidate overall (each card's best is among its candidates);
//! - seeded sampling without filters: the best winner by Gumbel score; a token's score depends
//!   only on (logit, seed, position, token id), so the draw is the same for any card count;
//! - top-k filtering with k no larger than the candidates per card: the k best tokens overall are
//!   among the candidates, so the allowed set and the draw are exact;
//! - the `n` best logprobs for `n` no larger than the candidates per card.
//!
//! Anything else (top-p, min-p, repetition penalties) needs probabilities of tokens the
//! candidates may not cover: the merge then asks for [`MergeOutcome::NeedFullLogits`] and the
//! node gathers every logit from the cards and samples exactly as the reference does.

use model::sampling::{self, SamplingParams};
use proto::data::Proposal;

use step::SampleRequest;

/// The merged result of one row.
#[derive(Debug, Clone, PartialEq)]
pub struct MergedToken {
    /// The token.
    pub token: u32,
    /// Its logprob under the unfiltered, temperature-1 distribution.
    pub logprob: f32,
    /// The best tokens and their logprobs.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// What the merge could decide.
#[derive(Debug, Clone, PartialEq)]
pub enum MergeOutcome {
    /// Decided exactly from the proposals.
    Done(MergedToken),
    /// The request needs every logit of the row.
    NeedFullLogits,
}

/// Whether a request can be merged from `candidates` per card, without the full logits.
pub fn mergeable(request: &SampleRequest, candidates: usize) -> bool {
    let p = &request.params;
    !request.penalties.is_active()
        && p.top_p >= 1.0
        && p.min_p <= 0.0
        && (p.is_greedy() || p.top_k <= candidates)
        && request.top_logprobs <= candidates
        && candidates >= 1
}

/// Candidates per card that `request` needs for an exact merge, at most `cap`: one for the
/// best token (greedy, or the pool a Gumbel winner falls back on), its top-k pool when
/// sampling, and its top logprobs. A row the proposals cannot decide with `cap` candidates
/// gathers every logit anyway, so it needs only one.
pub fn candidates_needed(request: &SampleRequest, cap: usize) -> usize {
    if !mergeable(request, cap) {
        return 1;
    }
    let p = &request.params;
    let pool = if p.is_greedy() { 1 } else { p.top_k.max(1) };
    pool.max(request.top_logprobs)
}

/// Log-sum-exp of the cards' log-sum-exps.
pub fn total_log_sum_exp(proposals: &[Proposal]) -> f64 {
    let max = proposals
        .iter()
        .map(|p| p.log_sum_exp)
        .fold(f64::NEG_INFINITY, f64::max);
    if max == f64::NEG_INFINITY {
        return max;
    }
    max + proposals
        .iter()
        .map(|p| (p.log_sum_exp - max).exp())
        .sum::<f64>()
        .ln()
}

/// Every card's candidates together, best first (ties: lower id first).
fn merged_candidates(proposals: &[Proposal]) -> Vec<(f32, u32)> {
    let mut all: Vec<(f32, u32)> = proposals
        .iter()
        .flat_map(|p| p.candidates.iter().map(|c| (c.logit, c.token)))
        .collect();
    all.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    all
}

/// Merges one row's proposals (one per card, any order) for `request` at `position`.
pub fn merge_row(
    proposals: &[Proposal],
    request: &SampleRequest,
    position: u64,
    candidates: usize,
) -> MergeOutcome {
    if !mergeable(request, candidates) || proposals.is_empty() {
        return MergeOutcome::NeedFullLogits;
    }
    // The cards computed no log-sum-exp for rows that want no logprobs.
    let lse = if request.wants_logprobs() {
        total_log_sum_exp(proposals)
    } else {
        f64::NAN
    };
    let logprob = |logit: f32| (logit as f64 - lse) as f32;
    let merged = merged_candidates(proposals);
    let Some(&(best_logit, best)) = merged.first() else {
        return MergeOutcome::NeedFullLogits;
    };
    let params: &SamplingParams = &request.params;
    let (token, logit) = if params.is_greedy() {
        (best, best_logit)
    } else if params.top_k > 0 {
        // The k best overall are among the candidates; draw among them.
        let mut winner = (f64::NEG_INFINITY, u32::MAX, 0f32);
        for &(l, t) in merged.iter().take(params.top_k) {
            let s = sampling::gumbel_score(l, params, position, t);
            if s > winner.0 || (s == winner.0 && t < winner.1) {
                winner = (s, t, l);
            }
        }
        (winner.1, winner.2)
    } else {
        let mut winner = (f64::NEG_INFINITY, u32::MAX, 0f32);
        for p in proposals {
            if p.winner_score > winner.0 || (p.winner_score == winner.0 && p.winner < winner.1) {
                winner = (p.winner_score, p.winner, p.winner_logit);
            }
        }
        (winner.1, winner.2)
    };
    MergeOutcome::Done(MergedToken {
        token,
        logprob: logprob(logit),
        top_logprobs: merged
            .iter()
            .take(request.top_logprobs)
            .map(|&(l, t)| (t, logprob(l)))
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::{TokenHistory, sample_row};
    use proptest::prelude::*;
    use proto::data::Candidate;
    use step::Penalties;

    /// What a card holding `tokens` of `logits` proposes.
    fn propose(
        logits: &[f32],
        tokens: std::ops::Range<usize>,
        k: usize,
        params: &SamplingParams,
        position: u64,
    ) -> Proposal {
        let slice = &logits[tokens.clone()];
        let mut order: Vec<usize> = tokens.clone().collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        let mut winner = (f64::NEG_INFINITY, u32::MAX, 0f32);
        if !params.is_greedy() {
            for t in tokens.clone() {
                let s = sampling::gumbel_score(logits[t], params, position, t as u32);
                if s > winner.0 {
                    winner = (s, t as u32, logits[t]);
                }
            }
        }
        Proposal {
            log_sum_exp: sampling::log_sum_exp(slice),
            winner: winner.1,
            winner_logit: winner.2,
            winner_score: winner.0,
            candidates: order
                .iter()
                .take(k)
                .map(|&t| Candidate {
                    logit: logits[t],
                    token: t as u32,
                })
                .collect(),
        }
    }

    proptest! {
        /// Greedy, unfiltered and top-k sampling, and logprobs, merged from any split of the
        /// vocabulary with only the candidates the row needs, equal what the full-logits
        /// sampler gives.
        #[test]
        fn merge_equals_full_logits_sampling(
            vocab in 2usize..80, cards in 1usize..5, seed in any::<u64>(), temperature in prop_oneof![Just(0.0f32), 0.3f32..2.0],
            top_k in 0usize..5, top_logprobs in 0usize..4, position in 0u64..1000, logprobs in any::<bool>(),
        ) {
            let logits: Vec<f32> = (0..vocab).map(|i| (((i as u64 * 2654435761) ^ seed) % 1000) as f32 / 100.0).collect();
            let request = SampleRequest {
                params: SamplingParams { temperature, top_k, seed, ..Default::default() },
                penalties: Penalties::default(),
                logprobs,
                top_logprobs,
            };
            let k = candidates_needed(&request, 8);
            prop_assert!(k <= 8);
            let per = vocab.div_ceil(cards);
            let proposals: Vec<Proposal> = (0..cards)
                .map(|c| (c * per).min(vocab)..((c + 1) * per).min(vocab))
                .filter(|r| !r.is_empty())
                .map(|r| propose(&logits, r, k, &request.params, position))
                // Cards skip the log-sum-exp of rows that want no logprobs.
                .map(|p| Proposal {
                    log_sum_exp: if request.wants_logprobs() { p.log_sum_exp } else { f64::NAN },
                    ..p
                })
                .collect();
            let MergeOutcome::Done(m) = merge_row(&proposals, &request, position, k) else {
                return Err(TestCaseError::fail("should merge"));
            };
            let full = sample_row(0, &logits, &request, &TokenHistory::default(), position);
            prop_assert_eq!(m.token, full.token);
            if request.wants_logprobs() {
                prop_assert!((m.logprob - full.logprob).abs() < 1e-5);
            } else {
                prop_assert!(m.logprob.is_nan());
            }
            prop_assert_eq!(m.top_logprobs.len(), full.top_logprobs.len());
            for (a, b) in m.top_logprobs.iter().zip(&full.top_logprobs) {
                prop_assert_eq!(a.0, b.0);
                prop_assert!((a.1 - b.1).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn nucleus_and_penalties_ask_for_full_logits() {
        let base = SampleRequest {
            params: SamplingParams {
                temperature: 1.0,
                ..Default::default()
            },
            penalties: Penalties::default(),
            logprobs: false,
            top_logprobs: 0,
        };
        let p = vec![Proposal {
            log_sum_exp: 0.0,
            winner: 0,
            winner_logit: 0.0,
            winner_score: 0.0,
            candidates: vec![Candidate {
                logit: 0.0,
                token: 0,
            }],
        }];
        let top_p = SampleRequest {
            params: SamplingParams {
                top_p: 0.9,
                ..base.params
            },
            ..base
        };
        assert_eq!(merge_row(&p, &top_p, 0, 8), MergeOutcome::NeedFullLogits);
        let min_p = SampleRequest {
            params: SamplingParams {
                min_p: 0.1,
                ..base.params
            },
            ..base
        };
        assert_eq!(merge_row(&p, &min_p, 0, 8), MergeOutcome::NeedFullLogits);
        let pen = SampleRequest {
            penalties: Penalties {
                presence: 0.5,
                ..Default::default()
            },
            ..base
        };
        assert_eq!(merge_row(&p, &pen, 0, 8), MergeOutcome::NeedFullLogits);
        let many = SampleRequest {
            top_logprobs: 9,
            ..base
        };
        assert_eq!(merge_row(&p, &many, 0, 8), MergeOutcome::NeedFullLogits);
        assert!(matches!(merge_row(&p, &base, 0, 8), MergeOutcome::Done(_)));
    }
}
