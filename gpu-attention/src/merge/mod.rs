//! Merging the cards' LM-head proposals into one sampled token (no I/O).
//!
//! Each card holds a slice of the vocabulary and returns, per row, its best candidates
//! (logit, id; logit descending, lowest id first on ties), how many vocabulary rows it holds,
//! the log-sum-exp of its slice (rows that want logprobs) and of its slice over `logit / T`
//! (sampled rows), and its Gumbel-max winner. What the merge gets exactly from those:
//! - the log-sum-exp of the whole vocabulary (log-sum-exp of the cards' values), hence the
//!   logprob of any token whose logit is known, exact up to the rounding of that sum;
//! - **greedy** (temperature 0, whatever the filters say): the best candidate overall (each
//!   card's best is among its candidates);
//! - **seeded sampling without filters**: the best winner by Gumbel score; a token's score
//!   depends only on (logit, seed, position, token id), so the draw is the same for any card
//!   count;
//! - **top-k, top-p and min-p** (any combination, at any temperature): the draw among the
//!   allowed tokens when the candidates provably hold them and everything their choice depends
//!   on ([`filtered`]): the min-p boundary (every card's last candidate below `min_p` times the
//!   largest probability, or top-k ending the set first), the mass top-p renormalizes by (the
//!   whole distribution's, from the cards' scaled log-sum-exps, or a set inside the candidates)
//!   and the top-p cut (every card's last candidate below it). Top-k alone is decided whenever
//!   each card returns `k + 1` candidates, barring ties in scaled logits; top-p and min-p when
//!   the nucleus fits in each card's candidates (the node asks for
//!   [`crate::NodeConfig::lm_head_candidates`] per card for such rows): peaked distributions,
//!   the usual case, are decided here; flat ones gather;
//! - the `n` best logprobs for `n` no larger than the candidates per card;
//! - **greedy under a mask** (structured output, [`merge_constrained_row`]): the best allowed
//!   candidate, when it beats every card's last candidate (or the card returned all its rows).
//!
//! - **a prompt token's logprob** (prompt logprobs, [`score_row`]): the logit the card holding it
//!   returns over the log-sum-exp of the vocabulary, and its best alternatives.
//!
//! What gathers: repetition, frequency and presence penalties (they change logits the cards do
//! not know); top logprobs beyond the candidates per card; sampled rows under a mask, and
//! masked greedy rows whose answer the candidates do not prove; filtered rows whose proof fails
//! (nucleus wider than the candidates, a decision within rounding of its threshold, ties at a
//! card's cut). The merge then says [`MergeOutcome::NeedFullLogits`] and the node gathers every
//! logit from the cards and samples exactly as the reference does.

mod filtered;
mod score;
#[cfg(test)]
mod tests;

pub use score::{score_candidates_needed, score_full_row, score_row};

use model::sampling::SamplingParams;
use proto::data::Proposal;

use step::{SampleRequest, TokenMask};

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

/// Whether a request may be merged from `candidates` per card without the full logits (a
/// filtered row is then decided by the proof in [`merge_row`], which can still ask for them).
pub fn mergeable(request: &SampleRequest, candidates: usize) -> bool {
    !request.penalties.is_active() && request.top_logprobs <= candidates && candidates >= 1
}

/// Candidates per card that `request` needs, at most `cap`: one for the best token (greedy,
/// or the pool a Gumbel winner falls back on); `top_k + 1` for top-k alone, so that the k-th
/// token is not a card's last candidate; `cap` for top-p and min-p, whose nucleus the
/// candidates must hold; and its top logprobs. A row the proposals cannot decide with `cap`
/// candidates gathers every logit anyway, so it needs only one.
///
/// A constrained row (one with [`SampleRequest::allowed`]) is decided from the proposals only
/// when greedy ([`merge_constrained_row`]): it asks for `cap`, for the best chance that an
/// allowed token is among them and beats every card's last one. A constrained sampled row
/// always gathers, so it needs only its top logprobs (or one).
pub fn candidates_needed(request: &SampleRequest, cap: usize) -> usize {
    if !mergeable(request, cap) {
        return 1;
    }
    let p = &request.params;
    if request.allowed.is_some() {
        return if p.is_greedy() {
            cap
        } else {
            request.top_logprobs.max(1)
        };
    }
    let pool = if p.is_greedy() {
        1
    } else if p.top_p < 1.0 || p.min_p > 0.0 {
        cap
    } else if p.top_k > 0 {
        (p.top_k + 1).min(cap)
    } else {
        1
    };
    pool.max(request.top_logprobs)
}

/// Log-sum-exp of the cards' log-sum-exps; `None` when a card computed none (the row wanted no
/// logprobs).
pub fn total_log_sum_exp(proposals: &[Proposal]) -> Option<f64> {
    // Two passes over the proposals rather than a list of their values: this runs for every
    // row that wants logprobs, every step.
    let mut max = f64::NEG_INFINITY;
    for p in proposals {
        max = max.max(p.log_sum_exp?);
    }
    if max == f64::NEG_INFINITY {
        return Some(max);
    }
    let mut sum = 0.0;
    for p in proposals {
        sum += (p.log_sum_exp? - max).exp();
    }
    Some(max + sum.ln())
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

/// The logprob and top logprobs of a decided row (`token`, of `logit`), from the unconstrained
/// distribution: the cards' log-sum-exps and the best candidates overall.
fn merged_token(
    proposals: &[Proposal],
    request: &SampleRequest,
    merged: &[(f32, u32)],
    token: u32,
    logit: f32,
) -> MergedToken {
    // The cards computed no log-sum-exp for rows that want no logprobs: their logprobs are
    // NaN, as `SampledToken::logprob` allows.
    let lse = if request.wants_logprobs() {
        total_log_sum_exp(proposals).unwrap_or(f64::NAN)
    } else {
        f64::NAN
    };
    let logprob = |logit: f32| (logit as f64 - lse) as f32;
    MergedToken {
        token,
        logprob: logprob(logit),
        top_logprobs: merged
            .iter()
            .take(request.top_logprobs)
            .map(|&(l, t)| (t, logprob(l)))
            .collect(),
    }
}

/// Merges one constrained row's proposals (one per card, any order) for `request`, whose
/// tokens `mask` allows ([`merge_row`] is for rows without a mask).
///
/// Only greedy rows are decided here: the answer is the best allowed candidate over every card
/// (lowest id on ties), provided no token a card left out could beat it, that is, every card
/// returned all its vocabulary rows or has its last (smallest) candidate strictly below it.
/// A sampled row would need every allowed token's Gumbel score or the mass of the allowed set,
/// which the proposals do not carry, so it gathers, as do rows with no allowed candidate, or
/// that [`mergeable`] refuses. The logprob and top logprobs are the unconstrained ones, as
/// [`merge_row`] gives them. No draw is made, so no position is needed.
pub fn merge_constrained_row(
    proposals: &[Proposal],
    request: &SampleRequest,
    mask: &TokenMask,
    candidates: usize,
) -> MergeOutcome {
    if !mergeable(request, candidates) || proposals.is_empty() || !request.params.is_greedy() {
        return MergeOutcome::NeedFullLogits;
    }
    let merged = merged_candidates(proposals);
    let Some(&(logit, token)) = merged.iter().find(|&&(_, t)| mask.allows(t)) else {
        return MergeOutcome::NeedFullLogits;
    };
    let beats_the_unseen = |p: &Proposal| match p.candidates.len().cmp(&(p.shard_rows as usize)) {
        std::cmp::Ordering::Equal => true,
        // A card that returned fewer than it holds left out tokens of at most its last
        // candidate's logit (NaN compares false: undecided).
        std::cmp::Ordering::Less => p.candidates.last().is_some_and(|last| logit > last.logit),
        // More candidates than rows: not a card's proposal to trust.
        std::cmp::Ordering::Greater => false,
    };
    if !proposals.iter().all(beats_the_unseen) {
        return MergeOutcome::NeedFullLogits;
    }
    MergeOutcome::Done(merged_token(proposals, request, &merged, token, logit))
}

/// Merges one row's proposals (one per card, any order) for `request` at `position`. A row
/// with a mask is [`merge_constrained_row`]'s: here it gathers.
pub fn merge_row(
    proposals: &[Proposal],
    request: &SampleRequest,
    position: u64,
    candidates: usize,
) -> MergeOutcome {
    // A constrained row merged as if unconstrained could answer a token its mask refuses.
    if !mergeable(request, candidates) || proposals.is_empty() || request.allowed.is_some() {
        return MergeOutcome::NeedFullLogits;
    }
    let merged = merged_candidates(proposals);
    let Some(&(best_logit, best)) = merged.first() else {
        return MergeOutcome::NeedFullLogits;
    };
    let params: &SamplingParams = &request.params;
    let (token, logit) = if params.is_greedy() {
        (best, best_logit)
    } else if params.has_filters() {
        match filtered::filtered_draw(proposals, params, position) {
            Some(t) => t,
            None => return MergeOutcome::NeedFullLogits,
        }
    } else {
        // The highest Gumbel score (lowest id on ties). A card whose score is NaN drew
        // nothing; if none drew, the row gathers rather than answer a made-up token.
        let winner = proposals
            .iter()
            .filter_map(|p| p.winner)
            .filter(|w| !w.score.is_nan())
            .max_by(|a, b| a.score.total_cmp(&b.score).then(b.token.cmp(&a.token)));
        match winner {
            Some(w) => (w.token, w.logit),
            None => return MergeOutcome::NeedFullLogits,
        }
    };
    MergeOutcome::Done(merged_token(proposals, request, &merged, token, logit))
}
