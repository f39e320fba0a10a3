//! Turning one row of logits into a sampled token: repetition penalties (vLLM semantics),
//! seeded sampling (`model::sampling`), and logprobs.

use std::collections::HashMap;

use model::sampling;
use rayon::prelude::*;

use step::{Penalties, SampleRequest, SampledToken, SeqId, StepEntry};

/// The tokens of one sequence, split into prompt and output, for penalties.
#[derive(Debug, Clone, Default)]
pub struct TokenHistory {
    tokens: Vec<u32>,
    prompt_len: usize,
}

impl TokenHistory {
    /// Appends tokens; `prompt_len` says how many of all tokens are prompt.
    pub fn extend(&mut self, tokens: &[u32], prompt_len: usize) {
        self.tokens.extend_from_slice(tokens);
        self.prompt_len = prompt_len;
    }

    /// Keeps the first `len` tokens (forgetting a failed step's).
    pub fn truncate(&mut self, len: usize) {
        self.tokens.truncate(len);
    }

    /// Number of tokens so far.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// All tokens.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Generated tokens.
    pub fn output(&self) -> &[u32] {
        &self.tokens[self.prompt_len.min(self.tokens.len())..]
    }
}

/// Records a step's new tokens in their sequence's history. An entry that starts its sequence
/// (from 0, or after a cached prefix) starts the history afresh, with the cached tokens.
pub(crate) fn record_tokens(histories: &mut HashMap<SeqId, TokenHistory>, e: &StepEntry) {
    let history = histories.entry(e.seq).or_default();
    if e.starts_sequence() {
        *history = TokenHistory::default();
        history.extend(&e.cached_prefix, e.prompt_len);
    }
    history.extend(&e.tokens, e.prompt_len);
}

/// Applies `penalties` to `logits` in place: repetition over every token seen, frequency and
/// presence over generated tokens (vLLM's order and formulas).
pub fn apply_penalties(logits: &mut [f32], penalties: &Penalties, history: &TokenHistory) {
    if !penalties.is_active() {
        return;
    }
    if penalties.repetition != 1.0 {
        let mut seen: Vec<u32> = history.tokens().to_vec();
        seen.sort_unstable();
        seen.dedup();
        for t in seen {
            if let Some(l) = logits.get_mut(t as usize) {
                *l = if *l > 0.0 {
                    *l / penalties.repetition
                } else {
                    *l * penalties.repetition
                };
            }
        }
    }
    if penalties.frequency != 0.0 || penalties.presence != 0.0 {
        let mut counts: HashMap<u32, u32> = HashMap::new();
        for &t in history.output() {
            *counts.entry(t).or_default() += 1;
        }
        for (t, c) in counts {
            if let Some(l) = logits.get_mut(t as usize) {
                *l -= penalties.frequency * c as f32 + penalties.presence;
            }
        }
    }
}

/// The `n` most likely tokens of `logprobs`, best first (ties: lower id first).
pub fn top_n(logprobs: &[f32], n: usize) -> Vec<(u32, f32)> {
    if n == 0 {
        return Vec::new();
    }
    let mut idx: Vec<u32> = (0..logprobs.len() as u32).collect();
    let n = n.min(idx.len());
    idx.select_nth_unstable_by(n - 1, |&a, &b| {
        logprobs[b as usize]
            .total_cmp(&logprobs[a as usize])
            .then(a.cmp(&b))
    });
    idx.truncate(n);
    idx.sort_by(|&a, &b| {
        logprobs[b as usize]
            .total_cmp(&logprobs[a as usize])
            .then(a.cmp(&b))
    });
    idx.into_iter().map(|i| (i, logprobs[i as usize])).collect()
}

/// Samples the token at `position` of `seq` from a full row of logits.
pub fn sample_row(
    seq: SeqId,
    logits: &[f32],
    request: &SampleRequest,
    history: &TokenHistory,
    position: u64,
) -> SampledToken {
    // Only the sampled token's log-probability is always wanted: the row's log-sum-exp, and
    // its log-probabilities only for alternatives.
    let lse = sampling::log_sum_exp(logits);
    let token = if request.penalties.is_active() {
        let mut penalized = logits.to_vec();
        apply_penalties(&mut penalized, &request.penalties, history);
        sampling::sample(&penalized, &request.params, position)
    } else {
        sampling::sample(logits, &request.params, position)
    };
    SampledToken {
        seq,
        token,
        logprob: sampling::log_prob(logits[token as usize], lse),
        top_logprobs: if request.top_logprobs > 0 {
            top_n(&sampling::log_probs(logits, lse), request.top_logprobs)
        } else {
            Vec::new()
        },
    }
}

/// One row of a step to sample with [`sample_row`].
#[derive(Debug, Clone, Copy)]
pub struct RowToSample<'a> {
    /// Its sequence.
    pub seq: SeqId,
    /// Its full row of logits.
    pub logits: &'a [f32],
    /// How to sample it.
    pub request: &'a SampleRequest,
    /// The sequence's tokens so far (for penalties).
    pub history: &'a TokenHistory,
    /// The sampled token's position.
    pub position: u64,
}

/// [`sample_row`] of every row, on the rayon pool, in the rows' order. A row is a few passes
/// over the vocabulary (0.3 ms for 32,000 logits on a 2-core EPYC VM), which one after another
/// left the other core idle for about a tenth of a 16-sequence decode step of the reference
/// node. Each row's result depends on that row alone.
pub fn sample_rows(rows: &[RowToSample<'_>]) -> Vec<SampledToken> {
    rows.par_iter()
        .map(|r| sample_row(r.seq, r.logits, r.request, r.history, r.position))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn penalties_follow_vllm() {
        let mut h = TokenHistory::default();
        h.extend(&[0, 1], 2); // prompt
        h.extend(&[2, 2], 2); // output: token 2 twice
        let mut logits = vec![2.0, -2.0, 1.0, 5.0];
        let p = Penalties {
            presence: 0.5,
            frequency: 0.25,
            repetition: 2.0,
        };
        apply_penalties(&mut logits, &p, &h);
        assert_eq!(logits, vec![1.0, -4.0, 0.5 - 0.5 - 0.5, 5.0]);
    }

    /// A temperature too small to divide by (a subnormal, or anything below
    /// `sampling::GREEDY_BELOW`) decodes greedily on every path that samples: the full-logits
    /// sampler (with and without penalties or filters) and the merge of the cards' proposals,
    /// and the token's logprob is the best token's.
    #[test]
    fn tiny_temperatures_sample_the_best_token_on_every_path() {
        use crate::merge::{MergeOutcome, merge_row};
        use proto::data::{Candidate, Proposal};

        let logits = [-1.0f32, 0.5, 3.0, 2.5, 1.0, -4.0];
        let raw = sampling::log_softmax(&logits);
        let mut history = TokenHistory::default();
        history.extend(&[4, 5], 2);
        for temperature in [1e-45f32, 1e-40, 1e-38, 1e-30, 5e-6] {
            let plain = SampleRequest {
                params: sampling::SamplingParams {
                    temperature,
                    seed: 3,
                    ..Default::default()
                },
                penalties: Penalties::default(),
                logprobs: true,
                top_logprobs: 1,
            };
            let filtered = SampleRequest {
                params: sampling::SamplingParams {
                    top_p: 0.9,
                    top_k: 4,
                    min_p: 0.01,
                    ..plain.params
                },
                penalties: Penalties {
                    presence: 0.1,
                    frequency: 0.0,
                    repetition: 1.1,
                },
                ..plain
            };
            for (name, request) in [("plain", &plain), ("filtered", &filtered)] {
                for position in 0..16 {
                    let got = sample_row(7, &logits, request, &history, position);
                    assert_eq!(got.token, 2, "{name} at {temperature}");
                    assert_eq!(got.logprob, raw[2], "{name} at {temperature}");
                }
            }
            // Two cards, vocabulary halves; greedy rows carry no Gumbel winner.
            let proposals: Vec<Proposal> = [0..3usize, 3..6]
                .into_iter()
                .map(|r| {
                    let best = r.clone().max_by(|&a, &b| logits[a].total_cmp(&logits[b]));
                    let best = best.unwrap_or(r.start);
                    Proposal {
                        log_sum_exp: sampling::log_sum_exp(&logits[r.clone()]),
                        scaled_log_sum_exp: f64::NAN,
                        winner: u32::MAX,
                        winner_logit: 0.0,
                        winner_score: f64::NEG_INFINITY,
                        shard_rows: r.len() as u32,
                        candidates: vec![Candidate {
                            logit: logits[best],
                            token: best as u32,
                        }],
                    }
                })
                .collect();
            let MergeOutcome::Done(merged) = merge_row(&proposals, &plain, 0, 1) else {
                panic!("a greedy row merges from one candidate per card");
            };
            assert_eq!(merged.token, 2, "merge at {temperature}");
            assert!((merged.logprob - raw[2]).abs() < 1e-6);
        }
    }

    /// The sampled token's logprob and the top alternatives are `log_softmax`'s bits, with and
    /// without alternatives asked for.
    #[test]
    fn logprobs_are_the_log_softmax_of_the_row() {
        let logits: Vec<f32> = (0..257)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let raw = sampling::log_softmax(&logits);
        for (top, position) in [(0, 3u64), (5, 4), (20, 5)] {
            let request = SampleRequest {
                params: sampling::SamplingParams {
                    temperature: 1.0,
                    seed: 11,
                    ..Default::default()
                },
                penalties: Penalties::default(),
                logprobs: true,
                top_logprobs: top,
            };
            let got = sample_row(1, &logits, &request, &TokenHistory::default(), position);
            assert_eq!(got.logprob.to_bits(), raw[got.token as usize].to_bits());
            assert_eq!(got.top_logprobs, top_n(&raw, top));
            assert_eq!(got.top_logprobs.len(), top);
        }
    }

    #[test]
    fn top_n_orders_and_breaks_ties_by_id() {
        assert_eq!(top_n(&[0.1, 0.5, 0.5, -1.0], 2), vec![(1, 0.5), (2, 0.5)]);
        assert!(top_n(&[0.1], 0).is_empty());
    }
}
