//! Summary statistics computed exactly as numpy computes them in `vllm bench serve`:
//! population standard deviation (`np.std`), and percentiles with linear interpolation
//! between the closest ranks (`np.percentile`'s default). An empty sample summarises as 0,
//! matching vLLM's `np.mean(xs or 0)`.

/// Mean, median, standard deviation and chosen percentiles of one latency metric, in ms.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct MetricSummary {
    /// Arithmetic mean.
    pub mean_ms: f64,
    /// 50th percentile.
    pub median_ms: f64,
    /// Population standard deviation.
    pub std_ms: f64,
    /// `(percentile, value)` pairs in the order requested.
    pub percentiles_ms: Vec<(f64, f64)>,
}

impl MetricSummary {
    /// Summarises `seconds` (any order) and reports in milliseconds.
    pub fn from_seconds(seconds: &[f64], percentiles: &[f64]) -> Self {
        let mut sorted: Vec<f64> = seconds.to_vec();
        sorted.sort_by(f64::total_cmp);
        MetricSummary {
            mean_ms: mean(&sorted) * 1000.0,
            median_ms: percentile_sorted(&sorted, 50.0) * 1000.0,
            std_ms: std_dev(&sorted) * 1000.0,
            percentiles_ms: percentiles
                .iter()
                .map(|&p| (p, percentile_sorted(&sorted, p) * 1000.0))
                .collect(),
        }
    }

    /// The value at percentile `p` if it was requested.
    pub fn percentile(&self, p: f64) -> Option<f64> {
        self.percentiles_ms
            .iter()
            .find(|(q, _)| *q == p)
            .map(|(_, v)| *v)
    }
}

/// Arithmetic mean; 0 for an empty sample.
pub fn mean(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    xs.iter().sum::<f64>() / xs.len() as f64
}

/// Population standard deviation (`np.std`, ddof = 0); 0 for an empty sample.
pub fn std_dev(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    let m = mean(xs);
    (xs.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / xs.len() as f64).sqrt()
}

/// `np.percentile(sorted, p)` with linear interpolation; `sorted` must be ascending.
pub fn percentile_sorted(sorted: &[f64], p: f64) -> f64 {
    match sorted.len() {
        0 => 0.0,
        1 => sorted[0],
        n => {
            let rank = (p / 100.0).clamp(0.0, 1.0) * (n - 1) as f64;
            let lo = rank.floor() as usize;
            let hi = rank.ceil() as usize;
            sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
        }
    }
}

/// Median of a list in any order (numpy's linear interpolation); `None` when empty.
pub fn median(values: &[f64]) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    Some(percentile_sorted(&sorted, 50.0))
}

/// How vLLM spells a percentile in field names: `99`, `99.9`.
pub fn percentile_word(p: f64) -> String {
    if p.fract() == 0.0 {
        format!("{}", p as i64)
    } else {
        format!("{p}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn matches_numpy_on_known_values() {
        // np.percentile([1,2,3,4], 90) == 3.7; np.median == 2.5; np.std == 1.118033988749895
        let xs = [4.0, 1.0, 3.0, 2.0];
        let mut sorted = xs.to_vec();
        sorted.sort_by(f64::total_cmp);
        assert!((percentile_sorted(&sorted, 90.0) - 3.7).abs() < 1e-12);
        assert!((percentile_sorted(&sorted, 50.0) - 2.5).abs() < 1e-12);
        assert!((std_dev(&xs) - 1.118_033_988_749_895).abs() < 1e-12);
        // np.percentile([10, 20, 30], 99) == 29.8
        assert!((percentile_sorted(&[10.0, 20.0, 30.0], 99.0) - 29.8).abs() < 1e-9);
    }

    #[test]
    fn summary_is_in_milliseconds_and_empty_is_zero() {
        let s = MetricSummary::from_seconds(&[0.1, 0.3, 0.2], &[99.0]);
        assert!((s.mean_ms - 200.0).abs() < 1e-9);
        assert!((s.median_ms - 200.0).abs() < 1e-9);
        assert!((s.percentile(99.0).unwrap() - 298.0).abs() < 1e-9);
        assert_eq!(s.percentile(90.0), None);
        let e = MetricSummary::from_seconds(&[], &[50.0]);
        assert_eq!((e.mean_ms, e.median_ms, e.std_ms), (0.0, 0.0, 0.0));
        assert_eq!(e.percentiles_ms, vec![(50.0, 0.0)]);
    }

    #[test]
    fn percentile_words_follow_vllm() {
        assert_eq!(percentile_word(99.0), "99");
        assert_eq!(percentile_word(99.9), "99.9");
        assert_eq!(percentile_word(50.0), "50");
    }

    proptest! {
        #[test]
        fn percentiles_are_monotone_and_bounded(
            mut xs in proptest::collection::vec(0.0f64..1e3, 1..60),
            a in 0.0f64..100.0,
            b in 0.0f64..100.0,
        ) {
            xs.sort_by(f64::total_cmp);
            let (lo, hi) = if a <= b { (a, b) } else { (b, a) };
            let (pa, pb) = (percentile_sorted(&xs, lo), percentile_sorted(&xs, hi));
            prop_assert!(pa <= pb + 1e-9);
            prop_assert!(pa >= xs[0] - 1e-9 && pb <= xs[xs.len() - 1] + 1e-9);
        }
    }
}
