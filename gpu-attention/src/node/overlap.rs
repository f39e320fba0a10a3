//! `--micro-batches auto`: whether a step's attention and experts overlap (two micro-batches)
//! is measured on the running deployment, not assumed (no I/O, no clock: the node hands in
//! each step's seconds).
//!
//! Overlap hides one micro-batch's attention behind the other's experts, but it is not free:
//! every card passes over its experts' weights once per micro-batch, and the node's fixed
//! costs per layer (kernel launches, hops) double. Which wins depends on the hardware and the
//! batch: on separate devices at large batches two micro-batches win; where simulated cards
//! share the node's cores and memory bandwidth (measured on 2 cores, a medium Mixtral on 2
//! cards: 34 against 47 ms a step at 16 sequences) and on a GPU below about 32 sequences
//! (docs/PLANNING.md), one does. So the tuner keeps, for each size of step, the seconds per
//! token of both, tries each once, runs the faster and tries the other again now and then in
//! case the machine changed (or the first try was unlucky). Both give the same tokens, bit
//! for bit: the choice only moves time.

/// Steps of each option a size class runs before the tuner compares them. One: a fresh
/// server pays for each class's slower option in full, and the retries correct a wrong start.
const WARMUP: u32 = 1;
/// In a size class whose choice is made, one step in this many runs the other option again.
const RETRY_EVERY: u32 = 32;
/// Weight of the newest step in an option's running estimate.
const NEWEST: f64 = 0.3;
/// Size classes: steps of 4^c..4^(c+1) tokens share class c (coarse, so that a fresh server
/// tries few classes: decode steps, steps with a prompt chunk, whole prefill chunks).
const CLASSES: usize = usize::BITS as usize / 2;

/// One option's running estimate in one size class.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Estimate {
    steps: u32,
    /// Exponentially weighted seconds per token.
    per_token: f64,
}

impl Estimate {
    fn add(&mut self, per_token: f64) {
        self.per_token = if self.steps == 0 {
            per_token
        } else {
            NEWEST * per_token + (1.0 - NEWEST) * self.per_token
        };
        self.steps = self.steps.saturating_add(1);
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct SizeClass {
    one: Estimate,
    two: Estimate,
    /// Decisions since this class last retried the slower option.
    since_retry: u32,
}

/// Chooses one or two micro-batches per step from the measured speed of each (see the
/// module's doc).
#[derive(Debug, Clone, PartialEq)]
pub struct OverlapTuner {
    classes: [SizeClass; CLASSES],
}

impl Default for OverlapTuner {
    fn default() -> Self {
        OverlapTuner {
            classes: [SizeClass::default(); CLASSES],
        }
    }
}

fn class(tokens: usize) -> usize {
    tokens.max(1).ilog2() as usize / 2
}

/// The token counts of the size class of a step of `tokens` tokens, first and last.
pub fn class_range(tokens: usize) -> (usize, usize) {
    let c = class(tokens) as u32;
    (
        4usize.pow(c),
        4usize.checked_pow(c + 1).map_or(usize::MAX, |n| n - 1),
    )
}

impl OverlapTuner {
    /// Whether a step of `tokens` tokens (and two or more sequences) should run as two
    /// micro-batches.
    pub fn two(&mut self, tokens: usize) -> bool {
        let c = &mut self.classes[class(tokens)];
        if c.one.steps < WARMUP || c.two.steps < WARMUP {
            // Two first, as before the tuner: the option with fewer steps so far.
            return c.two.steps <= c.one.steps;
        }
        let faster_two = c.two.per_token < c.one.per_token;
        c.since_retry += 1;
        if c.since_retry >= RETRY_EVERY {
            c.since_retry = 0;
            return !faster_two;
        }
        faster_two
    }

    /// Records that a step of `tokens` tokens took `seconds` with two micro-batches or one.
    pub fn record(&mut self, tokens: usize, two: bool, seconds: f64) {
        if tokens == 0 || !seconds.is_finite() || seconds < 0.0 {
            return;
        }
        let c = &mut self.classes[class(tokens)];
        let per_token = seconds / tokens as f64;
        if two {
            c.two.add(per_token);
        } else {
            c.one.add(per_token);
        }
    }

    /// Whether the tuner now runs steps of `tokens` tokens as two micro-batches, with the
    /// seconds per token it has measured for one and for two (`None` before both were tried).
    pub fn preference(&self, tokens: usize) -> Option<(bool, f64, f64)> {
        let c = &self.classes[class(tokens)];
        (c.one.steps >= WARMUP && c.two.steps >= WARMUP).then_some((
            c.two.per_token < c.one.per_token,
            c.one.per_token,
            c.two.per_token,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Runs `steps` steps of `tokens` tokens, each option costing its given seconds per token;
    /// returns how many ran as two micro-batches.
    fn run(t: &mut OverlapTuner, tokens: usize, steps: usize, one: f64, two: f64) -> usize {
        let mut twos = 0;
        for _ in 0..steps {
            let choice = t.two(tokens);
            twos += usize::from(choice);
            let cost = if choice { two } else { one };
            t.record(tokens, choice, cost * tokens as f64);
        }
        twos
    }

    #[test]
    fn settles_on_the_faster_option_and_retries_the_other_rarely() {
        let mut t = OverlapTuner::default();
        // Two micro-batches are slower at 16 tokens: after the warm-up (one of each) the
        // tuner runs one, retrying two once in RETRY_EVERY steps.
        let twos = run(&mut t, 16, 4 + 10 * RETRY_EVERY as usize, 2.0e-3, 2.8e-3);
        assert_eq!(twos, WARMUP as usize + 10);
        assert_eq!(t.preference(16).map(|p| p.0), Some(false));
        // Faster at 64 tokens, in a class of its own: two.
        let twos = run(&mut t, 64, 100, 1.5e-3, 1.0e-3);
        assert!(twos >= 100 - WARMUP as usize - 100 / RETRY_EVERY as usize);
        assert_eq!(t.preference(64).map(|p| p.0), Some(true));
        // Steps of 16-63 tokens share a class; 16's choice stands.
        assert_eq!(t.preference(63).map(|p| p.0), Some(false));
        assert_eq!(t.preference(8), None);
        assert_eq!(class_range(16), (16, 63));
        assert_eq!(class_range(3), (1, 3));
        assert_eq!(class_range(usize::MAX).1, usize::MAX);
    }

    #[test]
    fn follows_the_machine_when_it_changes() {
        let mut t = OverlapTuner::default();
        run(&mut t, 8, 100, 1.0e-3, 2.0e-3);
        assert_eq!(t.preference(8).map(|p| p.0), Some(false));
        // Now two is faster: the retries see it and the choice turns.
        run(&mut t, 8, 20 * RETRY_EVERY as usize, 2.0e-3, 1.0e-3);
        assert_eq!(t.preference(8).map(|p| p.0), Some(true));
    }

    #[test]
    fn ignores_steps_that_say_nothing() {
        let mut t = OverlapTuner::default();
        t.record(0, true, 1.0);
        t.record(4, true, f64::NAN);
        t.record(4, false, -1.0);
        assert_eq!(t, OverlapTuner::default());
    }

    proptest! {
        /// Whatever the costs, the warm-up tries each option WARMUP times first, and afterwards
        /// the slower one runs at most once in RETRY_EVERY steps.
        #[test]
        fn the_slower_option_runs_rarely(
            tokens in 1usize..5000, one in 1e-6f64..1e-1, ratio in 1.05f64..3.0, two_slower in any::<bool>(), steps in 4usize..400,
        ) {
            let (one_cost, two_cost) = if two_slower { (one, one * ratio) } else { (one * ratio, one) };
            let mut t = OverlapTuner::default();
            let twos = run(&mut t, tokens, steps, one_cost, two_cost);
            let slower = if two_slower { twos } else { steps - twos };
            let warm = 2 * WARMUP as usize;
            prop_assert!(slower <= WARMUP as usize + (steps - warm.min(steps)) / RETRY_EVERY as usize + 1);
            prop_assert!(slower >= WARMUP as usize);
        }

        /// The case the retries exist for: the faster option's first step was unlucky (it took
        /// several times its usual time), so the tuner starts on the slower one. Its retries
        /// bring the faster option's estimate down, and within the retries the running average
        /// needs to forget the outlier the choice turns. Meanwhile steps of another size class,
        /// whose faster option is the other one, are decided on their own.
        #[test]
        fn an_unlucky_first_try_is_corrected_by_the_retries(
            tokens in 1usize..4000, fast in 1e-6f64..1e-1, ratio in 1.05f64..3.0,
            unlucky in 1.5f64..10.0, two_faster in any::<bool>(),
        ) {
            let slow = fast * ratio;
            let (one_cost, two_cost) = if two_faster { (slow, fast) } else { (fast, slow) };
            // Another class (4^2 times the tokens) where the other option is faster.
            let other = tokens * 16;
            let mut t = OverlapTuner::default();
            // Retries needed for the average to fall below the slower cost:
            // fast + (1 - NEWEST)^n (unlucky - 1) fast < slow.
            let forget = ((ratio - 1.0) / (unlucky - 1.0)).ln() / (1.0 - NEWEST).ln();
            let retries = forget.max(0.0).ceil() as usize + 1;
            let steps = 2 * WARMUP as usize + (retries + 1) * RETRY_EVERY as usize;
            let mut first_fast = true;
            for _ in 0..steps {
                let choice = t.two(tokens);
                let mut cost = if choice { two_cost } else { one_cost };
                if choice == two_faster && std::mem::take(&mut first_fast) {
                    cost *= unlucky;
                }
                t.record(tokens, choice, cost * tokens as f64);
                let choice = t.two(other);
                let cost = if choice { one_cost } else { two_cost };
                t.record(other, choice, cost * other as f64);
            }
            prop_assert_eq!(t.preference(tokens).map(|p| p.0), Some(two_faster));
            prop_assert_eq!(t.preference(other).map(|p| p.0), Some(!two_faster));
        }
    }
}
