//! Process-wide settings every afd entry point applies first.

/// Fixes the compute thread count in the environment, once.
///
/// candle (attention's small matmuls) asks the OS how many cores there are on every matmul
/// unless `RAYON_NUM_THREADS` is set, which reads `/proc/cpuinfo` each time: at batch 32 that
/// is hundreds of reads per step. Setting the variable once at start-up removes the cost.
///
/// # Safety
/// Call it before any other thread exists (first thing in `main`): it writes the environment.
pub unsafe fn pin_thread_count() {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        // SAFETY: the caller guarantees this process has no other thread yet.
        unsafe { std::env::set_var("RAYON_NUM_THREADS", n.to_string()) };
    }
}
