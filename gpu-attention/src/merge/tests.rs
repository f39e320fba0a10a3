//! The merge against full-logits sampling (`model::sampling` through the node's sampler): the
//! same token whenever it decides, and a decision whenever the candidates visibly hold what the
//! draw depends on.

use model::sampling::{self, SamplingParams};
use proptest::prelude::*;
use proto::data::{Candidate, Winner};

use super::*;
use crate::sampler::{TokenHistory, sample_row};
use step::Penalties;

mod constrained;
mod filtered_bounds;

/// What a card holding `tokens` of `logits` proposes with `k` candidates, as the card does
/// (`corsair-ffn`'s LM-head shard).
fn propose(
    logits: &[f32],
    tokens: std::ops::Range<usize>,
    k: usize,
    request: &SampleRequest,
    position: u64,
) -> Proposal {
    let params = &request.params;
    let slice = &logits[tokens.clone()];
    let mut order: Vec<usize> = tokens.clone().collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    let mut winner = (f64::NEG_INFINITY, u32::MAX, 0f32);
    let sampled = !params.is_greedy();
    if sampled {
        for t in tokens.clone() {
            let s = sampling::gumbel_score(logits[t], params, position, t as u32);
            if s > winner.0 {
                winner = (s, t as u32, logits[t]);
            }
        }
    }
    let scaled: Vec<f32> = slice.iter().map(|l| l / params.temperature).collect();
    Proposal {
        // Cards skip the log-sum-exps a row does not use.
        log_sum_exp: request
            .wants_logprobs()
            .then(|| sampling::log_sum_exp(slice)),
        scaled_log_sum_exp: sampled.then(|| sampling::log_sum_exp(&scaled)),
        winner: sampled.then_some(Winner {
            token: winner.1,
            logit: winner.2,
            score: winner.0,
        }),
        shard_rows: slice.len() as u32,
        candidates: order
            .iter()
            .take(k)
            .map(|&t| Candidate {
                logit: logits[t],
                token: t as u32,
            })
            .collect(),
        target_logit: None,
    }
}

/// Every card's proposal for a vocabulary split evenly over `cards`, card `c` returning
/// `k(c)` candidates.
fn proposals_with(
    logits: &[f32],
    cards: usize,
    k: impl Fn(usize) -> usize,
    request: &SampleRequest,
    position: u64,
) -> Vec<Proposal> {
    let per = logits.len().div_ceil(cards);
    (0..cards)
        .map(|c| {
            (
                c,
                (c * per).min(logits.len())..((c + 1) * per).min(logits.len()),
            )
        })
        .filter(|(_, r)| !r.is_empty())
        .map(|(c, r)| propose(logits, r, k(c), request, position))
        .collect()
}

/// Every card's proposal with `k` candidates each.
fn proposals(
    logits: &[f32],
    cards: usize,
    k: usize,
    request: &SampleRequest,
    position: u64,
) -> Vec<Proposal> {
    proposals_with(logits, cards, |_| k, request, position)
}

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A uniform draw in [0, 1).
fn unit(state: &mut u64) -> f32 {
    (splitmix(state) >> 40) as f32 / (1u64 << 24) as f32
}

/// Logits of one of three shapes: spread evenly (`0`), on a coarse grid so that ties are
/// common (`1`), or peaked: a few tokens far above a noisy tail, as language models' are (`2`).
fn logits(vocab: usize, shape: u8, seed: u64) -> Vec<f32> {
    let mut s = seed;
    match shape {
        0 => (0..vocab).map(|_| unit(&mut s) * 16.0 - 8.0).collect(),
        1 => (0..vocab)
            .map(|_| (splitmix(&mut s) % 200) as f32 / 20.0)
            .collect(),
        _ => {
            let mut l: Vec<f32> = (0..vocab).map(|_| unit(&mut s) * 4.0 - 2.0).collect();
            for _ in 0..1 + splitmix(&mut s) % 4 {
                let at = (splitmix(&mut s) % vocab as u64) as usize;
                l[at] += 14.0 + 3.0 * unit(&mut s);
            }
            l
        }
    }
}

/// Whether the candidates visibly hold what a filtered draw depends on, with room to spare:
/// worked out from the full logits, the way the reference filters. The tokens the draw keeps
/// (or, when top-p renormalizes by a filtered set's mass, that whole set), and the token after
/// them, are candidates ranked above every cut-short card's last candidate; no probability
/// is within 1e-6 of the min-p floor and no running share within 1e-6 of top-p.
fn visibly_decidable(logits: &[f32], params: &SamplingParams, proposals: &[Proposal]) -> bool {
    if params.is_greedy() || !params.has_filters() {
        return true;
    }
    let t = params.temperature;
    let scaled: Vec<f32> = logits.iter().map(|l| l / t).collect();
    let lse = sampling::log_sum_exp(&scaled);
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| scaled[b].total_cmp(&scaled[a]).then(a.cmp(&b)));
    let prob: Vec<f64> = order
        .iter()
        .map(|&i| (scaled[i] as f64 - lse).exp())
        .collect();
    let floor = params.min_p as f64 * prob[0];
    let mut filtered = if params.min_p > 0.0 {
        prob.iter().filter(|&&p| p >= floor).count()
    } else {
        logits.len()
    };
    if params.top_k > 0 {
        filtered = filtered.min(params.top_k);
    }
    let allowed = sampling::allowed_tokens(logits, params).len();
    let whole = params.min_p == 0.0 && (params.top_k == 0 || params.top_k >= logits.len());
    let needed = if params.top_p < 1.0 && !whole {
        filtered
    } else {
        allowed
    };
    let seen = (needed + 1).min(logits.len());
    let cuts: Vec<f32> = proposals
        .iter()
        .filter(|p| p.candidates.len() < p.shard_rows as usize)
        .filter_map(|p| p.candidates.last().map(|c| c.logit / t))
        .collect();
    let candidate = |token: usize| {
        proposals
            .iter()
            .any(|p| p.candidates.iter().any(|c| c.token as usize == token))
    };
    let visible = order[..seen]
        .iter()
        .all(|&i| candidate(i) && cuts.iter().all(|&u| scaled[i] > u));
    let clear_of_floor = params.min_p == 0.0
        || prob[..seen]
            .iter()
            .all(|&p| (p - floor).abs() > 1e-6 * floor);
    let mass: f64 = prob[..filtered].iter().sum();
    let mut share = 0.0;
    let clear_of_top_p = params.top_p >= 1.0
        || prob[..seen.min(filtered)].iter().all(|p| {
            share += p;
            (share / mass - params.top_p as f64).abs() > 1e-6
        });
    visible && clear_of_floor && clear_of_top_p
}

fn request(params: SamplingParams, logprobs: bool, top_logprobs: usize) -> SampleRequest {
    SampleRequest {
        params,
        penalties: Penalties::default(),
        logprobs,
        top_logprobs,
        allowed: None,
    }
}

/// The merge of `logits` over `cards` with the candidates the row asks for (at most `cap`).
fn merge(
    logits: &[f32],
    cards: usize,
    cap: usize,
    request: &SampleRequest,
    position: u64,
) -> (MergeOutcome, Vec<Proposal>) {
    let k = candidates_needed(request, cap);
    assert!(k <= cap.max(request.top_logprobs));
    let p = proposals(logits, cards, k, request, position);
    (merge_row(&p, request, position, k), p)
}

#[track_caller]
fn assert_same_as_full_logits(
    m: &MergedToken,
    logits: &[f32],
    request: &SampleRequest,
    position: u64,
) {
    let full = sample_row(0, logits, request, &TokenHistory::default(), position).unwrap();
    assert_eq!(m.token, full.token, "token");
    if request.wants_logprobs() {
        assert!(
            (m.logprob - full.logprob).abs() < 1e-5,
            "{} vs {}",
            m.logprob,
            full.logprob
        );
    } else {
        assert!(m.logprob.is_nan());
    }
    assert_eq!(m.top_logprobs.len(), full.top_logprobs.len());
    for (a, b) in m.top_logprobs.iter().zip(&full.top_logprobs) {
        assert_eq!(a.0, b.0);
        assert!((a.1 - b.1).abs() < 1e-5);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Any logits, temperature, top-k, top-p, min-p, card count, candidate count and seed: a
    /// merged token is the full-logits sampler's token (its logprob up to the rounding of the
    /// log-sum-exp), and the merge gathers only when the candidates do not visibly decide.
    #[test]
    fn merge_equals_full_logits_sampling(
        vocab in 1usize..160, shape in 0u8..3, seed in any::<u64>(), cards in 1usize..6,
        temperature in prop_oneof![Just(0.0f32), Just(1.0f32), 0.2f32..2.5],
        top_k in prop_oneof![Just(0usize), 1usize..12],
        top_p in prop_oneof![Just(1.0f32), 0.05f32..1.0],
        min_p in prop_oneof![Just(0.0f32), 0.0f32..1.0, Just(1.0f32)],
        top_logprobs in 0usize..4, logprobs in any::<bool>(), position in 0u64..1000,
        cap in 1usize..40, uneven in any::<bool>(),
    ) {
        let logits = logits(vocab, shape, seed);
        let params = SamplingParams { temperature, top_k, top_p, min_p, seed };
        let request = request(params, logprobs, top_logprobs);
        let (mut outcome, mut proposals) = merge(&logits, cards, cap.max(top_logprobs), &request, position);
        if uneven {
            // Cards returning different numbers of candidates, at least the top logprobs (the
            // merge must not assume equal lists).
            let k = candidates_needed(&request, cap.max(top_logprobs));
            let k_card = |c: usize| (1 + (seed >> (c * 7)) as usize % k).max(top_logprobs);
            proposals = proposals_with(&logits, cards, k_card, &request, position);
            outcome = merge_row(&proposals, &request, position, k);
        }
        if !params.is_greedy() && params.has_filters()
            && let Some(allowed) = filtered::allowed(&proposals, &params)
        {
            let tokens: Vec<u32> = allowed.iter().map(|a| a.0).collect();
            prop_assert_eq!(tokens, sampling::allowed_tokens(&logits, &params), "the allowed set");
        }
        match outcome {
            MergeOutcome::Done(m) => assert_same_as_full_logits(&m, &logits, &request, position),
            MergeOutcome::NeedFullLogits => prop_assert!(
                !visibly_decidable(&logits, &params, &proposals),
                "gathered a row the candidates decide"
            ),
        }
    }
}

#[test]
fn peaked_nucleus_rows_are_decided_from_the_candidates() {
    // What a language model's next-token distribution looks like: a few likely tokens over a
    // long tail. With the default 64 candidates a card, nucleus and min-p rows never gather.
    let settings = [
        (1.0, 0.9, 0.0, 0),
        (0.7, 0.9, 0.0, 0),
        (1.0, 0.95, 0.0, 50),
        (0.8, 1.0, 0.05, 0),
        (1.0, 0.9, 0.02, 40),
    ];
    for (temperature, top_p, min_p, top_k) in settings {
        for seed in 0..40u64 {
            let logits = logits(32_000, 2, seed);
            let params = SamplingParams {
                temperature,
                top_p,
                min_p,
                top_k,
                seed,
            };
            let request = request(params, seed % 2 == 0, 2);
            let (outcome, _) = merge(&logits, 4, 64, &request, seed * 7);
            let MergeOutcome::Done(m) = outcome else {
                panic!(
                    "T {temperature} top-p {top_p} min-p {min_p} top-k {top_k} seed {seed} gathered"
                );
            };
            assert_same_as_full_logits(&m, &logits, &request, seed * 7);
        }
    }
}

#[test]
fn a_flat_nucleus_wider_than_the_candidates_gathers() {
    // Evenly spread logits: the 0.9 nucleus holds most of the 4000 tokens, far more than 64 a
    // card, and so does the 0.5 min-p set.
    let logits = logits(4000, 0, 3);
    for (top_p, min_p) in [(0.9, 0.0), (1.0, 0.001)] {
        let params = SamplingParams {
            temperature: 1.0,
            top_p,
            min_p,
            seed: 1,
            ..Default::default()
        };
        let (outcome, _) = merge(&logits, 4, 64, &request(params, false, 0), 0);
        assert_eq!(
            outcome,
            MergeOutcome::NeedFullLogits,
            "top-p {top_p} min-p {min_p}"
        );
    }
}

#[test]
fn greedy_rows_ignore_the_filters_and_top_k_asks_one_more() {
    let greedy = request(
        SamplingParams {
            top_p: 0.5,
            min_p: 0.2,
            top_k: 3,
            ..Default::default()
        },
        false,
        0,
    );
    assert_eq!(candidates_needed(&greedy, 64), 1);
    let top_k = |k| {
        request(
            SamplingParams {
                temperature: 0.7,
                top_k: k,
                ..Default::default()
            },
            false,
            0,
        )
    };
    assert_eq!(candidates_needed(&top_k(5), 64), 6);
    assert_eq!(candidates_needed(&top_k(64), 64), 64);
    let nucleus = request(
        SamplingParams {
            temperature: 1.0,
            top_p: 0.9,
            ..Default::default()
        },
        false,
        3,
    );
    assert_eq!(candidates_needed(&nucleus, 64), 64);
}

#[test]
fn penalties_and_many_logprobs_ask_for_full_logits() {
    let base = request(
        SamplingParams {
            temperature: 1.0,
            ..Default::default()
        },
        false,
        0,
    );
    let logits = logits(50, 0, 1);
    let p = proposals(&logits, 2, 8, &base, 0);
    let pen = SampleRequest {
        penalties: Penalties {
            presence: 0.5,
            ..Default::default()
        },
        ..base.clone()
    };
    assert_eq!(merge_row(&p, &pen, 0, 8), MergeOutcome::NeedFullLogits);
    assert_eq!(candidates_needed(&pen, 8), 1);
    let many = SampleRequest {
        top_logprobs: 9,
        ..base.clone()
    };
    assert_eq!(merge_row(&p, &many, 0, 8), MergeOutcome::NeedFullLogits);
    assert!(matches!(merge_row(&p, &base, 0, 8), MergeOutcome::Done(_)));
}

#[test]
fn a_tie_across_a_cards_cut_is_not_decided_blindly() {
    // Card 0 holds tokens 0..4 and returns two (0 and 1), card 1 holds 4..8 and returns 4 and
    // 5; tokens 1, 2, 4 and 5 tie at 2.0. With top-k 2 the reference keeps 0 and 1 (lowest ids
    // of a tie first): nothing card 0 left out can come before token 1 (an unseen 2.0 has a
    // higher id), so the merge decides. With top-k 3 the third is token 2, which card 0 did not
    // return: the merge cannot know it and gathers.
    let logits = [3.0f32, 2.0, 2.0, 0.0, 2.0, 2.0, 1.0, 0.0];
    let params = SamplingParams {
        temperature: 1.0,
        top_k: 2,
        seed: 5,
        ..Default::default()
    };
    let r = request(params, false, 0);
    let p = proposals(&logits, 2, 2, &r, 3);
    let MergeOutcome::Done(m) = merge_row(&p, &r, 3, 2) else {
        panic!("gathered");
    };
    assert_same_as_full_logits(&m, &logits, &r, 3);
    let r3 = request(SamplingParams { top_k: 3, ..params }, false, 0);
    let p = proposals(&logits, 2, 2, &r3, 3);
    assert_eq!(merge_row(&p, &r3, 3, 2), MergeOutcome::NeedFullLogits);
}

#[test]
fn a_lower_logit_scaling_to_the_same_value_is_not_overlooked() {
    // At temperature 0.75 some logit and the float just below it scale to the same value:
    // a token of the lower logit and a lower id, left out by its card, then ranks before the
    // card's last candidate in the reference's order.
    let t = 0.75f32;
    let high = (0..1_000_000u32)
        .map(|i| f32::from_bits(1.5f32.to_bits() + i))
        .find(|l| l.next_down() / t == l / t)
        .expect("two logits that scale to one value");
    let logits = [5.0, high.next_down(), high, -5.0];
    let params = SamplingParams {
        temperature: t,
        top_k: 2,
        seed: 1,
        ..Default::default()
    };
    let r = request(params, false, 0);
    let p = proposals(&logits, 1, 2, &r, 0);
    let returned: Vec<u32> = p[0].candidates.iter().map(|c| c.token).collect();
    assert_eq!(returned, vec![0, 2]);
    assert_eq!(sampling::allowed_tokens(&logits, &params), vec![0, 1]);
    assert_eq!(filtered::allowed(&p, &params), None);
    assert_eq!(merge_row(&p, &r, 0, 2), MergeOutcome::NeedFullLogits);
    // Every token returned: decided, and right.
    let p = proposals(&logits, 1, 4, &r, 0);
    let MergeOutcome::Done(m) = merge_row(&p, &r, 0, 4) else {
        panic!("gathered a complete list");
    };
    assert_same_as_full_logits(&m, &logits, &r, 0);
}

#[test]
fn decisions_within_rounding_of_their_threshold_gather() {
    // Complete lists, so only the thresholds are in question. Min-p 1 with two equal best
    // logits: the second sits exactly on the floor.
    let logits = [0.0f32, -9.0, 0.0, -9.0];
    let min_p = SamplingParams {
        temperature: 1.0,
        min_p: 1.0,
        seed: 2,
        ..Default::default()
    };
    let r = request(min_p, false, 0);
    let p = proposals(&logits, 2, 2, &r, 0);
    assert_eq!(merge_row(&p, &r, 0, 2), MergeOutcome::NeedFullLogits);
    // Top-p 0.5 over two equal logits: the first one's share is 0.5 up to rounding.
    let logits = [1.0f32, 1.0];
    let top_p = SamplingParams {
        temperature: 1.0,
        top_p: 0.5,
        seed: 2,
        ..Default::default()
    };
    let r = request(top_p, false, 0);
    let p = proposals(&logits, 2, 1, &r, 0);
    assert_eq!(merge_row(&p, &r, 0, 1), MergeOutcome::NeedFullLogits);
    // Away from the thresholds both decide.
    for params in [
        SamplingParams {
            min_p: 0.9,
            ..min_p
        },
        SamplingParams {
            top_p: 0.4,
            ..top_p
        },
    ] {
        let r = request(params, false, 0);
        let logits = [0.0f32, -9.0, 0.0, -9.0];
        let p = proposals(&logits, 2, 2, &r, 0);
        let MergeOutcome::Done(m) = merge_row(&p, &r, 0, 2) else {
            panic!("{params:?} gathered");
        };
        assert_same_as_full_logits(&m, &logits, &r, 0);
    }
}

/// A card without a winner (or whose Gumbel score is NaN) drew nothing: another card's winner
/// is the draw, and with no card drawing the row gathers instead of answering a made-up token.
#[test]
fn a_sampled_row_without_any_draw_gathers() {
    let logits = [1.0f32, 0.5, 2.0, -1.0, 0.25, 1.5];
    let params = SamplingParams {
        temperature: 0.8,
        top_p: 1.0,
        top_k: 0,
        min_p: 0.0,
        seed: 3,
    };
    let r = request(params, false, 0);
    let mut p = proposals(&logits, 2, 1, &r, 4);
    p[0].winner = None;
    let MergeOutcome::Done(m) = merge_row(&p, &r, 4, 1) else {
        panic!("one card drew: decided");
    };
    assert_eq!(Some(m.token), p[1].winner.map(|w| w.token));
    if let Some(w) = p[1].winner.as_mut() {
        w.score = f64::NAN;
    }
    assert_eq!(
        merge_row(&p, &r, 4, 1),
        MergeOutcome::NeedFullLogits,
        "a NaN score"
    );
    p[1].winner = None;
    assert_eq!(
        merge_row(&p, &r, 4, 1),
        MergeOutcome::NeedFullLogits,
        "no winner"
    );
}

/// How many candidates a row asks each card for: one for greedy and for unfiltered sampling
/// (the Gumbel winners decide), top-k + 1 for top-k alone, the cap for top-p or min-p, at
/// least the row's top logprobs; one where the row gathers anyway.
#[test]
fn candidates_needed_follow_what_decides_the_row() {
    let cap = 64;
    let with = |params: SamplingParams, top| request(params, false, top);
    let sampled = SamplingParams {
        temperature: 0.7,
        top_p: 1.0,
        top_k: 0,
        min_p: 0.0,
        seed: 1,
    };
    assert_eq!(
        candidates_needed(&with(SamplingParams::greedy(), 0), cap),
        1
    );
    assert_eq!(
        candidates_needed(&with(sampled, 0), cap),
        1,
        "unfiltered: the winners"
    );
    assert_eq!(
        candidates_needed(&with(sampled, 5), cap),
        5,
        "its top logprobs"
    );
    let top_k = SamplingParams {
        top_k: 3,
        ..sampled
    };
    assert_eq!(candidates_needed(&with(top_k, 0), cap), 4);
    let min_p = SamplingParams {
        min_p: 0.1,
        ..sampled
    };
    assert_eq!(candidates_needed(&with(min_p, 0), cap), cap);
    let top_p = SamplingParams {
        top_p: 0.9,
        ..sampled
    };
    assert_eq!(candidates_needed(&with(top_p, 0), cap), cap);
    assert_eq!(
        candidates_needed(&with(sampled, cap + 1), cap),
        1,
        "gathers: one"
    );
}

/// Logits far from zero (800 and up, where `exp` overflows f64) decide as they do near it: the
/// filtered draw works relative to the scaled log-sum-exp, which keeps every term finite.
#[test]
fn filtered_rows_of_huge_logits_decide_as_the_full_logits_do() {
    let mut decided = 0;
    for seed in 0..64u64 {
        let near: Vec<f32> = logits(40, 2, seed);
        let far: Vec<f32> = near.iter().map(|l| l + 800.0).collect();
        let params = SamplingParams {
            temperature: 0.9,
            top_k: 0,
            top_p: 0.8,
            min_p: 0.0,
            seed,
        };
        let r = request(params, false, 0);
        let (outcome, _) = merge(&far, 3, 32, &r, seed);
        if let MergeOutcome::Done(m) = outcome {
            assert_same_as_full_logits(&m, &far, &r, seed);
            decided += 1;
        }
    }
    assert!(decided >= 32, "most peaked rows decide: {decided} of 64");
}

/// A card whose scaled log-sum-exp is not finite (or absent) leaves a filtered row unproved:
/// it gathers, even when every candidate's logit is finite.
#[test]
fn a_filtered_row_with_a_card_of_unusable_mass_gathers() {
    let logits = logits(40, 2, 11);
    let params = SamplingParams {
        temperature: 0.9,
        top_k: 0,
        top_p: 0.8,
        min_p: 0.0,
        seed: 11,
    };
    let r = request(params, false, 0);
    let (outcome, mut p) = merge(&logits, 3, 32, &r, 5);
    assert!(matches!(outcome, MergeOutcome::Done(_)), "decided as it is");
    p[1].scaled_log_sum_exp = Some(f64::INFINITY);
    assert_eq!(merge_row(&p, &r, 5, 32), MergeOutcome::NeedFullLogits);
    p[1].scaled_log_sum_exp = None;
    assert_eq!(merge_row(&p, &r, 5, 32), MergeOutcome::NeedFullLogits);
}
