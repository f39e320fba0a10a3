//! The merge of rows under a structured-output mask: decided only when the candidates prove
//! the masked argmax, gathered otherwise.

use proptest::prelude::*;
use step::TokenMask;

use super::*;

/// A random non-empty mask over `vocab` tokens: one token (`kind` 0), about one in eight
/// (`1`), or about half (`2`).
fn random_mask(vocab: usize, kind: u8, seed: u64) -> TokenMask {
    let mut s = seed;
    let mut mask = TokenMask::none(vocab);
    let one_in = match kind {
        0 => 0,
        1 => 8,
        _ => 2,
    };
    if one_in > 0 {
        for t in 0..vocab as u32 {
            if splitmix(&mut s).is_multiple_of(one_in) {
                mask.allow(t);
            }
        }
    }
    mask.allow((splitmix(&mut s) % vocab as u64) as u32);
    mask
}

/// The best allowed token of `logits` (lowest id on ties).
fn masked_argmax(logits: &[f32], mask: &TokenMask) -> u32 {
    let mut best: Option<u32> = None;
    for t in mask.iter() {
        if best.is_none_or(|b| logits[t as usize] > logits[b as usize]) {
            best = Some(t);
        }
    }
    best.expect("a non-empty mask")
}

fn constrained(
    params: SamplingParams,
    mask: &TokenMask,
    logprobs: bool,
    top_logprobs: usize,
) -> SampleRequest {
    SampleRequest {
        allowed: Some(step::AllowedTokens::ready(mask.clone())),
        ..request(params, logprobs, top_logprobs)
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Any logits, card split, candidate counts and non-empty mask: a constrained greedy row
    /// the merge decides is the masked argmax of the full logits (lowest id on ties) with the
    /// raw logprob and alternatives, as the full-logits sampler gives them; and it decides
    /// whenever the masked argmax is among its card's candidates and above every cut-short
    /// card's last candidate.
    #[test]
    fn a_constrained_greedy_merge_is_the_masked_argmax(
        vocab in 1usize..160, shape in 0u8..3, seed in any::<u64>(), cards in 1usize..6,
        mask_kind in 0u8..3, mask_seed in any::<u64>(), cap in 1usize..40, uneven in any::<bool>(),
        top_logprobs in 0usize..4, logprobs in any::<bool>(), position in 0u64..1000,
    ) {
        let logits = logits(vocab, shape, seed);
        let mask = random_mask(vocab, mask_kind, mask_seed);
        let request = constrained(SamplingParams::greedy(), &mask, logprobs, top_logprobs);
        let k = candidates_needed(&request, cap);
        prop_assert_eq!(k, if top_logprobs <= cap { cap } else { 1 });
        let k_card = |c: usize| {
            if uneven {
                (1 + (seed >> (c * 7)) as usize % k).max(top_logprobs.min(k))
            } else {
                k
            }
        };
        let proposals = proposals_with(&logits, cards, k_card, &request, position);
        let expected = masked_argmax(&logits, &mask);
        match merge_constrained_row(&proposals, &request, &mask, k) {
            MergeOutcome::Done(m) => {
                prop_assert_eq!(m.token, expected);
                assert_same_as_full_logits(&m, &logits, &request, position);
            }
            MergeOutcome::NeedFullLogits => {
                let best = logits[expected as usize];
                let returned = proposals
                    .iter()
                    .any(|p| p.candidates.iter().any(|c| c.token == expected));
                let above_every_cut = proposals.iter().all(|p| {
                    p.candidates.len() == p.shard_rows as usize
                        || p.candidates.last().is_some_and(|c| best > c.logit)
                });
                prop_assert!(
                    !(mergeable(&request, k) && returned && above_every_cut),
                    "gathered a row the candidates decide"
                );
            }
        }
    }

    /// Sampled constrained rows always gather (the proposals carry no allowed token's draw),
    /// asking for no more candidates than their top logprobs.
    #[test]
    fn a_constrained_sampled_row_gathers(
        vocab in 1usize..80, seed in any::<u64>(), cards in 1usize..4,
        mask_seed in any::<u64>(), temperature in 0.2f32..2.0, top_logprobs in 0usize..4,
    ) {
        let logits = logits(vocab, 2, seed);
        let mask = random_mask(vocab, 2, mask_seed);
        let params = SamplingParams { temperature, seed, ..Default::default() };
        let request = constrained(params, &mask, true, top_logprobs);
        prop_assert_eq!(candidates_needed(&request, 16), top_logprobs.max(1));
        let p = proposals(&logits, cards, 16, &request, 3);
        prop_assert_eq!(
            merge_constrained_row(&p, &request, &mask, 16),
            MergeOutcome::NeedFullLogits
        );
        // Nor does the unconstrained merge decide a row with a mask.
        prop_assert_eq!(merge_row(&p, &request, 3, 16), MergeOutcome::NeedFullLogits);
    }
}

#[test]
fn a_constrained_greedy_row_decides_from_the_candidates_or_gathers() {
    // Two cards of four tokens, three candidates each: card 0 returns 0 (9.0), 1 (8.0) and 2
    // (7.5), card 1 returns 4 (7.0), 6 (6.5) and 5 (6.0).
    let logits = [9.0f32, 8.0, 7.5, 1.0, 7.0, 6.0, 6.5, 0.0];
    let p = |mask: &TokenMask| {
        let r = constrained(SamplingParams::greedy(), mask, true, 1);
        let outcome = merge_constrained_row(&proposals(&logits, 2, 3, &r, 0), &r, mask, 3);
        (outcome, r)
    };
    // Token 1 beats both last candidates (7.5 and 6.0).
    let mask = TokenMask::from_tokens(8, [1, 3, 5]);
    let (MergeOutcome::Done(m), r) = p(&mask) else {
        panic!("gathered");
    };
    assert_eq!(m.token, 1);
    assert_same_as_full_logits(&m, &logits, &r, 0);
    // The alternatives are the unconstrained ones.
    assert_eq!(m.top_logprobs[0].0, 0);
    // Token 4 (7.0) is not above card 0's last (7.5): card 0 may hold an allowed 7.2.
    let (outcome, _) = p(&TokenMask::from_tokens(8, [4, 3]));
    assert_eq!(outcome, MergeOutcome::NeedFullLogits);
    // Token 2 is card 0's last candidate: not strictly above it.
    let (outcome, _) = p(&TokenMask::from_tokens(8, [2, 7]));
    assert_eq!(outcome, MergeOutcome::NeedFullLogits);
    // No allowed candidate at all.
    let (outcome, _) = p(&TokenMask::from_tokens(8, [3, 7]));
    assert_eq!(outcome, MergeOutcome::NeedFullLogits);
    // Every row of each card returned: the best allowed candidate wins whatever its rank.
    let mask = TokenMask::from_tokens(8, [3, 7]);
    let r = constrained(SamplingParams::greedy(), &mask, true, 1);
    let MergeOutcome::Done(m) =
        merge_constrained_row(&proposals(&logits, 2, 4, &r, 0), &r, &mask, 4)
    else {
        panic!("gathered complete lists");
    };
    assert_eq!(m.token, 3);
    assert_same_as_full_logits(&m, &logits, &r, 0);
    // Penalties gather, and ask for one candidate.
    let mask = TokenMask::from_tokens(8, [1]);
    let pen = SampleRequest {
        penalties: Penalties {
            repetition: 1.2,
            ..Default::default()
        },
        ..constrained(SamplingParams::greedy(), &mask, false, 0)
    };
    assert_eq!(candidates_needed(&pen, 64), 1);
    let props = proposals(&logits, 2, 2, &pen, 0);
    assert_eq!(
        merge_constrained_row(&props, &pen, &mask, 2),
        MergeOutcome::NeedFullLogits
    );
    // A greedy constrained row asks for every candidate the node allows.
    let greedy = constrained(SamplingParams::greedy(), &mask, false, 0);
    assert_eq!(candidates_needed(&greedy, 64), 64);
}

/// A greedy constrained row the proposals cannot stand for (penalties change logits the cards
/// do not know, or more top logprobs than candidates) gathers, whatever its candidates say.
#[test]
fn a_constrained_greedy_row_the_merge_refuses_gathers() {
    let logits = logits(30, 0, 5);
    let mask = TokenMask::all(30);
    let mut penalized = constrained(SamplingParams::greedy(), &mask, false, 0);
    penalized.penalties.repetition = 1.3;
    let p = proposals(&logits, 2, 8, &penalized, 0);
    assert_eq!(
        merge_constrained_row(&p, &penalized, &mask, 8),
        MergeOutcome::NeedFullLogits
    );
    let wide = constrained(SamplingParams::greedy(), &mask, true, 9);
    let p = proposals(&logits, 2, 8, &wide, 0);
    assert_eq!(
        merge_constrained_row(&p, &wide, &mask, 8),
        MergeOutcome::NeedFullLogits,
        "9 top logprobs from 8 candidates a card"
    );
    let plain = constrained(SamplingParams::greedy(), &mask, false, 0);
    let p = proposals(&logits, 2, 8, &plain, 0);
    assert!(matches!(
        merge_constrained_row(&p, &plain, &mask, 8),
        MergeOutcome::Done(_)
    ));
}
