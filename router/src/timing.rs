//! How the engines read time, and how they keep pace with a modeled clock.
//!
//! Every engine stamps its steps with one [`Clock`] (wall time by default). With a modeled
//! clock (`afd serve --clock modeled --time-dilation K`) each step's duration on the
//! deployment's hardware comes from a [`StepTimer`], and the engine releases the step's tokens
//! no earlier than the step's modeled end, stretched `K` times: clients then see a consistent
//! deployment, `K` times slower than it would run. A step the host could not finish in its
//! stretched time is late: counted, warned about, with the smallest `K` that would have held.
//! Tokens never depend on the clock.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use step::clock::DilatedClock;
use step::{Clock, StepBatch, StepRouting, StepTimer, WallClock};

/// Steps a `--time-dilation auto` clock measures before it settles on its dilation.
pub const AUTO_DILATION_STEPS: u64 = 16;
/// Headroom of an automatic dilation over the slowest measured step.
pub const AUTO_DILATION_MARGIN: f64 = 1.5;
/// At most one warning about late steps per this much wall time.
const LATE_WARNING_EVERY: Duration = Duration::from_secs(10);

/// How slow a modeled clock runs against the wall.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Dilation {
    /// `K` wall seconds per modeled second.
    Fixed(f64),
    /// Measured from the first [`AUTO_DILATION_STEPS`] steps (run unpaced), then fixed.
    Auto,
}

impl std::str::FromStr for Dilation {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "auto" {
            return Ok(Dilation::Auto);
        }
        match s.parse::<f64>() {
            Ok(k) if k.is_finite() && k >= 1.0 => Ok(Dilation::Fixed(k)),
            _ => Err(format!(
                "--time-dilation takes a number of at least 1 (wall seconds per modeled second) \
                 or auto, not `{s}`"
            )),
        }
    }
}

/// The clock of a router, and for a modeled one, what times its steps.
pub struct Timing {
    /// What every engine stamps with.
    pub clock: Arc<dyn Clock>,
    /// Modeled steps: the dilated clock, one timer per attention node, and the stats.
    pub modeled: Option<ModeledSteps>,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            clock: Arc::new(WallClock),
            modeled: None,
        }
    }
}

/// What a modeled clock needs.
pub struct ModeledSteps {
    /// The clock (also [`Timing::clock`]).
    pub clock: Arc<DilatedClock>,
    /// One timer per attention node, in node order.
    pub timers: Vec<Box<dyn StepTimer>>,
    /// Fixed, or measured.
    pub dilation: Dilation,
}

impl Timing {
    /// A modeled clock of `dilation`, each node's steps timed by its timer.
    pub fn modeled(timers: Vec<Box<dyn StepTimer>>, dilation: Dilation) -> Self {
        let k = match dilation {
            Dilation::Fixed(k) => k,
            Dilation::Auto => 1.0,
        };
        let clock = Arc::new(DilatedClock::new(k));
        Timing {
            clock: clock.clone(),
            modeled: Some(ModeledSteps {
                clock,
                timers,
                dilation,
            }),
        }
    }
}

/// Counters of a modeled clock, shared by every engine.
#[derive(Debug, Default)]
pub struct ClockStats {
    steps: AtomicU64,
    late_steps: AtomicU64,
    /// Nodes inside a step now.
    stepping: AtomicUsize,
    inner: Mutex<ClockInner>,
}

#[derive(Debug, Default)]
struct ClockInner {
    /// The largest host time over modeled time of any step.
    required: f64,
    /// Of the steps since the dilation was last set.
    required_since_set: f64,
    modeled_seconds: f64,
    last_warning: Option<Instant>,
    /// The dilation is settled (fixed, or measured).
    settled: bool,
}

/// A snapshot of a modeled clock, for `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ClockSnapshot {
    /// Whether the clock is modeled.
    pub modeled: bool,
    /// Wall seconds per modeled second now.
    pub dilation: f64,
    /// Whether the dilation is settled (an `auto` one is still measuring before).
    pub settled: bool,
    /// Steps timed.
    pub steps: u64,
    /// Steps the host did not finish within their dilated modeled time.
    pub late_steps: u64,
    /// The smallest dilation every step so far would have kept to.
    pub required_dilation: f64,
    /// Modeled seconds of every step so far, over every node.
    pub modeled_step_seconds: f64,
}

/// One engine's pacing: its node's timer, the shared clock and stats.
pub(crate) struct Pacer {
    pub(crate) timer: Box<dyn StepTimer>,
    pub(crate) clock: Arc<DilatedClock>,
    pub(crate) stats: Arc<ClockStats>,
    pub(crate) auto: bool,
    pub(crate) node: usize,
}

impl ClockStats {
    /// A snapshot as of now.
    pub fn snapshot(&self, clock: &dyn Clock) -> ClockSnapshot {
        let inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        ClockSnapshot {
            modeled: clock.is_modeled(),
            dilation: clock.dilation(),
            settled: inner.settled || !clock.is_modeled(),
            steps: self.steps.load(Ordering::Acquire),
            late_steps: self.late_steps.load(Ordering::Acquire),
            required_dilation: inner.required,
            modeled_step_seconds: inner.modeled_seconds,
        }
    }

    pub(crate) fn settle(&self) {
        self.inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .settled = true;
    }
}

impl Pacer {
    /// Marks the start of a step on this node.
    pub(crate) fn begin(&self) {
        self.stats.stepping.fetch_add(1, Ordering::AcqRel);
    }

    /// After the node ran `batch` (started on the wall at `wall_start`, with `routing`): waits
    /// until the step's dilated modeled end, and counts it.
    pub(crate) fn finish(
        &mut self,
        batch: &StepBatch,
        routing: Option<&StepRouting>,
        wall_start: Instant,
    ) {
        let busy = self.stats.stepping.load(Ordering::Acquire).max(1);
        let modeled = self.timer.step_duration(batch, routing, busy);
        self.stats.stepping.fetch_sub(1, Ordering::AcqRel);
        let host = wall_start.elapsed();
        let ratio = if modeled.is_zero() {
            0.0
        } else {
            host.as_secs_f64() / modeled.as_secs_f64()
        };
        let steps = self.stats.steps.fetch_add(1, Ordering::AcqRel) + 1;
        let (settled, k) = {
            let mut inner = self
                .stats
                .inner
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            inner.required = inner.required.max(ratio);
            inner.required_since_set = inner.required_since_set.max(ratio);
            inner.modeled_seconds += modeled.as_secs_f64();
            if self.auto && !inner.settled && steps >= AUTO_DILATION_STEPS {
                let k = (inner.required_since_set * AUTO_DILATION_MARGIN)
                    .max(1.0)
                    .ceil();
                self.clock.set_dilation(k);
                inner.settled = true;
                tracing::warn!(
                    "--time-dilation auto: the slowest of the first {steps} steps took {:.1} \
                     times its modeled time on this host; serving at a dilation of {k} from now",
                    inner.required_since_set
                );
            }
            (inner.settled || !self.auto, self.clock.dilation())
        };
        if !settled {
            // Measuring: no pacing yet.
            return;
        }
        let due = wall_start + modeled.mul_f64(k);
        match due.checked_duration_since(Instant::now()) {
            Some(wait) if !wait.is_zero() => std::thread::sleep(wait),
            _ => {
                self.stats.late_steps.fetch_add(1, Ordering::AcqRel);
                let mut inner = self
                    .stats
                    .inner
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                let now = Instant::now();
                if inner
                    .last_warning
                    .is_none_or(|t| now.duration_since(t) >= LATE_WARNING_EVERY)
                {
                    inner.last_warning = Some(now);
                    tracing::warn!(
                        node = self.node,
                        "a step took {:.3} ms on this host but {:.3} ms dilated {k} times: its \
                         tokens are late; a dilation of at least {:.1} would have held every \
                         step so far (afd_clock_late_steps_total counts them)",
                        host.as_secs_f64() * 1e3,
                        modeled.as_secs_f64() * k * 1e3,
                        inner.required.ceil()
                    );
                }
            }
        }
    }

    /// A step that failed: it leaves the count of nodes inside a step.
    pub(crate) fn abandon(&self) {
        self.stats.stepping.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dilations_parse() {
        assert_eq!("auto".parse::<Dilation>(), Ok(Dilation::Auto));
        assert_eq!("40".parse::<Dilation>(), Ok(Dilation::Fixed(40.0)));
        for bad in ["0.5", "0", "-2", "inf", "x"] {
            assert!(bad.parse::<Dilation>().is_err(), "{bad}");
        }
    }

    struct Fixed(Duration);
    impl StepTimer for Fixed {
        fn step_duration(&mut self, _: &StepBatch, _: Option<&StepRouting>, _: usize) -> Duration {
            self.0
        }
    }

    fn pacer(modeled: Duration, k: f64, auto: bool) -> (Pacer, Arc<ClockStats>, Arc<DilatedClock>) {
        let stats = Arc::new(ClockStats::default());
        let clock = Arc::new(DilatedClock::new(k));
        if !auto {
            stats.settle();
        }
        (
            Pacer {
                timer: Box::new(Fixed(modeled)),
                clock: clock.clone(),
                stats: stats.clone(),
                auto,
                node: 0,
            },
            stats,
            clock,
        )
    }

    /// A fast host waits for the dilated modeled end; a slow one is counted late, with the
    /// dilation that would have held.
    #[test]
    fn steps_wait_for_their_dilated_end_or_are_counted_late() {
        let (mut p, stats, clock) = pacer(Duration::from_millis(1), 20.0, false);
        let start = Instant::now();
        p.begin();
        p.finish(&StepBatch::default(), None, start);
        assert!(
            start.elapsed() >= Duration::from_millis(20),
            "{:?}",
            start.elapsed()
        );
        let s = stats.snapshot(clock.as_ref());
        assert_eq!((s.steps, s.late_steps), (1, 0));

        let (mut p, stats, clock) = pacer(Duration::from_micros(100), 2.0, false);
        let start = Instant::now();
        p.begin();
        std::thread::sleep(Duration::from_millis(5));
        p.finish(&StepBatch::default(), None, start);
        let s = stats.snapshot(clock.as_ref());
        assert_eq!(s.late_steps, 1);
        assert!(s.required_dilation >= 50.0, "{s:?}");
        assert!((s.modeled_step_seconds - 1e-4).abs() < 1e-9);
    }

    /// An automatic dilation measures the first steps unpaced, then settles above the slowest.
    #[test]
    fn an_automatic_dilation_settles_after_its_first_steps() {
        let (mut p, stats, clock) = pacer(Duration::from_micros(100), 1.0, true);
        for i in 0..AUTO_DILATION_STEPS {
            let start = Instant::now();
            p.begin();
            std::thread::sleep(Duration::from_millis(1));
            p.finish(&StepBatch::default(), None, start);
            let settled = stats.snapshot(clock.as_ref()).settled;
            assert_eq!(settled, i + 1 == AUTO_DILATION_STEPS, "step {i}");
        }
        let s = stats.snapshot(clock.as_ref());
        assert!(s.dilation >= 10.0 * AUTO_DILATION_MARGIN, "{s:?}");
        assert_eq!(s.late_steps, 0, "measuring steps are not late");
    }
}
