//! A runtime for one endpoint, driven by the threads that use it.
//!
//! With every endpoint of a process on a shared I/O thread, each message crosses two more
//! threads than it must: the writer wakes the I/O thread to encrypt and send, and on the other
//! side the I/O thread wakes the reader. On a machine with few cores each of those wake-ups
//! costs tens of microseconds. An [`EndpointRuntime`] is a current-thread tokio runtime that
//! the endpoint's own threads drive while they wait on it ([`EndpointRuntime::block_on`]):
//! a write is encrypted and sent by the thread that posted it, and a packet wakes the thread
//! that waits for its completion, with no thread in between.
//!
//! Between such calls nobody would answer the peer (acknowledgments, keep-alives, a new
//! connection), so a helper thread takes the runtime over once it has been left alone for
//! [`EndpointRuntime::IDLE_AFTER`] and hands it back the moment a caller returns. It sleeps
//! while the endpoint is busy.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::Notify;

/// A current-thread runtime for one endpoint's tasks, driven by whichever thread waits on it.
pub struct EndpointRuntime {
    runtime: Option<Arc<tokio::runtime::Runtime>>,
    idle: Arc<IdleState>,
    idle_driver: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for EndpointRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EndpointRuntime")
            .field("callers", &self.idle.callers.load(Ordering::Relaxed))
            .field("idle_driving", &self.idle.driving.load(Ordering::Relaxed))
            .finish()
    }
}

/// What the callers and the idle driver share.
struct IdleState {
    /// Threads inside [`EndpointRuntime::block_on`] now.
    callers: AtomicUsize,
    /// When the last caller left, in nanoseconds since `epoch`.
    last_left: AtomicU64,
    epoch: Instant,
    /// The idle driver drives the runtime (or is about to).
    driving: AtomicBool,
    /// Asks the idle driver to give the runtime back.
    give_back: Notify,
    stop: AtomicBool,
    /// Times the idle driver looked: at most one per `IDLE_AFTER` (a test checks that it never
    /// spins).
    rounds: AtomicU64,
}

impl IdleState {
    fn now(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }
}

/// A thread inside [`EndpointRuntime::block_on`]: counted from its arrival until it leaves,
/// by returning or by unwinding (a caller whose future panicked and stayed counted would keep
/// the idle driver away for good, and nobody would answer the peer again).
struct Caller<'a>(&'a IdleState);

impl<'a> Caller<'a> {
    fn arrive(idle: &'a IdleState) -> Self {
        idle.callers.fetch_add(1, Ordering::SeqCst);
        if idle.driving.load(Ordering::SeqCst) {
            // A stored permit wakes the driver even if it is not waiting yet.
            idle.give_back.notify_one();
        }
        Caller(idle)
    }
}

impl Drop for Caller<'_> {
    fn drop(&mut self) {
        self.0.last_left.store(self.0.now(), Ordering::Relaxed);
        self.0.callers.fetch_sub(1, Ordering::SeqCst);
    }
}

impl EndpointRuntime {
    /// How long the runtime must be left alone before the idle driver takes it over. Below
    /// QUIC's loss-probe timer (which includes the peer's 25 ms maximum acknowledgment delay)
    /// and far below its keep-alive and idle timeouts; far above the gaps between a busy
    /// endpoint's calls.
    pub const IDLE_AFTER: Duration = Duration::from_millis(20);

    /// Starts the runtime for the endpoint of node `node` and its idle driver (a thread named
    /// `<node>-io`).
    pub fn new(node: &str) -> std::io::Result<Arc<Self>> {
        let runtime = Arc::new(
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?,
        );
        let idle = Arc::new(IdleState {
            callers: AtomicUsize::new(0),
            last_left: AtomicU64::new(0),
            epoch: Instant::now(),
            driving: AtomicBool::new(false),
            give_back: Notify::new(),
            stop: AtomicBool::new(false),
            rounds: AtomicU64::new(0),
        });
        let idle_driver = {
            let (runtime, idle) = (runtime.clone(), idle.clone());
            std::thread::Builder::new()
                .name(format!("{node}-io"))
                .spawn(move || drive_while_idle(&runtime, &idle))?
        };
        Ok(Arc::new(EndpointRuntime {
            runtime: Some(runtime),
            idle,
            idle_driver: Some(idle_driver),
        }))
    }

    fn runtime(&self) -> &tokio::runtime::Runtime {
        // Present until drop.
        self.runtime
            .as_deref()
            .expect("the runtime lives until drop")
    }

    /// Runs `future` to completion on the calling thread, driving the endpoint's tasks (its
    /// sockets, timers and receive tasks) while it waits. Several threads may call it at once;
    /// one of them drives at a time. Call it from plain threads only, never from an async task.
    pub fn block_on<F: Future>(&self, future: F) -> F::Output {
        let _caller = Caller::arrive(&self.idle);
        self.runtime().block_on(future)
    }

    /// [`Self::block_on`], then lets the tasks the future woke run once before returning: a
    /// posted write leaves the socket now, not when this thread next waits on the runtime.
    pub fn block_on_then_flush<F: Future>(&self, future: F) -> F::Output {
        self.block_on(async {
            let output = future.await;
            tokio::task::yield_now().await;
            output
        })
    }

    /// A handle for spawning onto the runtime. Its tasks run only while some thread drives
    /// the runtime (a caller of [`Self::block_on`] or the idle driver).
    pub fn handle(&self) -> &tokio::runtime::Handle {
        self.runtime().handle()
    }

    /// Enters the runtime's context, for constructors that spawn their tasks where they are
    /// called ([`crate::QuicTransport::bind`]).
    pub fn enter(&self) -> tokio::runtime::EnterGuard<'_> {
        self.runtime().enter()
    }
}

impl Drop for EndpointRuntime {
    fn drop(&mut self) {
        self.idle.stop.store(true, Ordering::SeqCst);
        self.idle.give_back.notify_one();
        if let Some(driver) = self.idle_driver.take() {
            driver.thread().unpark();
            let _ = driver.join();
        }
        // `shutdown_background` may run inside another runtime's task, unlike a plain drop.
        if let Some(runtime) = self.runtime.take().and_then(|r| Arc::try_unwrap(r).ok()) {
            runtime.shutdown_background();
        }
    }
}

/// What the idle driver does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum IdleMove {
    /// Look again after this long: a caller drives the runtime, or the endpoint has not been
    /// left alone for [`EndpointRuntime::IDLE_AFTER`] yet.
    LookAgainIn(Duration),
    /// Take the runtime over until a caller asks for it back.
    TakeOver,
}

/// The idle driver's decision (its I/O-free core): `callers` inside `block_on` now, the last
/// one left at `last_left` and it is `now` (nanoseconds on the runtime's clock). The caller
/// reads the clock; this only decides, so its timing is tested without sleeping.
fn next_move(callers: usize, last_left: u64, now: u64) -> IdleMove {
    if callers > 0 {
        // A caller drives the runtime for as long as it waits, however long that is.
        return IdleMove::LookAgainIn(EndpointRuntime::IDLE_AFTER);
    }
    let quiet = Duration::from_nanos(now.saturating_sub(last_left));
    match EndpointRuntime::IDLE_AFTER.checked_sub(quiet) {
        Some(left) if !left.is_zero() => IdleMove::LookAgainIn(left),
        _ => IdleMove::TakeOver,
    }
}

/// The idle driver: takes the runtime over once nobody has called for [`IDLE_AFTER`], until a
/// caller arrives.
///
/// [`IDLE_AFTER`]: EndpointRuntime::IDLE_AFTER
fn drive_while_idle(runtime: &tokio::runtime::Runtime, idle: &IdleState) {
    while !idle.stop.load(Ordering::SeqCst) {
        idle.rounds.fetch_add(1, Ordering::Relaxed);
        let callers = idle.callers.load(Ordering::SeqCst);
        let last_left = idle.last_left.load(Ordering::Relaxed);
        if let IdleMove::LookAgainIn(wait) = next_move(callers, last_left, idle.now()) {
            std::thread::park_timeout(wait);
            continue;
        }
        idle.driving.store(true, Ordering::SeqCst);
        // A caller that arrived before `driving` was set did not ask for the runtime back:
        // look again now that it is set (either this sees the caller or the caller sees it).
        if idle.callers.load(Ordering::SeqCst) == 0 && !idle.stop.load(Ordering::SeqCst) {
            runtime.block_on(idle.give_back.notified());
        }
        idle.driving.store(false, Ordering::SeqCst);
        idle.last_left.store(idle.now(), Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    /// The decision at given times, no clock read: a caller present defers a whole period;
    /// otherwise the driver waits out exactly what is left of the quiet period (counted from
    /// the last caller's departure) and takes over at its end or after, never before.
    #[test]
    fn the_idle_driver_takes_over_exactly_when_the_endpoint_has_been_quiet_long_enough() {
        let after = EndpointRuntime::IDLE_AFTER;
        assert_eq!(next_move(1, 0, 10_000 * MS), IdleMove::LookAgainIn(after));
        assert_eq!(next_move(3, 5 * MS, 5 * MS), IdleMove::LookAgainIn(after));
        let left = 1_000 * MS;
        assert_eq!(next_move(0, left, left), IdleMove::LookAgainIn(after));
        assert_eq!(
            next_move(0, left, left + 7 * MS),
            IdleMove::LookAgainIn(after - Duration::from_millis(7))
        );
        assert_eq!(
            next_move(0, left, left + after.as_nanos() as u64 - 1),
            IdleMove::LookAgainIn(Duration::from_nanos(1))
        );
        assert_eq!(
            next_move(0, left, left + after.as_nanos() as u64),
            IdleMove::TakeOver
        );
        assert_eq!(next_move(0, left, left + 60_000 * MS), IdleMove::TakeOver);
        // A departure stamped after `now` (another thread's clock read raced this one) is
        // a fresh departure, not an underflow.
        assert_eq!(next_move(0, left + MS, left), IdleMove::LookAgainIn(after));
    }

    #[test]
    fn spawned_tasks_run_while_nobody_calls() {
        let runtime = EndpointRuntime::new("test-idle").expect("runtime");
        let (tx, rx) = std::sync::mpsc::channel();
        runtime.handle().spawn(async move {
            tokio::time::sleep(Duration::from_millis(5)).await;
            let _ = tx.send(42);
        });
        // Nobody calls block_on: only the idle driver can run the task and its timer.
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)), Ok(42));
    }

    #[test]
    fn callers_take_the_runtime_back_from_the_idle_driver() {
        let runtime = EndpointRuntime::new("test-back").expect("runtime");
        let mut taken_over = 0;
        for round in 0..20u64 {
            // Long enough for the idle driver to take over between calls.
            std::thread::sleep(EndpointRuntime::IDLE_AFTER * 2);
            taken_over += u32::from(runtime.idle.driving.load(Ordering::SeqCst));
            let started = Instant::now();
            let idle = &runtime.idle;
            let (value, handed_back) = runtime.block_on(async move {
                // The caller's arrival asks for the runtime back: wait until the driver let go.
                while idle.driving.load(Ordering::SeqCst) {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                (round, started.elapsed())
            });
            assert_eq!(value, round);
            // Designed to be at once; ten idle periods leave room for a loaded machine's
            // scheduler, not for a driver that waits out a period or a timer of its own.
            assert!(
                handed_back < EndpointRuntime::IDLE_AFTER * 10,
                "the idle driver held the runtime for {handed_back:?} after a caller came"
            );
        }
        // The case under test happened: the driver had the runtime when most calls came.
        assert!(
            taken_over >= 10,
            "the idle driver took over {taken_over} times of 20"
        );
    }

    #[test]
    fn a_caller_whose_future_panics_leaves_the_runtime_to_the_idle_driver() {
        let runtime = EndpointRuntime::new("test-panic").expect("runtime");
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            runtime.block_on(async { panic!("a future that panics inside block_on") })
        }));
        assert!(unwound.is_err());
        assert_eq!(runtime.idle.callers.load(Ordering::SeqCst), 0);
        // Nobody calls now: the idle driver must take over and run the endpoint's tasks.
        let (tx, rx) = std::sync::mpsc::channel();
        runtime.handle().spawn(async move {
            tokio::time::sleep(Duration::from_millis(5)).await;
            let _ = tx.send(7);
        });
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)), Ok(7));
    }

    #[test]
    fn the_idle_driver_sleeps_while_a_caller_waits_long() {
        let runtime = EndpointRuntime::new("test-sleep").expect("runtime");
        let before = runtime.idle.rounds.load(Ordering::Relaxed);
        // Ten idle periods long: a driver that looked again at once would count millions.
        runtime.block_on(async { tokio::time::sleep(EndpointRuntime::IDLE_AFTER * 10).await });
        let looked = runtime.idle.rounds.load(Ordering::Relaxed) - before;
        assert!(looked <= 30, "the idle driver looked {looked} times");
        // And while nobody calls at all, it drives the runtime instead of polling.
        std::thread::sleep(EndpointRuntime::IDLE_AFTER * 10);
        let looked = runtime.idle.rounds.load(Ordering::Relaxed) - before;
        assert!(looked <= 40, "the idle driver looked {looked} times");
    }

    #[test]
    fn several_threads_wait_on_one_runtime() {
        let runtime = EndpointRuntime::new("test-many").expect("runtime");
        let notify = Arc::new(Notify::new());
        let waiters: Vec<_> = (0..3)
            .map(|i| {
                let (runtime, notify) = (runtime.clone(), notify.clone());
                std::thread::spawn(move || {
                    runtime.block_on(async {
                        notify.notified().await;
                        i
                    })
                })
            })
            .collect();
        // The waiters' futures are woken by a task that one of them (or the idle driver) runs.
        let notifier = notify.clone();
        runtime.handle().spawn(async move {
            for _ in 0..3 {
                tokio::time::sleep(Duration::from_millis(2)).await;
                notifier.notify_one();
            }
        });
        let mut got: Vec<i32> = waiters
            .into_iter()
            .map(|w| w.join().expect("waiter"))
            .collect();
        got.sort();
        assert_eq!(got, vec![0, 1, 2]);
    }

    #[test]
    fn flushing_runs_the_tasks_the_future_woke() {
        let runtime = EndpointRuntime::new("test-flush").expect("runtime");
        let notify = Arc::new(Notify::new());
        let (tx, rx) = std::sync::mpsc::channel();
        let waiter = notify.clone();
        runtime.block_on(async move {
            tokio::spawn(async move {
                waiter.notified().await;
                let _ = tx.send(());
            });
        });
        runtime.block_on_then_flush(async { notify.notify_one() });
        // The woken task ran before block_on_then_flush returned, not later on the idle driver.
        assert_eq!(rx.try_recv(), Ok(()));
    }

    #[test]
    fn dropping_inside_another_runtime_does_not_panic() {
        let runtime = EndpointRuntime::new("test-drop").expect("runtime");
        let outer = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("outer");
        outer.block_on(async move { drop(runtime) });
    }
}
