//! The filtered set ([`filtered::allowed`]) where what it depends on lies past the candidates:
//! a top-k set longer than the known prefix (its mass bounded by the unseen tokens), and
//! decisions within rounding of their threshold on a vocabulary large enough for the margin
//! to matter.

use super::*;
use crate::merge::filtered::allowed;

fn sampled(top_k: usize, top_p: f32, min_p: f32) -> SampleRequest {
    request(
        SamplingParams {
            temperature: 1.0,
            top_k,
            top_p,
            min_p,
            seed: 3,
        },
        false,
        0,
    )
}

/// Card 0's tokens: one likely, one less, then six just below it that it does not return
/// (real mass the merge only bounds); card 1's are all unlikely.
fn plateau() -> Vec<f32> {
    let mut logits = vec![5.0, 4.0, 3.9, 3.9, 3.9, 3.9, 3.9, 3.9];
    logits.extend([-20.0; 8]);
    logits
}

#[test]
fn a_top_k_set_past_the_candidates_is_bounded_by_the_unseen_mass() {
    let logits = plateau();
    // Top-k 4 keeps tokens 0..4: token 0 holds 0.492 of their mass. The merge sees tokens 0
    // and 1 and bounds the other two by token 1's probability each: token 0's share is at
    // least 0.475 and at most 0.73.
    for (top_p, want) in [(0.45, Some(vec![0u32])), (0.5, None), (0.8, None)] {
        let request = sampled(4, top_p, 0.0);
        let p = proposals(&logits, 2, 2, &request, 0);
        let got = allowed(&p, &request.params).map(|a| a.into_iter().map(|(t, _)| t).collect());
        assert_eq!(got, want, "top-p {top_p}");
        if let Some(set) = &got {
            assert_eq!(set, &sampling::allowed_tokens(&logits, &request.params));
        }
    }
    // Whenever the merge decides on this shape, it is the reference's set.
    for top_k in 3..12 {
        for top_p in [0.3f32, 0.45, 0.49, 0.6, 0.75, 0.9, 0.99] {
            let request = sampled(top_k, top_p, 0.0);
            let p = proposals(&logits, 2, 2, &request, 0);
            if let Some(set) = allowed(&p, &request.params) {
                let set: Vec<u32> = set.into_iter().map(|(t, _)| t).collect();
                assert_eq!(
                    set,
                    sampling::allowed_tokens(&logits, &request.params),
                    "top-k {top_k} top-p {top_p}"
                );
            }
        }
    }
}

/// One shard of `rows` tokens whose candidates are `logits` (ids 0..), its log-sum-exp over
/// those alone (the other tokens' mass is negligible at these logits).
fn huge_shard(logits: &[f32], rows: u32) -> Proposal {
    Proposal {
        log_sum_exp: None,
        scaled_log_sum_exp: Some(sampling::log_sum_exp(logits)),
        winner: Some(Winner {
            token: 0,
            logit: logits[0],
            score: 0.0,
        }),
        shard_rows: rows,
        candidates: logits
            .iter()
            .enumerate()
            .map(|(t, &logit)| Candidate {
                logit,
                token: t as u32,
            })
            .collect(),
        target_logit: None,
    }
}

/// 40 M tokens: the rounding margin is then about 1.4e-7 of a probability, wider than the gap
/// between the largest f32 top-p below 1 and 1.
const HUGE: u32 = 40_000_000;

#[test]
fn a_top_p_just_below_one_keeps_the_whole_top_k_set() {
    // Top-k 2 within the known prefix: the mass is known, and at its end the share is 1, which
    // the margin cannot tell from top-p = 1 - 1.2e-7; the set ends there anyway.
    let p = [huge_shard(&[10.0, 9.0, -60.0], HUGE)];
    let top_p = 0.999_999_9f32;
    let params = SamplingParams {
        temperature: 1.0,
        top_k: 2,
        top_p,
        min_p: 0.0,
        seed: 1,
    };
    let margin = crate::merge::filtered::rounding_margin(HUGE as usize);
    assert!(margin * top_p as f64 > 1.0 - top_p as f64, "{margin}");
    let got = allowed(&p, &params).map(|a| a.into_iter().map(|(t, _)| t).collect::<Vec<_>>());
    assert_eq!(got, Some(vec![0, 1]));
}

#[test]
fn a_min_p_boundary_within_rounding_gathers_and_one_beyond_it_decides() {
    // Token 1's probability over token 0's is min-p = 0.5 up to the f32 rounding of ln 0.5
    // (2e-8 relative), inside the margin: the reference's comparison could go either way.
    let close = 0.5f32.ln();
    let params = SamplingParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.5,
        seed: 1,
    };
    let p = [huge_shard(&[0.0, close, -60.0], HUGE)];
    assert_eq!(allowed(&p, &params), None, "a boundary within rounding");
    // 1e-5 below the floor: token 1 is out for certain, and min-p ends the set at token 0.
    let below = close - 1e-5;
    let p = [huge_shard(&[0.0, below, -60.0], HUGE)];
    let got = allowed(&p, &params).map(|a| a.into_iter().map(|(t, _)| t).collect::<Vec<_>>());
    assert_eq!(got, Some(vec![0]));
    // 1e-5 above it: token 1 is in, and the unseen rest (below token 2) is out.
    let above = close + 1e-5;
    let p = [huge_shard(&[0.0, above, -60.0], HUGE)];
    let got = allowed(&p, &params).map(|a| a.into_iter().map(|(t, _)| t).collect::<Vec<_>>());
    assert_eq!(got, Some(vec![0, 1]));
}
