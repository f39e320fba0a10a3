//! Filtered sampling (min-p, top-k, top-p) decided from the cards' candidates, when it can be
//! proved to be the draw the full logits give.
//!
//! The reference ([`model::sampling::allowed_tokens`]) ranks every token by its scaled logit
//! `logit / T` (f32; lowest id first on ties), keeps a prefix for min-p (probability at least
//! `min_p` times the largest), a prefix of that for top-k, and the shortest prefix of that
//! whose share of its mass reaches `top_p`; then the Gumbel-max draw among what is left.
//!
//! From the proposals the merge knows:
//! - the scaled logit of every candidate, so their order among themselves;
//! - for a card whose list is cut short, its last candidate: every token it did not return
//!   comes after that one in the card's order (logit descending, id ascending), so a candidate
//!   above the last one's scaled logit comes before all of them in the reference's order too
//!   ([`Cut::precedes_unseen`]). The candidates that come before every token no card returned
//!   are the *known prefix*: there, the ranks are the global ranks;
//! - the log-sum-exp of the scaled logits (from the cards' `scaled_log_sum_exp`), hence every
//!   candidate's probability, and a bound on the rest: the remaining mass, and each remaining
//!   token's probability (at most the next candidate's or a cut's).
//!
//! The draw is exact when the kept prefix, and everything its length depends on, lies inside
//! the known prefix: the min-p boundary is seen (or top-k ends the set first), the mass that
//! top-p renormalizes by is known (the whole distribution's, or a set inside the known prefix),
//! and the top-p cut falls inside the known prefix. Every comparison the reference makes is
//! decided here only when it holds by more than [`rounding_margin`], so the rounding of the two
//! log-sum-exps (one over the whole vocabulary, one from the shards) cannot flip it.

use model::sampling::{SamplingParams, gumbel_score};
use proto::data::Proposal;

/// A candidate with its scaled logit.
#[derive(Debug, Clone, Copy)]
struct Ranked {
    scaled: f32,
    logit: f32,
    token: u32,
}

/// The last candidate of a card whose list is cut short.
#[derive(Debug, Clone, Copy)]
struct Cut {
    scaled: f32,
    token: u32,
    /// The scaled value of the float just below its logit: any token of lower logit scales to
    /// at most this.
    below: f32,
}

impl Cut {
    /// Whether `c` comes before every token this card did not return, in the reference's
    /// order. The card left out tokens of lower logit (scaled logit at most `below`) and tokens
    /// of the same logit with higher ids.
    fn precedes_unseen(&self, c: &Ranked) -> bool {
        c.scaled > self.scaled
            || (c.scaled == self.scaled && self.below < self.scaled && c.token <= self.token)
    }
}

/// Relative slack within which a comparison of probabilities or masses is left undecided: far
/// above what summing `vocab` terms in f64 can move them (the reference's log-sum-exp over the
/// whole vocabulary and the shards' combined one differ by rounding only), far below any
/// difference that matters.
pub(super) fn rounding_margin(vocab: usize) -> f64 {
    16.0 * (vocab as f64 + 16.0) * f64::EPSILON
}

/// `ln(sum(exp(values)))`.
fn log_sum_exp(values: &[f64]) -> f64 {
    let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    max + values.iter().map(|v| (v - max).exp()).sum::<f64>().ln()
}

/// The token a filtered, seeded draw at `position` gives, and its logit; `None` when the
/// candidates cannot prove it (the node then gathers the full logits).
pub(super) fn filtered_draw(
    proposals: &[Proposal],
    params: &SamplingParams,
    position: u64,
) -> Option<(u32, f32)> {
    let mut winner: Option<(f64, u32, f32)> = None;
    for (token, logit) in allowed(proposals, params)? {
        let s = gumbel_score(logit, params, position, token);
        if winner.is_none_or(|(best, t, _)| s > best || (s == best && token < t)) {
            winner = Some((s, token, logit));
        }
    }
    winner.map(|(_, token, logit)| (token, logit))
}

/// The tokens the filters allow (and their logits), most probable first: what
/// [`model::sampling::allowed_tokens`] gives from the full logits; `None` when the candidates
/// cannot prove it.
pub(super) fn allowed(proposals: &[Proposal], params: &SamplingParams) -> Option<Vec<(u32, f32)>> {
    let t = params.temperature;
    let vocab: usize = proposals.iter().map(|p| p.shard_rows as usize).sum();
    let mut ranked = Vec::new();
    let mut cuts = Vec::new();
    for p in proposals {
        if p.candidates.len() > p.shard_rows as usize {
            return None;
        }
        ranked.extend(p.candidates.iter().map(|c| Ranked {
            scaled: c.logit / t,
            logit: c.logit,
            token: c.token,
        }));
        if p.candidates.len() < p.shard_rows as usize {
            let last = p.candidates.last()?;
            cuts.push(Cut {
                scaled: last.logit / t,
                token: last.token,
                below: last.logit.next_down() / t,
            });
        }
    }
    let lses: Vec<f64> = proposals
        .iter()
        .map(|p| p.scaled_log_sum_exp)
        .collect::<Option<_>>()?;
    if ranked.iter().any(|r| !r.scaled.is_finite()) || lses.iter().any(|l| !l.is_finite()) {
        return None;
    }
    ranked.sort_by(|a, b| b.scaled.total_cmp(&a.scaled).then(a.token.cmp(&b.token)));
    let known = ranked
        .iter()
        .take_while(|r| cuts.iter().all(|c| c.precedes_unseen(r)))
        .count();
    if known == 0 {
        return None;
    }
    let lse = log_sum_exp(&lses);
    let total: f64 = lses.iter().map(|l| (l - lse).exp()).sum();
    let prob: Vec<f64> = ranked[..known]
        .iter()
        .map(|r| (r.scaled as f64 - lse).exp())
        .collect();
    let eps = rounding_margin(vocab);

    // The size of the filtered set the reference renormalizes (min-p, then top-k), as bounds:
    // never more than top-k keeps, and min-p matters only before that.
    let limit = if params.top_k > 0 {
        params.top_k.min(vocab)
    } else {
        vocab
    };
    let (lo, hi) = if params.min_p > 0.0 {
        let floor = params.min_p as f64 * prob[0];
        // The most probable token always passes (min_p <= 1).
        match (1..known.min(limit)).find(|&i| prob[i] < floor * (1.0 + eps)) {
            Some(i) if prob[i] < floor * (1.0 - eps) => (i, i),
            Some(_) => return None,
            None if known >= limit => (limit, limit),
            None => (known, limit),
        }
    } else {
        (limit, limit)
    };

    let keep = if params.top_p >= 1.0 {
        // Everything filtered is kept: it must all be known.
        (hi <= known).then_some(hi)?
    } else {
        let (mass_lo, mass_hi) = if hi <= known {
            let m: f64 = prob[..hi].iter().sum();
            (m, m)
        } else if lo == vocab {
            (total, total)
        } else {
            // The known prefix and at most `hi - known` tokens after it, none more probable
            // than the next candidate or a cut.
            let base: f64 = prob.iter().sum();
            let next = ranked
                .get(known)
                .map(|r| r.scaled)
                .into_iter()
                .chain(cuts.iter().map(|c| c.scaled))
                .fold(f32::NEG_INFINITY, f32::max);
            let rest = (hi - known) as f64 * (next as f64 - lse).exp();
            (base, (base + rest).min(total).max(base))
        };
        let top_p = params.top_p as f64;
        let mut reached = 0.0;
        let mut cut = None;
        for (j, p) in prob.iter().take(hi.min(known)).enumerate() {
            reached += p;
            if reached / mass_lo >= top_p * (1.0 - eps) {
                // Reached here for certain, or the filtered set ends here anyway.
                if reached / mass_hi >= top_p * (1.0 + eps) || (lo == hi && j + 1 == hi) {
                    cut = Some(j + 1);
                    break;
                }
                return None;
            }
        }
        match cut {
            Some(j) => j,
            // The whole filtered set stays short of top_p: the reference keeps all of it.
            None => (hi <= known).then_some(hi)?,
        }
    };

    Some(ranked[..keep].iter().map(|r| (r.token, r.logit)).collect())
}
