//! Token selection: greedy, and seeded sampling by the Gumbel-max trick with a counter-based
//! generator, so that a sample depends only on (seed, position, token id) and the logits,
//! never on how the vocabulary is split across cards or on what else is in the batch.
//!
//! Filtering (applied to `softmax(logits / temperature)`): `min_p` drops tokens whose
//! probability is below `min_p` times the largest; `top_k` keeps the k most probable of the
//! rest; `top_p` keeps the smallest most-probable prefix of those whose renormalized mass
//! reaches `top_p`. The winner is `argmax(logit / T + gumbel(seed, position, token))` over what
//! is left, which is an exact draw from the filtered, renormalized distribution.
//!
//! A temperature below [`GREEDY_BELOW`] (vLLM's threshold, 1e-5) decodes greedily: dividing
//! logits by a tinier one overflows them to infinity in f32 (a subnormal such as 1e-40 would
//! make every token tie), and the scaled logits would be so far apart that the noise could not
//! change the winner anyway.

/// How to pick the next token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0 (or anything below [`GREEDY_BELOW`]) means greedy.
    pub temperature: f32,
    /// Nucleus mass in (0, 1]; 1 disables.
    pub top_p: f32,
    /// Keep this many most probable tokens; 0 disables.
    pub top_k: usize,
    /// Relative probability floor in [0, 1]; 0 disables.
    pub min_p: f32,
    /// Seed of the Gumbel noise.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        Self::default()
    }

    /// Whether this is greedy decoding: a temperature below [`GREEDY_BELOW`] (NaN too), which
    /// every path that divides by the temperature treats as 0.
    pub fn is_greedy(&self) -> bool {
        self.temperature.is_nan() || self.temperature < GREEDY_BELOW
    }

    /// Whether any filter (top-k, top-p, min-p) is active.
    pub fn has_filters(&self) -> bool {
        self.top_k > 0 || self.top_p < 1.0 || self.min_p > 0.0
    }
}

/// Temperatures below this decode greedily (vLLM's `_SAMPLING_EPS`): `logit / temperature`
/// stays finite for any f32 logit up to 3e33 above it, and overflows for subnormal ones.
pub const GREEDY_BELOW: f32 = 1e-5;

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E3779B97F4A7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
    z ^ (z >> 31)
}

/// The uniform draw in (0, 1) (never 0 or 1) behind the noise of (seed, position, token),
/// from a counter-based hash.
fn uniform(seed: u64, position: u64, token: u32) -> f64 {
    let h = splitmix64(splitmix64(splitmix64(seed) ^ position) ^ token as u64);
    ((h >> 11) as f64 + 0.5) / (1u64 << 53) as f64
}

/// Standard Gumbel noise for (seed, position, token).
pub fn gumbel(seed: u64, position: u64, token: u32) -> f64 {
    -(-uniform(seed, position, token).ln()).ln()
}

/// The token with the best [`gumbel_score`] among `logits` (token ids `first_token..`),
/// lowest id on ties: its index in `logits` and its score. `None` for no logits.
///
/// Exactly the scan over every token, at a fraction of its cost: the largest logit's score is
/// computed first, then a token is skipped when even an upper bound of its noise cannot reach
/// the best score. With `u` the uniform behind the noise, `-ln(-ln u) <= u / (1 - u)` (from
/// `ln y <= y - 1` applied twice), a division instead of two logarithms.
pub fn gumbel_winner(
    logits: &[f32],
    params: &SamplingParams,
    position: u64,
    first_token: u32,
) -> Option<(usize, f64)> {
    if logits.is_empty() {
        return None;
    }
    let score = |i: usize| gumbel_score(logits[i], params, position, first_token + i as u32);
    let top = argmax(logits) as usize;
    let mut best = (top, score(top));
    for (i, &l) in logits.iter().enumerate() {
        let u = uniform(params.seed, position, first_token + i as u32);
        // The margin covers rounding in the bound; it only makes the skip more cautious.
        if (l / params.temperature) as f64 + u / (1.0 - u) + 1e-9 < best.1 || i == top {
            continue;
        }
        let s = score(i);
        if s > best.1 || (s == best.1 && i < best.0) {
            best = (i, s);
        }
    }
    Some(best)
}

/// The Gumbel-max score of a token: its temperature-scaled logit plus its noise.
pub fn gumbel_score(logit: f32, params: &SamplingParams, position: u64, token: u32) -> f64 {
    (logit / params.temperature) as f64 + gumbel(params.seed, position, token)
}

/// Index of the largest logit, lowest index on ties.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Natural-log probabilities of `logits` (f64 accumulation).
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    log_probs(logits, log_sum_exp(logits))
}

/// [`log_softmax`] of a row whose [`log_sum_exp`] is `lse`.
pub fn log_probs(logits: &[f32], lse: f64) -> Vec<f32> {
    logits.iter().map(|&l| log_prob(l, lse)).collect()
}

/// One element of [`log_softmax`]: the log-probability of `logit` in a row whose
/// [`log_sum_exp`] is `lse`, without the rest of the row.
pub fn log_prob(logit: f32, lse: f64) -> f32 {
    (logit as f64 - lse) as f32
}

/// `ln(sum(exp(logits)))` in f64.
pub fn log_sum_exp(logits: &[f32]) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
    max + sum.ln()
}

/// The tokens allowed by the filters, most probable first (all tokens when none is active).
pub fn allowed_tokens(logits: &[f32], params: &SamplingParams) -> Vec<u32> {
    let t = params.temperature.max(GREEDY_BELOW);
    let scaled: Vec<f32> = logits.iter().map(|&l| l / t).collect();
    let lse = log_sum_exp(&scaled);
    let mut order: Vec<u32> = (0..logits.len() as u32).collect();
    order.sort_by(|&a, &b| {
        scaled[b as usize]
            .total_cmp(&scaled[a as usize])
            .then(a.cmp(&b))
    });
    let prob = |i: u32| (scaled[i as usize] as f64 - lse).exp();
    let p_max = prob(order[0]);
    if params.min_p > 0.0 {
        order.retain(|&i| prob(i) >= params.min_p as f64 * p_max);
    }
    if params.top_k > 0 {
        order.truncate(params.top_k);
    }
    if params.top_p < 1.0 {
        let mass: f64 = order.iter().map(|&i| prob(i)).sum();
        let mut acc = 0.0;
        let mut keep = 0;
        for &i in &order {
            acc += prob(i) / mass;
            keep += 1;
            if acc >= params.top_p as f64 {
                break;
            }
        }
        order.truncate(keep.max(1));
    }
    order
}

/// Picks the next token for the token at `position` (its index in the sequence).
pub fn sample(logits: &[f32], params: &SamplingParams, position: u64) -> u32 {
    if params.is_greedy() {
        return argmax(logits);
    }
    if !params.has_filters() {
        return gumbel_winner(logits, params, position, 0).map_or(0, |(i, _)| i as u32);
    }
    let candidates = allowed_tokens(logits, params);
    let mut best = candidates[0];
    let mut best_score = f64::NEG_INFINITY;
    for &tok in &candidates {
        let s = gumbel_score(logits[tok as usize], params, position, tok);
        if s > best_score || (s == best_score && tok < best) {
            best = tok;
            best_score = s;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plain scan `gumbel_winner` must equal: every token scored, lowest id on ties.
    fn scan(logits: &[f32], params: &SamplingParams, position: u64, first: u32) -> (usize, f64) {
        let mut best = (0, f64::NEG_INFINITY);
        for (i, &l) in logits.iter().enumerate() {
            let s = gumbel_score(l, params, position, first + i as u32);
            if s > best.1 {
                best = (i, s);
            }
        }
        best
    }

    proptest::proptest! {
        #[test]
        fn gumbel_winner_equals_the_full_scan(
            logits in proptest::collection::vec(-30f32..30.0, 1..300),
            temperature in 0.05f32..4.0,
            seed in 0u64..1000,
            position in 0u64..100,
            first in 0u32..1000,
        ) {
            let params = SamplingParams { temperature, seed, ..SamplingParams::default() };
            let got = gumbel_winner(&logits, &params, position, first).unwrap();
            proptest::prop_assert_eq!(got, scan(&logits, &params, position, first));
        }
    }

    #[test]
    fn gumbel_winner_on_flat_logits_equals_the_scan() {
        // Equal logits: the noise alone decides, and the bound prunes least.
        let logits = vec![1.0f32; 50];
        for seed in 0..20 {
            let params = SamplingParams {
                temperature: 1.0,
                seed,
                ..SamplingParams::default()
            };
            assert_eq!(
                gumbel_winner(&logits, &params, 3, 0).unwrap(),
                scan(&logits, &params, 3, 0)
            );
        }
        assert!(gumbel_winner(&[], &SamplingParams::default(), 0, 0).is_none());
    }

    #[test]
    fn temperatures_too_small_to_divide_by_decode_greedily() {
        // Token 0 is the worst: were the logits divided by a subnormal, all would overflow to
        // +-inf and the first of the tied infinities (token 0 or 1) would win.
        let logits = [-1.0f32, 0.5, 3.0, 2.5];
        for temperature in [
            0.0,
            1e-45,
            1e-40,
            1e-38,
            f32::MIN_POSITIVE,
            1e-30,
            9.9e-6,
            f32::NAN,
        ] {
            let params = SamplingParams {
                temperature,
                top_k: 3,
                seed: 11,
                ..Default::default()
            };
            assert!(params.is_greedy(), "{temperature}");
            for position in 0..20 {
                assert_eq!(sample(&logits, &params, position), 2, "{temperature}");
                let no_filters = SamplingParams { top_k: 0, ..params };
                assert_eq!(sample(&logits, &no_filters, position), 2, "{temperature}");
            }
        }
        // From the threshold on, the scaled logits are finite and sampling is sampling.
        let params = SamplingParams {
            temperature: GREEDY_BELOW,
            seed: 11,
            ..Default::default()
        };
        assert!(!params.is_greedy());
        assert!(logits.iter().all(|&l| (l / params.temperature).is_finite()));
        assert_eq!(sample(&logits, &params, 0), 2);
    }

    #[test]
    fn greedy_takes_the_first_maximum() {
        assert_eq!(
            sample(&[0.0, 2.0, 2.0, 1.0], &SamplingParams::greedy(), 0),
            1
        );
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_follows_the_distribution() {
        let logits = [0.0f32, (3.0f32).ln(), f32::NEG_INFINITY];
        let params = |seed| SamplingParams {
            temperature: 1.0,
            seed,
            ..Default::default()
        };
        assert_eq!(
            sample(&logits, &params(7), 5),
            sample(&logits, &params(7), 5)
        );
        let mut counts = [0usize; 3];
        for seed in 0..4000 {
            counts[sample(&logits, &params(seed), 0) as usize] += 1;
        }
        // Token 1 has probability 3/4, token 2 none.
        assert_eq!(counts[2], 0);
        let frac = counts[1] as f64 / 4000.0;
        assert!((frac - 0.75).abs() < 0.03, "{frac}");
    }

    #[test]
    fn filters() {
        let logits = [4.0f32, 3.0, 2.0, 1.0, 0.0];
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 2,
            ..Default::default()
        };
        assert_eq!(allowed_tokens(&logits, &p), vec![0, 1]);
        let p = SamplingParams {
            temperature: 1.0,
            top_p: 0.5,
            ..Default::default()
        };
        assert_eq!(allowed_tokens(&logits, &p), vec![0]);
        let p = SamplingParams {
            temperature: 1.0,
            min_p: 0.3,
            ..Default::default()
        };
        // exp(-1) = 0.37 >= 0.3, exp(-2) = 0.14 < 0.3.
        assert_eq!(allowed_tokens(&logits, &p), vec![0, 1]);
    }

    #[test]
    fn log_softmax_normalizes() {
        let lp = log_softmax(&[1.0, 2.0, 3.0]);
        let total: f64 = lp.iter().map(|&l| (l as f64).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6);
    }
}
