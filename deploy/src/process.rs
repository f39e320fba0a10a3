//! Process-wide settings every afd entry point applies first.

/// The attention side's compute threads (candle and the model kernels) when the cards of this
/// process use `card_threads` threads in all: `requested` when it is not 0, else the cores the
/// cards leave free, at least one.
///
/// On a real deployment the attention node is a GPU and the cards are cards; simulated in one
/// process they share the host's cores, and a compute pool as wide as the machine would spin
/// on the very cores the cards are computing on (at batch 64 on 2 cores that costs a fifth of
/// the throughput). Disjoint shares keep the two sides from stealing each other's time.
pub fn attention_threads(requested: usize, card_threads: usize) -> usize {
    if requested > 0 {
        return requested;
    }
    cores().saturating_sub(card_threads).max(1)
}

/// Cores this process may use.
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Fixes the compute thread count in the environment (`RAYON_NUM_THREADS`), once; `0` means
/// every core. A value the user set is kept.
///
/// Besides sizing the pool, this removes a cost: candle asks the OS how many cores there are on
/// every matmul unless the variable is set, which reads `/proc/cpuinfo` each time (hundreds of
/// reads per step at batch 32).
///
/// # Safety
/// Call it before any other thread exists (first thing in `main`): it writes the environment.
pub unsafe fn set_compute_threads(threads: usize) {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let n = if threads == 0 { cores() } else { threads };
        // SAFETY: the caller guarantees this process has no other thread yet.
        unsafe { std::env::set_var("RAYON_NUM_THREADS", n.to_string()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_threads_take_what_the_cards_leave() {
        assert_eq!(attention_threads(3, 100), 3);
        assert_eq!(attention_threads(0, usize::MAX), 1);
        assert_eq!(attention_threads(0, 0), cores());
        if cores() > 1 {
            assert_eq!(attention_threads(0, 1), cores() - 1);
        }
    }
}
