//! How the threads that compute a simulated card sit on the host's CPUs: pinned to a CPU (for
//! a whole run with a CPU mask, or for one turn of [`crate::service::CpuTurns`]), and run as
//! batch work, so that waking one never preempts the thread that woke it.
//!
//! The scheduling policy and the pinning for a turn are Linux's; elsewhere those calls do
//! nothing, and the threads run where and when the OS chooses, with the same results.

/// A thread's CPUs before it was pinned.
#[derive(Debug)]
pub struct Saved {
    #[cfg(target_os = "linux")]
    set: libc::cpu_set_t,
}

/// The CPUs this thread may run on, in order.
pub fn allowed_cpus() -> Vec<usize> {
    core_affinity::get_core_ids()
        .unwrap_or_default()
        .iter()
        .map(|c| c.id)
        .collect()
}

/// Pins the calling thread to the `index`-th CPU of `mask` (cycling); nothing when `mask` is 0
/// or the OS refuses.
pub fn pin_to_mask(mask: u64, index: usize) {
    let cpus: Vec<usize> = (0..64).filter(|b| mask & (1u64 << b) != 0).collect();
    if cpus.is_empty() {
        return;
    }
    let id = cpus[index % cpus.len()];
    if !core_affinity::set_for_current(core_affinity::CoreId { id }) {
        tracing::warn!(cpu = id, "could not pin a thread to its CPU");
    }
}

/// Runs the calling thread as batch work (Linux's `SCHED_BATCH`): the scheduler gives it the
/// same share of the CPU, but waking it never preempts the thread that runs there. A card's
/// threads are woken by the attention node's stepping thread as each of its messages lands;
/// where cards share the node's CPUs, the woken worker used to take the stepping thread's CPU
/// before the layer's other messages were sent, so they went out only after that card's whole
/// multiply (GPT-OSS-20B on 8 cards, served at one request: the stepping thread runnable but
/// not running for 123 ms of every second). A thread the OS refuses it runs as before.
#[cfg(target_os = "linux")]
pub fn run_as_batch_work() {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: pid 0 is the calling thread; `param` is a valid sched_param for SCHED_BATCH,
    // whose priority must be 0. No privilege is needed to choose it.
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) } != 0 {
        tracing::debug!(
            "the OS refused SCHED_BATCH for a card thread ({}): it runs under the default policy",
            std::io::Error::last_os_error()
        );
    }
}

#[cfg(not(target_os = "linux"))]
pub fn run_as_batch_work() {}

/// The CPU this thread runs on now, where the OS says.
#[cfg(target_os = "linux")]
pub fn current_cpu() -> Option<usize> {
    // SAFETY: no arguments; returns -1 on failure.
    usize::try_from(unsafe { libc::sched_getcpu() }).ok()
}

#[cfg(not(target_os = "linux"))]
pub fn current_cpu() -> Option<usize> {
    None
}

/// Pins this thread to `cpu`, returning its CPUs before; `None` if the OS refused.
#[cfg(target_os = "linux")]
pub fn pin_current(cpu: usize) -> Option<Saved> {
    let size = std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: both sets are plain bit sets sized as passed; CPU_SET checks `cpu`'s range.
    unsafe {
        let mut before: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, size, &mut before) != 0 {
            return None;
        }
        let mut one: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut one);
        if libc::sched_setaffinity(0, size, &one) != 0 {
            return None;
        }
        Some(Saved { set: before })
    }
}

#[cfg(not(target_os = "linux"))]
pub fn pin_current(_cpu: usize) -> Option<Saved> {
    None
}

impl Saved {
    /// Lets the thread run where it could before.
    #[cfg(target_os = "linux")]
    pub fn restore(self) {
        let size = std::mem::size_of::<libc::cpu_set_t>();
        // SAFETY: the set came from sched_getaffinity with the same size.
        if unsafe { libc::sched_setaffinity(0, size, &self.set) } != 0 {
            tracing::warn!("could not give a card thread its CPUs back after a turn");
        }
    }

    #[cfg(not(target_os = "linux"))]
    pub fn restore(self) {}
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// The calling thread's scheduling policy.
    fn policy() -> i32 {
        // SAFETY: pid 0 is the calling thread; the call only reads its policy.
        unsafe { libc::sched_getscheduler(0) }
    }

    #[test]
    fn a_card_thread_runs_as_batch_work_and_its_threads_inherit_it() {
        let before = policy();
        std::thread::spawn(|| {
            run_as_batch_work();
            assert_eq!(
                policy(),
                libc::SCHED_BATCH,
                "an unprivileged thread may choose it"
            );
            // A pool the worker starts (more executor threads) is batch work too.
            let child = std::thread::spawn(policy).join().expect("the child runs");
            assert_eq!(child, libc::SCHED_BATCH);
        })
        .join()
        .expect("the assertions hold");
        assert_eq!(policy(), before, "only the thread that asked changed");
    }
}
