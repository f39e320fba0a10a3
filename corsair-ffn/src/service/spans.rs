//! When each message a card computed landed, got its CPU and was done: the cards' side of a
//! step's timeline, beside the attention node's spans (`afd generate --trace`).

use std::sync::Mutex;
use std::time::Instant;

/// Spans a log keeps at most; later ones are dropped (a trace is for a short run).
const MAX_SPANS: usize = 1 << 20;

/// One message's time on a card.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CardSpan {
    /// The card's index.
    pub card: usize,
    /// The message's step (the attention node's counter, as carried on the wire).
    pub step: u64,
    /// Its layer (`proto::data::LM_HEAD_LAYER` for the LM head).
    pub layer: u16,
    /// Its micro-batch.
    pub micro_batch: u8,
    /// When it landed in the card's inbox (JetStream's receive time).
    pub landed: Instant,
    /// When the card's worker took it up: its CPU turn granted, or at once for a message that
    /// takes no turn (the LM head's).
    pub started: Instant,
    /// When its reply was computed.
    pub ended: Instant,
    /// The worker thread's CPU time and context switches from `started` to `ended`: a compute
    /// span much longer than its CPU time was spent off the CPU (preempted or descheduled).
    pub thread: ThreadUsage,
}

/// CPU time and context switches of the calling thread, or the difference of two readings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ThreadUsage {
    /// CPU time, user and system, in microseconds (the thread's CPU clock).
    pub cpu_us: u64,
    /// Times the thread gave up its CPU by blocking.
    pub voluntary_switches: u64,
    /// Times the scheduler took its CPU away.
    pub involuntary_switches: u64,
}

impl ThreadUsage {
    /// The calling thread's usage so far: CPU time from `CLOCK_THREAD_CPUTIME_ID` (exact, where
    /// `getrusage`'s user and system times are tick samples), switches from
    /// `getrusage(RUSAGE_THREAD)`; zeros where the OS cannot say.
    #[cfg(target_os = "linux")]
    pub fn now() -> Self {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `clock_gettime` writes one `timespec` into the value it is given.
        let cpu_us = if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } == 0
        {
            ts.tv_sec.max(0) as u64 * 1_000_000 + ts.tv_nsec.max(0) as u64 / 1_000
        } else {
            0
        };
        // SAFETY: `getrusage` writes one `rusage` into the zeroed value it is given.
        let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
        let (voluntary, involuntary) =
            if unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) } == 0 {
                (ru.ru_nvcsw.max(0) as u64, ru.ru_nivcsw.max(0) as u64)
            } else {
                (0, 0)
            };
        ThreadUsage {
            cpu_us,
            voluntary_switches: voluntary,
            involuntary_switches: involuntary,
        }
    }

    /// Zeros: this OS's per-thread usage is not read.
    #[cfg(not(target_os = "linux"))]
    pub fn now() -> Self {
        Self::default()
    }

    /// What was used between `earlier` and `self`.
    pub fn since(self, earlier: Self) -> Self {
        ThreadUsage {
            cpu_us: self.cpu_us.saturating_sub(earlier.cpu_us),
            voluntary_switches: self
                .voluntary_switches
                .saturating_sub(earlier.voluntary_switches),
            involuntary_switches: self
                .involuntary_switches
                .saturating_sub(earlier.involuntary_switches),
        }
    }
}

/// A card host's spans, recorded by its workers while tracing is on.
#[derive(Debug, Default)]
pub(crate) struct SpanLog {
    spans: Mutex<Vec<CardSpan>>,
}

impl SpanLog {
    pub fn push(&self, span: CardSpan) {
        let mut spans = self.spans.lock().unwrap_or_else(|p| p.into_inner());
        if spans.len() < MAX_SPANS {
            spans.push(span);
        }
    }

    /// The spans recorded so far, leaving the log empty.
    pub fn take(&self) -> Vec<CardSpan> {
        std::mem::take(&mut *self.spans.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A thread spinning for 20 ms of wall time is charged some CPU time, and never more than
    /// the wall time that passed.
    #[cfg(target_os = "linux")]
    #[test]
    fn thread_usage_counts_cpu_time_within_wall_time() {
        let (before, wall) = (ThreadUsage::now(), Instant::now());
        let mut x = 0u64;
        while wall.elapsed().as_millis() < 20 {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
        }
        let used = ThreadUsage::now().since(before);
        let elapsed_us = wall.elapsed().as_micros() as u64;
        assert!(used.cpu_us > 0, "no CPU time read: {used:?}");
        assert!(
            used.cpu_us <= elapsed_us + 1_000,
            "{used:?} is more CPU than the {elapsed_us} us that passed"
        );
        assert_eq!(ThreadUsage::default().since(used), ThreadUsage::default());
    }

    /// A thread that blocks ten times (each sleep gives up its CPU) is counted at least ten
    /// voluntary switches, and a thread that never blocks none in a short spin.
    #[cfg(target_os = "linux")]
    #[test]
    fn thread_usage_counts_the_times_a_thread_blocks() {
        let before = ThreadUsage::now();
        for _ in 0..10 {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let slept = ThreadUsage::now().since(before);
        assert!(slept.voluntary_switches >= 10, "{slept:?}");
        let before = ThreadUsage::now();
        let mut x = 0u64;
        for i in 0..10_000u64 {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(i));
        }
        let spun = ThreadUsage::now().since(before);
        assert_eq!(spun.voluntary_switches, 0, "{spun:?}");
    }
}
