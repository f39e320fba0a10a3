//! Where the node's tensor work runs.
//!
//! candle and the model kernels split their loops over rayon's current pool. Called from a
//! thread outside any pool, every such loop is handed to the global pool's threads and waited
//! for, a cross-thread round trip per kernel: at batch 1 on a small model that is a third of a
//! decode step. [`on_own_pool`] makes the stepping thread itself a worker of a pool, so the
//! loops start where they are called and the other workers (if any) join in.

use std::cell::OnceCell;

thread_local! {
    /// This thread's own pool, once made. rayon cannot release a thread from a pool it joined,
    /// so the pool lives as long as the thread and every later call reuses it.
    static OWN_POOL: OnceCell<Option<rayon::ThreadPool>> = const { OnceCell::new() };
}

/// Runs `f` with the calling thread as worker 0 of a compute pool of its own, as wide as the
/// process's default pool (`RAYON_NUM_THREADS`); the pool is made on the first call and kept
/// for the thread's life. A thread that already belongs to another pool (or a pool that cannot
/// be built) runs `f` where it is.
pub fn on_own_pool<R: Send>(name: &str, f: impl FnOnce() -> R + Send) -> R {
    OWN_POOL.with(|cell| {
        let pool = cell.get_or_init(|| {
            if rayon::current_thread_index().is_some() {
                return None;
            }
            let prefix = name.to_string();
            rayon::ThreadPoolBuilder::new()
                .num_threads(rayon::current_num_threads())
                .use_current_thread()
                .thread_name(move |i| format!("{prefix}-{i}"))
                .build()
                .inspect_err(|e| {
                    tracing::warn!(error = %e, "no compute pool of its own; using the shared one")
                })
                .ok()
        });
        match pool {
            Some(pool) => pool.install(f),
            None => f(),
        }
    })
}

/// Runs `f` on `pool` while the calling thread sleeps until it is done (a thread of `pool`
/// itself runs `f` where it is).
///
/// `pool.install` from a worker of another pool (the stepping thread is worker 0 of its own,
/// see [`on_own_pool`]) keeps the caller looking for work, through `sched_yield`, while it
/// waits: a third thread taking turns with the pool's workers on CPUs the pool already fills.
/// Here the caller blocks on a channel for the outcome instead. The medium Mixtral served on 2
/// cards of a 2-CPU host, whose attention runs on such a pool: 12.4-13.2 against 12.6-15.1 ms a
/// token at c=1 (four runs each, alternated), with about 40% fewer context switches.
pub fn run_on_sleeping<R: Send>(pool: &rayon::ThreadPool, f: impl FnOnce() -> R + Send) -> R {
    if pool.current_thread_index().is_some() {
        // Its own work queued behind a sleeping worker could wait for it forever.
        return f();
    }
    let (sender, receiver) = std::sync::mpsc::sync_channel(1);
    let outcome = pool.in_place_scope(|scope| {
        scope.spawn(move |_| {
            // Caught, so that the waiting caller always hears back; re-raised there. The
            // receiver waits below, so the send cannot fail.
            let _ = sender.send(std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)));
        });
        receiver.recv()
    });
    match outcome.expect("the spawned job always sends its outcome") {
        Ok(value) => value,
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_caller_is_worker_zero_every_time() {
        let caller = std::thread::current().id();
        for _ in 0..2 {
            let (inside, index) = on_own_pool("test-compute", || {
                (std::thread::current().id(), rayon::current_thread_index())
            });
            assert_eq!(inside, caller);
            assert_eq!(index, Some(0));
        }
        // Parallel work started here completes (on this pool's workers).
        let sum: u64 = on_own_pool("test-compute", || {
            use rayon::prelude::*;
            (0..1000u64).into_par_iter().sum()
        });
        assert_eq!(sum, 499_500);
    }

    #[test]
    fn a_thread_of_another_pool_runs_where_it_is() {
        let other = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let (ran, made_own) = other.install(|| {
            let ran = on_own_pool("test-compute", || true);
            (ran, OWN_POOL.with(|c| c.get().map(Option::is_some)))
        });
        assert!(ran);
        assert_eq!(made_own, Some(false));
    }

    #[test]
    fn work_run_while_sleeping_runs_on_the_pool_and_returns_or_panics_back() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .thread_name(|i| format!("test-sleeping-{i}"))
            .build()
            .unwrap();
        // From a worker of another pool, as the stepping thread calls it.
        let (name, sum) = on_own_pool("test-caller", || {
            run_on_sleeping(&pool, || {
                use rayon::prelude::*;
                let name = std::thread::current().name().map(str::to_string);
                (name, (0..1000u64).into_par_iter().sum::<u64>())
            })
        });
        assert!(name.is_some_and(|n| n.starts_with("test-sleeping-")));
        assert_eq!(sum, 499_500);
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            run_on_sleeping(&pool, || -> u32 { panic!("in the pool") })
        }));
        assert!(caught.is_err(), "the pool's panic reaches the caller");
        // The pool still works after a panic, and from its own threads.
        assert_eq!(run_on_sleeping(&pool, || 7), 7);
        let one = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        assert_eq!(one.install(|| run_on_sleeping(&one, || 8)), 8);
    }
}
