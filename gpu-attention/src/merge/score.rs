//! Scoring a prompt token from the cards' proposals (prompt logprobs), exactly and without the
//! full logits: the card holding the token returns its logit, every card its shard's
//! log-sum-exp, and the alternatives are the best candidates over every card.

use proto::data::Proposal;
use step::ScoredToken;

use super::{merged_candidates, total_log_sum_exp};

/// Candidates per card a scored row needs: its alternatives (at least one, the least a
/// proposal carries), or one when they exceed `cap` (the row then gathers every logit).
pub fn score_candidates_needed(top_logprobs: usize, cap: usize) -> usize {
    if top_logprobs > cap {
        1
    } else {
        top_logprobs.max(1)
    }
}

/// The logprob of `target` and the `top_logprobs` best alternatives, from one proposal per
/// card of `candidates` each, or `None` when the proposals cannot say exactly: no card returned
/// the target's logit (its holder is down), a card computed no log-sum-exp, or more
/// alternatives are asked than each card proposed. The node then gathers every logit.
pub fn score_row(
    proposals: &[Proposal],
    target: u32,
    top_logprobs: usize,
    candidates: usize,
) -> Option<ScoredToken> {
    if proposals.is_empty() || top_logprobs > candidates {
        return None;
    }
    let mut holders = proposals.iter().filter_map(|p| p.target_logit);
    let logit = holders.next()?;
    if holders.next().is_some() {
        return None; // two cards claim the token: not a partition of the vocabulary
    }
    let lse = total_log_sum_exp(proposals).filter(|l| l.is_finite())?;
    let logprob = |l: f32| (l as f64 - lse) as f32;
    Some(ScoredToken {
        token: target,
        logprob: logprob(logit),
        top_logprobs: merged_candidates(proposals)
            .into_iter()
            .take(top_logprobs)
            .map(|(l, t)| (t, logprob(l)))
            .collect(),
    })
}

/// Scores `target` from a full row of logits (the node's own, or every card's gathered), as
/// the reference does.
pub fn score_full_row(logits: &[f32], target: u32, top_logprobs: usize) -> Option<ScoredToken> {
    let logprobs = model::sampling::log_softmax(logits);
    Some(ScoredToken {
        token: target,
        logprob: *logprobs.get(target as usize)?,
        top_logprobs: crate::sampler::top_n(&logprobs, top_logprobs),
    })
}

#[cfg(test)]
mod tests {
    use proto::data::Candidate;

    use super::*;

    /// The cards' proposals of `logits` split in `cards` even shards, `k` candidates each,
    /// scoring `target`.
    fn proposals(logits: &[f32], cards: usize, k: usize, target: u32) -> Vec<Proposal> {
        let per = logits.len().div_ceil(cards);
        logits
            .chunks(per)
            .enumerate()
            .map(|(c, shard)| {
                let first = (c * per) as u32;
                let mut order: Vec<usize> = (0..shard.len()).collect();
                order.sort_by(|&a, &b| shard[b].total_cmp(&shard[a]).then(a.cmp(&b)));
                Proposal {
                    log_sum_exp: Some(model::sampling::log_sum_exp(shard)),
                    scaled_log_sum_exp: None,
                    winner: None,
                    shard_rows: shard.len() as u32,
                    target_logit: target
                        .checked_sub(first)
                        .and_then(|i| shard.get(i as usize).copied()),
                    candidates: order
                        .into_iter()
                        .take(k)
                        .map(|i| Candidate {
                            logit: shard[i],
                            token: first + i as u32,
                        })
                        .collect(),
                }
            })
            .collect()
    }

    fn logits(n: usize, seed: u32) -> Vec<f32> {
        (0..n as u32)
            .map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed) % 1000) as f32 / 97.0 - 5.0)
            .collect()
    }

    /// Any split, any target: the merged score is the full row's, to f64 rounding of the
    /// log-sum-exp, and the alternatives are the full row's best, in order.
    #[test]
    fn scores_from_proposals_equal_the_full_rows() {
        for seed in 0..8 {
            let row = logits(301, seed);
            for cards in [1, 2, 3, 7] {
                for target in [0u32, 17, 150, 300] {
                    let want = score_full_row(&row, target, 3).unwrap();
                    let got = score_row(&proposals(&row, cards, 3, target), target, 3, 3)
                        .expect("decided");
                    assert_eq!(got.token, target);
                    assert!(
                        (got.logprob - want.logprob).abs() < 1e-5,
                        "seed {seed}, {cards} cards, target {target}: {} vs {}",
                        got.logprob,
                        want.logprob
                    );
                    let ids =
                        |s: &ScoredToken| s.top_logprobs.iter().map(|t| t.0).collect::<Vec<_>>();
                    assert_eq!(ids(&got), ids(&want));
                }
            }
        }
    }

    /// What the proposals cannot decide gathers: the holder of the target missing, more
    /// alternatives than candidates, a card without its log-sum-exp, no proposal at all.
    #[test]
    fn undecidable_rows_ask_for_the_full_logits() {
        let row = logits(64, 1);
        let mut props = proposals(&row, 4, 2, 40);
        assert!(score_row(&props, 40, 2, 2).is_some());
        assert!(
            score_row(&props, 40, 3, 2).is_none(),
            "3 alternatives from 2 each"
        );
        assert!(score_row(&[], 40, 0, 1).is_none());
        let holder = props.iter().position(|p| p.target_logit.is_some()).unwrap();
        let mut no_lse = props.clone();
        no_lse[holder ^ 1].log_sum_exp = None;
        assert!(
            score_row(&no_lse, 40, 0, 2).is_none(),
            "a card without its lse"
        );
        props.remove(holder);
        assert!(
            score_row(&props, 40, 0, 2).is_none(),
            "the holder is missing"
        );
    }

    #[test]
    fn candidates_needed_covers_the_alternatives_up_to_the_cap() {
        assert_eq!(score_candidates_needed(0, 8), 1);
        assert_eq!(score_candidates_needed(5, 8), 5);
        assert_eq!(score_candidates_needed(8, 8), 8, "as many as the cap");
        assert_eq!(score_candidates_needed(9, 8), 1, "beyond the cap: gathered");
    }
}
