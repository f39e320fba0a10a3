//! Arrival times of the measured requests, computed before the run (as vLLM does) so that
//! sending never waits on random-number generation.
//!
//! Gaps between arrivals are gamma distributed with shape = burstiness and
//! scale = 1 / (rate * burstiness): mean 1/rate; burstiness 1 is the exponential gap of a
//! Poisson process. Like vLLM, the cumulative offsets are then rescaled so the last request
//! arrives at exactly `n / rate`, which removes the 1-2% seed-to-seed spread of the offered load.

use rand::Rng;
use rand_distr::{Distribution, Gamma};

/// Offsets in seconds from the start of the run at which each of `n` requests arrives.
///
/// An infinite `rate` sends everything at 0; an infinite `burstiness` spaces arrivals evenly.
/// `rate` and `burstiness` must be positive (checked by `BenchmarkConfig::validate`).
pub fn arrival_offsets<R: Rng>(n: usize, rate: f64, burstiness: f64, rng: &mut R) -> Vec<f64> {
    if n == 0 {
        return Vec::new();
    }
    if rate.is_infinite() {
        return vec![0.0; n];
    }
    let gaps: Vec<f64> = if burstiness.is_infinite() {
        vec![1.0 / rate; n]
    } else {
        match Gamma::new(burstiness, 1.0 / (rate * burstiness)) {
            Ok(gamma) => (0..n).map(|_| gamma.sample(rng)).collect(),
            // Only reachable with non-positive parameters, which validation rejects.
            Err(_) => vec![1.0 / rate; n],
        }
    };
    let mut offsets = Vec::with_capacity(n);
    let mut total = 0.0;
    for gap in gaps {
        total += gap;
        offsets.push(total);
    }
    if total > 0.0 {
        let scale = (n as f64 / rate) / total;
        for offset in &mut offsets {
            *offset *= scale;
        }
    }
    offsets
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    fn gaps(offsets: &[f64]) -> Vec<f64> {
        let mut prev = 0.0;
        offsets
            .iter()
            .map(|&t| {
                let g = t - prev;
                prev = t;
                g
            })
            .collect()
    }

    #[test]
    fn infinite_rate_sends_everything_at_once() {
        let mut rng = StdRng::seed_from_u64(1);
        assert_eq!(
            arrival_offsets(4, f64::INFINITY, 1.0, &mut rng),
            vec![0.0; 4]
        );
    }

    #[test]
    fn last_arrival_is_normalised_to_n_over_rate() {
        let mut rng = StdRng::seed_from_u64(7);
        let offsets = arrival_offsets(500, 8.0, 1.0, &mut rng);
        let last = *offsets.last().unwrap();
        assert!((last - 500.0 / 8.0).abs() < 1e-9, "last arrival {last}");
        assert!(offsets.windows(2).all(|w| w[0] <= w[1]));
    }

    #[test]
    fn infinite_burstiness_is_evenly_spaced() {
        let mut rng = StdRng::seed_from_u64(3);
        let offsets = arrival_offsets(5, 2.0, f64::INFINITY, &mut rng);
        for g in gaps(&offsets) {
            assert!((g - 0.5).abs() < 1e-12);
        }
    }

    /// Coefficient of variation of gamma(k) gaps is 1/sqrt(k): Poisson gaps vary as much as
    /// their mean, bursty ones more, smooth ones less.
    #[test]
    fn burstiness_controls_gap_spread() {
        let cv = |burstiness: f64| {
            let mut rng = StdRng::seed_from_u64(11);
            let g = gaps(&arrival_offsets(20_000, 10.0, burstiness, &mut rng));
            let mean = g.iter().sum::<f64>() / g.len() as f64;
            let var = g.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / g.len() as f64;
            var.sqrt() / mean
        };
        let poisson = cv(1.0);
        let bursty = cv(0.25);
        let smooth = cv(4.0);
        assert!((poisson - 1.0).abs() < 0.05, "poisson cv {poisson}");
        assert!((bursty - 2.0).abs() < 0.15, "bursty cv {bursty}");
        assert!((smooth - 0.5).abs() < 0.05, "smooth cv {smooth}");
    }

    #[test]
    fn same_seed_same_schedule() {
        let a = arrival_offsets(10, 3.0, 0.7, &mut StdRng::seed_from_u64(5));
        let b = arrival_offsets(10, 3.0, 0.7, &mut StdRng::seed_from_u64(5));
        assert_eq!(a, b);
    }
}
