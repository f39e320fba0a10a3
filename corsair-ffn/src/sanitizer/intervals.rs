//! Sets of byte ranges, kept sorted and merged.

/// A set of half-open byte ranges `[start, end)`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct IntervalSet {
    ranges: Vec<(u64, u64)>,
}

impl IntervalSet {
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// Index of the first range ending after `start`.
    fn first_after(&self, start: u64) -> usize {
        self.ranges.partition_point(|&(_, e)| e <= start)
    }

    /// Adds `[start, end)`.
    pub fn insert(&mut self, start: u64, end: u64) {
        if start >= end {
            return;
        }
        let i = self.first_after(start);
        let mut j = i;
        let (mut s, mut e) = (start, end);
        // Merge every range overlapping or touching [s, e).
        if i > 0 && self.ranges[i - 1].1 == s {
            j = i - 1;
        }
        let first = j;
        while j < self.ranges.len() && self.ranges[j].0 <= e {
            s = s.min(self.ranges[j].0);
            e = e.max(self.ranges[j].1);
            j += 1;
        }
        self.ranges.splice(first..j, [(s, e)]);
    }

    /// Removes `[start, end)`.
    pub fn remove(&mut self, start: u64, end: u64) {
        if start >= end {
            return;
        }
        let i = self.first_after(start);
        let mut keep = Vec::new();
        let mut j = i;
        while j < self.ranges.len() && self.ranges[j].0 < end {
            let (s, e) = self.ranges[j];
            if s < start {
                keep.push((s, start));
            }
            if e > end {
                keep.push((end, e));
            }
            j += 1;
        }
        self.ranges.splice(i..j, keep);
    }

    /// The parts of `[start, end)` inside the set.
    pub fn covered(&self, start: u64, end: u64) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        // An empty query covers nothing (not an empty piece of the range around it).
        if start >= end {
            return out;
        }
        let mut j = self.first_after(start);
        while j < self.ranges.len() && self.ranges[j].0 < end {
            let (s, e) = self.ranges[j];
            out.push((s.max(start), e.min(end)));
            j += 1;
        }
        out
    }

    /// The parts of `[start, end)` outside the set.
    pub fn uncovered(&self, start: u64, end: u64) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        let mut at = start;
        for (s, e) in self.covered(start, end) {
            if s > at {
                out.push((at, s));
            }
            at = e;
        }
        if at < end {
            out.push((at, end));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn matches_a_bitmap(ops in proptest::collection::vec((any::<bool>(), 0u64..64, 0u64..64), 0..40),
                            q in (0u64..64, 0u64..64)) {
            let mut set = IntervalSet::default();
            let mut bits = [false; 64];
            for (add, a, b) in ops {
                let (s, e) = (a.min(b), a.max(b));
                if add { set.insert(s, e) } else { set.remove(s, e) }
                for bit in &mut bits[s as usize..e as usize] { *bit = add; }
            }
            let (s, e) = (q.0.min(q.1), q.0.max(q.1));
            let mut cov = [false; 64];
            for (a, b) in set.covered(s, e) { for c in &mut cov[a as usize..b as usize] { *c = true; } }
            let mut unc = [false; 64];
            for (a, b) in set.uncovered(s, e) { for c in &mut unc[a as usize..b as usize] { *c = true; } }
            for i in s as usize..e as usize {
                prop_assert_eq!(cov[i], bits[i]);
                prop_assert_eq!(unc[i], !bits[i]);
            }
            // Sorted, apart and never empty: the set and what it answers.
            prop_assert!(set.ranges.windows(2).all(|w| w[0].1 < w[1].0));
            prop_assert!(set.ranges.iter().all(|&(a, b)| a < b), "{:?}", set.ranges);
            for pieces in [set.covered(s, e), set.uncovered(s, e)] {
                prop_assert!(pieces.iter().all(|&(a, b)| a < b), "{:?}", pieces);
                prop_assert!(pieces.windows(2).all(|w| w[0].1 <= w[1].0), "{:?}", pieces);
            }
        }
    }
}
