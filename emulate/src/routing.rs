//! Where tokens go when the model's numerics do not run: routing generators for an emulation.
//!
//! Each picks a token's top-k experts of a layer, distinct, from a per-layer distribution over
//! the experts: equal weights (`uniform`), a Zipf law over a per-layer random ranking of the
//! experts (`zipf:S`: the expert ranked `r` (from 1) weighs `1 / r^S`), or the counts of a
//! recorded run (`trace:FILE`, [`crate::record`]). Draws come from a generator seeded by the
//! run's seed, so the same seed routes the same tokens the same way.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use crate::error::{Error, Result};
use crate::record::RoutingCounts;

/// Where an emulation's routing comes from (`--routing`).
#[derive(Debug, Clone, PartialEq)]
pub enum RoutingSource {
    /// The model runs on the prompts: its own top-k, tokens as served.
    Model,
    /// Every expert equally likely.
    Uniform,
    /// Zipf-skewed, with this exponent.
    Zipf(f64),
    /// The counts of a recorded run.
    Trace(PathBuf),
}

impl FromStr for RoutingSource {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let usage = "use model, uniform, zipf:S (S > 0, e.g. zipf:1.2) or trace:FILE";
        match s.split_once(':') {
            None if s == "model" => Ok(RoutingSource::Model),
            None if s == "uniform" => Ok(RoutingSource::Uniform),
            Some(("zipf", v)) => match v.parse::<f64>() {
                Ok(x) if x.is_finite() && x > 0.0 => Ok(RoutingSource::Zipf(x)),
                _ => Err(format!(
                    "`{s}`: the Zipf exponent must be a positive number; {usage}"
                )),
            },
            Some(("trace", path)) if !path.is_empty() => Ok(RoutingSource::Trace(path.into())),
            _ => Err(format!("unknown routing `{s}`: {usage}")),
        }
    }
}

impl fmt::Display for RoutingSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RoutingSource::Model => f.write_str("model"),
            RoutingSource::Uniform => f.write_str("uniform"),
            RoutingSource::Zipf(s) => write!(f, "zipf:{s}"),
            RoutingSource::Trace(p) => write!(f, "trace:{}", p.display()),
        }
    }
}

/// One layer's distribution over its experts: cumulative weights.
#[derive(Debug, Clone)]
struct LayerDistribution {
    cumulative: Vec<f64>,
    /// Experts with a weight above zero.
    possible: usize,
}

impl LayerDistribution {
    fn new(weights: &[f64]) -> Self {
        let mut total = 0.0;
        let cumulative = weights
            .iter()
            .map(|w| {
                total += w.max(0.0);
                total
            })
            .collect();
        LayerDistribution {
            cumulative,
            possible: weights.iter().filter(|w| **w > 0.0).count(),
        }
    }

    fn draw(&self, rng: &mut StdRng) -> u32 {
        let total = self.cumulative.last().copied().unwrap_or(0.0);
        let x = rng.random::<f64>() * total;
        self.cumulative
            .partition_point(|&c| c <= x)
            .min(self.cumulative.len() - 1) as u32
    }
}

/// Draws each token's top-k experts per layer.
#[derive(Debug, Clone)]
pub struct RoutingGenerator {
    top_k: usize,
    experts: usize,
    /// Per decoder layer: `None` for a dense layer.
    layers: Vec<Option<LayerDistribution>>,
    rng: StdRng,
}

impl RoutingGenerator {
    /// A generator for `source` (not [`RoutingSource::Model`]) over `moe_layers` (true for each
    /// MoE layer) of `experts` experts, `top_k` per token, seeded by `seed`. A trace must match
    /// the model's layers and experts.
    pub fn new(
        source: &RoutingSource,
        moe_layers: &[bool],
        experts: usize,
        top_k: usize,
        seed: u64,
    ) -> Result<Self> {
        if experts == 0 || top_k == 0 || top_k > experts {
            return Err(Error::Config(format!(
                "routing needs a MoE model: {experts} experts, top-{top_k}"
            )));
        }
        let mut rng = StdRng::seed_from_u64(seed ^ 0x0072_6f75_7469_6e67);
        let weights: Vec<Option<Vec<f64>>> = match source {
            RoutingSource::Model => {
                return Err(Error::Config(
                    "routing from the model runs the model; it has no generator".into(),
                ));
            }
            RoutingSource::Uniform => moe_layers
                .iter()
                .map(|&moe| moe.then(|| vec![1.0; experts]))
                .collect(),
            RoutingSource::Zipf(s) => moe_layers
                .iter()
                .map(|&moe| {
                    moe.then(|| {
                        let mut ranks: Vec<usize> = (0..experts).collect();
                        ranks.shuffle(&mut rng);
                        let mut w = vec![0.0; experts];
                        for (rank, &e) in ranks.iter().enumerate() {
                            w[e] = 1.0 / ((rank + 1) as f64).powf(*s);
                        }
                        w
                    })
                })
                .collect(),
            RoutingSource::Trace(path) => {
                let counts = RoutingCounts::read(path)?;
                counts.check_shape(moe_layers.len(), experts, path)?;
                moe_layers
                    .iter()
                    .enumerate()
                    .map(|(l, &moe)| {
                        moe.then(|| counts.totals(l).into_iter().map(|c| c as f64).collect())
                    })
                    .collect()
            }
        };
        let layers = weights
            .into_iter()
            .map(|w| {
                w.map(|w| {
                    let d = LayerDistribution::new(&w);
                    // Fewer possible experts than top-k (a trace with idle experts): every
                    // expert stays possible, so a token can still pick k distinct ones.
                    if d.possible < top_k {
                        let floor = w.iter().copied().fold(0.0, f64::max).max(1.0) * 1e-9;
                        LayerDistribution::new(&w.iter().map(|x| x.max(floor)).collect::<Vec<_>>())
                    } else {
                        d
                    }
                })
            })
            .collect();
        Ok(RoutingGenerator {
            top_k,
            experts,
            layers,
            rng,
        })
    }

    /// Experts per token.
    pub fn top_k(&self) -> usize {
        self.top_k
    }

    /// Decoder layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// The experts of `tokens` tokens in `layer`, `top_k` distinct ones per token, appended to
    /// `out` token by token; nothing for a dense layer.
    pub fn route(&mut self, layer: usize, tokens: usize, out: &mut Vec<u32>) {
        let Some(Some(d)) = self.layers.get(layer) else {
            return;
        };
        out.reserve(tokens * self.top_k);
        for _ in 0..tokens {
            let start = out.len();
            while out.len() - start < self.top_k {
                let e = d.draw(&mut self.rng);
                if !out[start..].contains(&e) {
                    out.push(e);
                }
            }
        }
        debug_assert!(out.iter().all(|&e| (e as usize) < self.experts));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn generator(source: &RoutingSource, seed: u64) -> RoutingGenerator {
        RoutingGenerator::new(source, &[true, false, true], 16, 4, seed).unwrap()
    }

    #[test]
    fn sources_parse_and_print() {
        for s in ["model", "uniform", "zipf:1.5", "trace:/tmp/r.json"] {
            assert_eq!(s.parse::<RoutingSource>().unwrap().to_string(), s);
        }
        for bad in ["zipf", "zipf:0", "zipf:-1", "zipf:x", "trace:", "even"] {
            let e = bad.parse::<RoutingSource>().unwrap_err();
            assert!(e.contains("zipf:S"), "{bad}: {e}");
        }
    }

    proptest! {
        /// Every token gets top-k distinct experts in range; dense layers get none; the same
        /// seed routes the same way.
        #[test]
        fn tokens_get_distinct_experts_and_seeds_repeat(
            tokens in 1usize..40, seed in any::<u64>(), zipf in 0.1f64..3.0, uniform in any::<bool>(),
        ) {
            let source = if uniform { RoutingSource::Uniform } else { RoutingSource::Zipf(zipf) };
            let mut a = generator(&source, seed);
            let mut b = generator(&source, seed);
            for layer in 0..3 {
                let (mut x, mut y) = (Vec::new(), Vec::new());
                a.route(layer, tokens, &mut x);
                b.route(layer, tokens, &mut y);
                prop_assert_eq!(&x, &y);
                if layer == 1 {
                    prop_assert!(x.is_empty());
                    continue;
                }
                prop_assert_eq!(x.len(), tokens * 4);
                for t in x.chunks(4) {
                    let mut s = t.to_vec();
                    s.sort_unstable();
                    s.dedup();
                    prop_assert_eq!(s.len(), 4);
                    prop_assert!(t.iter().all(|&e| e < 16));
                }
            }
        }
    }

    /// Zipf routing is skewed as its exponent says: the hottest expert's share rises with it,
    /// and uniform routing is even within sampling noise.
    #[test]
    fn skew_follows_the_exponent() {
        let hottest_share = |source: RoutingSource| {
            let mut g = generator(&source, 7);
            let mut out = Vec::new();
            g.route(0, 20_000, &mut out);
            let mut counts = [0usize; 16];
            for &e in &out {
                counts[e as usize] += 1;
            }
            *counts.iter().max().unwrap() as f64 / out.len() as f64
        };
        let even = hottest_share(RoutingSource::Uniform);
        let mild = hottest_share(RoutingSource::Zipf(0.5));
        let steep = hottest_share(RoutingSource::Zipf(1.5));
        assert!((even - 1.0 / 16.0).abs() < 0.005, "uniform {even}");
        assert!(
            mild > even + 0.01 && steep > mild + 0.03,
            "{even} {mild} {steep}"
        );
    }
}
