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
}
