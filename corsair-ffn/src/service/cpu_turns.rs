//! Turns on the CPUs that several simulated cards of one process share, served in the order
//! their work landed.
//!
//! Real cards compute side by side, so the work dispatched first finishes first on every card.
//! When a small host runs more card workers than it has CPUs, the OS scheduler instead lets a
//! worker that just finished one message run straight on into its next, ahead of older
//! messages other workers have not yet been scheduled to pick up. In the micro-batched
//! pipeline that delays every card's reply for the first micro-batch until nearly the whole
//! layer is done, and the cards then sit idle while the attention node catches up. Taking
//! turns in landing order (JetStream's receive timestamps) restores the devices' order.
//!
//! Where each turn is one CPU, a worker runs its turn pinned to that turn's CPU. This guest's
//! scheduler packs waking threads onto fewer vCPUs after idle spells (`sched_vcpu_pack`), so two
//! workers holding the two turns of a 2-CPU host were often time-sliced on one vCPU while the
//! other sat idle; pinned, they compute side by side, as two cards would. A worker takes the
//! free turn of the CPU it already runs on where there is one, so pinning moves it only when
//! that CPU is taken (the medium Mixtral served on 2 cards: 270 against 2,900 migrations in
//! 6 s).
//!
//! A turn given back wakes only the workers that may now start, each on its own condition
//! variable. Waking every waiting worker instead had each of them preempt a computing card on
//! its way back to sleep: several times a message at a batch of 4 on two CPUs.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use jetstream::CompletionProbe;

use crate::executor::ExecOptions;
use crate::host_cpus;

/// How often a waiting worker checks whether it should stop.
const POLL: Duration = Duration::from_millis(200);

/// The CPUs shared by a process's card workers; see the module docs.
#[derive(Debug)]
pub struct CpuTurns {
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    /// One turn per CPU.
    turns: Vec<TurnSlot>,
    members: Vec<Member>,
    next_id: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct TurnSlot {
    /// The CPU a worker computing in this turn is pinned to (none: the OS chooses).
    cpu: Option<usize>,
    /// Whether a worker holds it.
    taken: bool,
}

#[derive(Debug)]
struct Member {
    id: u64,
    /// The member's inbox, for messages it has not picked up yet.
    inbox: CompletionProbe,
    /// Landing time of the message it picked up and waits to compute.
    waiting: Option<Instant>,
    /// Whether it holds a turn.
    running: bool,
    /// Signalled when this member may start (it waits on it with the state's lock).
    wake: Arc<Condvar>,
    /// Times it was signalled (what the wake-up tests count).
    woken: u64,
}

impl CpuTurns {
    /// Turns for `cpus` CPUs (at least 1), the OS choosing where each runs.
    pub fn new(cpus: usize) -> Arc<Self> {
        Self::with_turns(vec![None; cpus.max(1)])
    }

    /// One turn per CPU of `cpus`, each computed pinned to its CPU (none: one unpinned turn).
    pub fn pinned(cpus: Vec<usize>) -> Arc<Self> {
        if cpus.is_empty() {
            return Self::new(1);
        }
        Self::with_turns(cpus.into_iter().map(Some).collect())
    }

    fn with_turns(cpus: Vec<Option<usize>>) -> Arc<Self> {
        let turns = cpus
            .into_iter()
            .map(|cpu| TurnSlot { cpu, taken: false })
            .collect();
        Arc::new(CpuTurns {
            state: Mutex::new(State {
                turns,
                members: Vec::new(),
                next_id: 0,
            }),
        })
    }

    /// Turns for cards of `exec.threads` executor threads each (0: every core) on the CPUs
    /// of `exec.cpu_mask` (0: every CPU of the host): one turn per whole card's worth.
    /// Cards of one thread each are pinned to their turn's CPU (see the module docs).
    pub fn for_cards(exec: &ExecOptions) -> Arc<Self> {
        let host = std::thread::available_parallelism().map_or(1, |n| n.get());
        let cpus = match exec.cpu_mask.count_ones() {
            0 => host,
            n => n as usize,
        };
        let per_card = match exec.threads {
            0 => cpus,
            n => n,
        };
        if per_card == 1 {
            let usable: Vec<usize> = host_cpus::allowed_cpus()
                .into_iter()
                .filter(|&c| exec.cpu_mask == 0 || (c < 64 && exec.cpu_mask & (1 << c) != 0))
                .collect();
            if usable.len() == cpus {
                return Self::pinned(usable);
            }
        }
        Self::new(cpus / per_card)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every critical section leaves the state whole, so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Joins a worker whose messages land in the region behind `inbox`.
    pub fn join(self: &Arc<Self>, inbox: CompletionProbe) -> TurnMember {
        let mut state = self.lock();
        let id = state.next_id;
        state.next_id += 1;
        let wake = Arc::new(Condvar::new());
        state.members.push(Member {
            id,
            inbox,
            waiting: None,
            running: false,
            wake: wake.clone(),
            woken: 0,
        });
        TurnMember {
            turns: self.clone(),
            id,
            wake,
        }
    }
}

impl State {
    /// Whether member `id`, holding a message that landed at `landed`, goes next: fewer
    /// members than there are free CPUs have an older message ready to start (held while
    /// waiting for a turn, or queued in the inbox of a member not computing; ties go to the
    /// lower id). A member computing cannot take a free CPU, so its queued work does not
    /// hold others back.
    fn may_start(&self, id: u64, landed: Instant) -> bool {
        let older_ready = self
            .members
            .iter()
            .filter(|m| m.id != id && !m.running)
            .filter(|m| {
                let older = |t: Instant| t < landed || (t == landed && m.id < id);
                match m.waiting {
                    Some(t) => older(t),
                    None => m.inbox.oldest_landed().is_some_and(older),
                }
            })
            .count();
        older_ready < self.free()
    }

    /// Turns not taken.
    fn free(&self) -> usize {
        self.turns.iter().filter(|t| !t.taken).count()
    }

    fn member(&mut self, id: u64) -> Option<&mut Member> {
        self.members.iter_mut().find(|m| m.id == id)
    }

    /// Wakes the waiting members that may start now. Called wherever a CPU is freed or a
    /// waiting message goes away, the only changes that let another member start: a member
    /// taking a turn uses a CPU and leaves the queue ahead of the younger ones alike.
    fn wake_startable(&mut self) {
        let startable: Vec<u64> = self.startable().map(|m| m.id).collect();
        for m in self
            .members
            .iter_mut()
            .filter(|m| startable.contains(&m.id))
        {
            m.woken += 1;
            m.wake.notify_one();
        }
    }

    /// The waiting members that may start now.
    fn startable(&self) -> impl Iterator<Item = &Member> {
        self.members.iter().filter(|m| match m.waiting {
            Some(landed) => !m.running && self.may_start(m.id, landed),
            None => false,
        })
    }
}

/// One worker's membership; leaving (drop) lets the others stop waiting for its inbox.
#[derive(Debug)]
pub struct TurnMember {
    turns: Arc<CpuTurns>,
    id: u64,
    /// The member's own condition variable (also in its `Member`).
    wake: Arc<Condvar>,
}

impl TurnMember {
    /// Waits for this worker's turn to compute a message that landed at `landed`; `None` when
    /// `stop` was raised meanwhile.
    pub fn wait(&self, landed: Instant, stop: &AtomicBool) -> Option<Turn<'_>> {
        let turns = &self.turns;
        let mut state = turns.lock();
        if let Some(m) = state.member(self.id) {
            m.waiting = Some(landed);
        }
        while !state.may_start(self.id, landed) {
            if stop.load(Ordering::SeqCst) {
                if let Some(m) = state.member(self.id) {
                    m.waiting = None;
                }
                // Younger messages may have waited behind this one.
                state.wake_startable();
                return None;
            }
            // A timeout also re-reads the other inboxes: a message that lands elsewhere only
            // ever makes this worker wait longer, so nothing needs to wake it then.
            state = self
                .wake
                .wait_timeout(state, POLL)
                .map(|(s, _)| s)
                .unwrap_or_else(|p| p.into_inner().0);
        }
        if let Some(m) = state.member(self.id) {
            m.waiting = None;
            m.running = true;
        }
        // `may_start` saw a free turn. The one on this thread's CPU, where there is one: the
        // two workers of a 2-CPU host, woken each on the other's turn CPU, would otherwise
        // both be migrated before their first multiply.
        let here = host_cpus::current_cpu();
        let slot = state
            .turns
            .iter()
            .position(|t| !t.taken && here.is_some_and(|c| t.cpu == Some(c)))
            .or_else(|| state.turns.iter().position(|t| !t.taken));
        let cpu = slot.and_then(|i| {
            state.turns[i].taken = true;
            state.turns[i].cpu
        });
        drop(state);
        let pinned = cpu.and_then(host_cpus::pin_current);
        Some(Turn {
            member: self,
            slot,
            pinned,
        })
    }

    /// Tells the others that this worker picked up a message that takes no turn: it no longer
    /// sits in the inbox ahead of theirs, so one of them may start now.
    pub fn pass(&self) {
        self.turns.lock().wake_startable();
    }
}

impl Drop for TurnMember {
    fn drop(&mut self) {
        let mut state = self.turns.lock();
        state.members.retain(|m| m.id != self.id);
        state.wake_startable();
    }
}

/// A CPU held for one message's compute; given back on drop.
#[derive(Debug)]
pub struct Turn<'a> {
    member: &'a TurnMember,
    /// Which turn it holds.
    slot: Option<usize>,
    /// The worker's CPUs before it was pinned, put back with the turn.
    pinned: Option<host_cpus::Saved>,
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        if let Some(saved) = self.pinned.take() {
            saved.restore();
        }
        let turns = &self.member.turns;
        let mut state = turns.lock();
        if let Some(turn) = self.slot.and_then(|i| state.turns.get_mut(i)) {
            turn.taken = false;
        }
        if let Some(m) = state.member(self.member.id) {
            m.running = false;
        }
        state.wake_startable();
    }
}

#[cfg(test)]
mod tests {
    use jetstream::{InprocFabric, InprocTransport, Region, RegionConfig, Transport, WriteRequest};

    use super::*;

    /// How long a worker that must wait is watched to see that it does.
    const BLOCKED: Duration = Duration::from_millis(150);
    const WAIT: Duration = Duration::from_secs(10);

    struct Fixture {
        runtime: tokio::runtime::Runtime,
        node: InprocTransport,
        _cards: InprocTransport,
        inboxes: Vec<Region>,
    }

    /// `cards` inboxes on one card endpoint, written by the endpoint `node`.
    fn fixture(cards: usize) -> Fixture {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        let fabric = InprocFabric::new();
        let node = fabric.endpoint("node").expect("node endpoint");
        let card = fabric.endpoint("cards").expect("card endpoint");
        let inboxes = (0..cards)
            .map(|_| {
                card.register(RegionConfig::new(64).grant("node"))
                    .expect("inbox")
            })
            .collect();
        Fixture {
            runtime,
            node,
            _cards: card,
            inboxes,
        }
    }

    impl Fixture {
        /// Lands one message in inbox `i`; its completion stays queued there.
        fn land(&self, i: usize) {
            let to = self.inboxes[i].descriptor();
            let write = WriteRequest::new(&to, 0, bytes::Bytes::from_static(&[1; 8]));
            self.runtime
                .block_on(async { self.node.post_write(write).await?.wait().await })
                .expect("the write lands");
        }

        /// Picks up inbox `i`'s oldest message, as its worker would: when it landed.
        fn pick_up(&self, i: usize) -> Instant {
            self.inboxes[i]
                .next_completion_blocking(WAIT)
                .expect("a queued message")
                .landed
        }

        /// One member per inbox.
        fn members(&self, turns: &Arc<CpuTurns>) -> Vec<TurnMember> {
            self.inboxes.iter().map(|r| turns.join(r.probe())).collect()
        }

        /// Lands a message in inbox 0 and waits, on this thread, for `member`'s turn to
        /// compute it.
        fn turn_here<'m>(&self, member: &'m TurnMember) -> Turn<'m> {
            self.land(0);
            let landed = self.pick_up(0);
            member
                .wait(landed, &AtomicBool::new(false))
                .expect("a turn")
        }
    }

    /// `member`'s turn for a message that landed at `landed`, waited for on another thread
    /// while `meanwhile` runs; `None` if none came within `limit` (the wait is then stopped, so
    /// a test fails rather than hangs).
    fn turn_within<'m>(
        member: &'m TurnMember,
        landed: Instant,
        limit: Duration,
        meanwhile: impl FnOnce(),
    ) -> Option<Turn<'m>> {
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            let waiter = s.spawn(|| member.wait(landed, &stop));
            meanwhile();
            let deadline = Instant::now() + limit;
            while !waiter.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
            stop.store(true, Ordering::SeqCst);
            waiter.join().expect("the waiter does not panic")
        })
    }

    #[test]
    fn the_oldest_message_goes_first_on_one_cpu() {
        let f = fixture(2);
        let turns = CpuTurns::new(1);
        let m = f.members(&turns);
        // Card 1's message lands first, card 0's second.
        f.land(1);
        f.land(0);
        let late = f.pick_up(0);
        // Card 0 waits for card 1's older message, although card 1 has not picked it up yet.
        assert!(
            turn_within(&m[0], late, BLOCKED, || ()).is_none(),
            "card 0 went first"
        );
        let early = f.pick_up(1);
        assert!(early <= late);
        let held = turn_within(&m[1], early, WAIT, || ()).expect("the oldest goes");
        // One CPU: card 0 waits until card 1 gives its turn back, and is woken then.
        assert!(
            turn_within(&m[0], late, BLOCKED, || ()).is_none(),
            "two turns on one CPU"
        );
        let given_back = move || {
            std::thread::sleep(BLOCKED);
            drop(held);
        };
        assert!(turn_within(&m[0], late, WAIT, given_back).is_some());
    }

    #[test]
    fn a_turn_given_back_wakes_only_the_oldest_waiting() {
        let f = fixture(3);
        let turns = CpuTurns::new(2);
        let m = f.members(&turns);
        let set_free = |state: &mut State, free: usize| {
            for (i, t) in state.turns.iter_mut().enumerate() {
                t.taken = i >= free;
            }
        };
        for i in 0..3 {
            f.land(i);
        }
        let landed: Vec<Instant> = (0..3).map(|i| f.pick_up(i)).collect();
        let ids = |state: &State| state.startable().map(|m| m.id).collect::<Vec<_>>();
        let woken = |state: &State| state.members.iter().map(|m| m.woken).collect::<Vec<_>>();
        {
            let mut state = turns.lock();
            for (i, t) in landed.iter().enumerate() {
                let member = state.member(m[i].id).expect("a member");
                member.waiting = Some(*t);
            }
            // Card 0 computes; the other two wait, and nobody may start on the one CPU.
            let first = state.member(m[0].id).expect("a member");
            first.waiting = None;
            first.running = true;
            set_free(&mut state, 0);
            assert_eq!(ids(&state), Vec::<u64>::new());
            state.wake_startable();
            assert_eq!(
                woken(&state),
                vec![0, 0, 0],
                "no CPU free: nobody is signalled"
            );
            // Its turn given back, card 1 (landed before card 2) is the only one to wake:
            // only its condition variable is signalled, not every waiter's.
            let first = state.member(m[0].id).expect("a member");
            first.running = false;
            set_free(&mut state, 1);
            assert_eq!(ids(&state), vec![m[1].id]);
            state.wake_startable();
            assert_eq!(woken(&state), vec![0, 1, 0]);
            // With two CPUs free, both wake.
            set_free(&mut state, 2);
            assert_eq!(ids(&state), vec![m[1].id, m[2].id]);
            state.wake_startable();
            assert_eq!(woken(&state), vec![0, 2, 1]);
        }
        // A message queued in card 0's inbox after theirs holds neither back.
        f.land(0);
        let mut state = turns.lock();
        let queued = f.inboxes[0].probe().oldest_landed().expect("queued");
        assert!(queued >= landed[2], "landed after the others");
        set_free(&mut state, 1);
        assert_eq!(
            ids(&state),
            vec![m[1].id],
            "a younger queued message holds no one"
        );
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_pinned_turn_computes_on_its_cpu_and_gives_the_cpus_back() {
        let f = fixture(1);
        let before = host_cpus::allowed_cpus();
        let last = *before.last().expect("a CPU to run on");
        let turns = CpuTurns::pinned(vec![last]);
        let m = f.members(&turns);
        let turn = f.turn_here(&m[0]);
        assert_eq!(
            host_cpus::allowed_cpus(),
            vec![last],
            "pinned to the turn's CPU"
        );
        // SAFETY: sched_getcpu takes nothing and only reads the calling thread's CPU.
        assert_eq!(unsafe { libc::sched_getcpu() }, last as i32);
        let taken = |turns: &CpuTurns| {
            turns
                .lock()
                .turns
                .iter()
                .map(|t| t.taken)
                .collect::<Vec<_>>()
        };
        assert_eq!(taken(&turns), vec![true]);
        drop(turn);
        assert_eq!(host_cpus::allowed_cpus(), before, "the CPUs given back");
        assert_eq!(taken(&turns), vec![false]);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_worker_takes_the_free_turn_on_the_cpu_it_runs_on() {
        let f = fixture(1);
        let before = host_cpus::allowed_cpus();
        let here = *before.last().expect("a CPU to run on");
        // Another CPU listed first; on a 1-CPU host one that does not exist (pinning to it
        // fails, which only leaves the worker where it is).
        let other = before
            .iter()
            .copied()
            .find(|&c| c != here)
            .unwrap_or(here + 1);
        let settled = host_cpus::pin_current(here).expect("the test thread pinned");
        let turns = CpuTurns::pinned(vec![other, here]);
        let m = f.members(&turns);
        let turn = f.turn_here(&m[0]);
        assert_eq!(turn.slot, Some(1), "took the turn of another CPU");
        // SAFETY: sched_getcpu takes nothing and only reads the calling thread's CPU.
        assert_eq!(unsafe { libc::sched_getcpu() }, here as i32);
        drop(turn);
        settled.restore();
        assert_eq!(host_cpus::allowed_cpus(), before, "the CPUs given back");
    }

    #[test]
    fn as_many_turns_run_at_once_as_there_are_cpus() {
        let f = fixture(2);
        let turns = CpuTurns::new(2);
        let m = f.members(&turns);
        f.land(0);
        f.land(1);
        let (first, second) = (f.pick_up(0), f.pick_up(1));
        let one = turn_within(&m[0], first, WAIT, || ()).expect("a turn");
        let two = turn_within(&m[1], second, WAIT, || ()).expect("a second CPU");
        drop((one, two));
    }

    #[test]
    fn work_queued_behind_a_computing_card_does_not_hold_a_free_cpu() {
        let f = fixture(2);
        let turns = CpuTurns::new(2);
        let m = f.members(&turns);
        f.land(1);
        let first = f.pick_up(1);
        let computing = turn_within(&m[1], first, WAIT, || ()).expect("a turn");
        // Card 1 queues an older message than card 0's while it computes: only card 1 can
        // take it, and not before it is done, so card 0 takes the free CPU.
        f.land(1);
        f.land(0);
        let late = f.pick_up(0);
        assert!(
            turn_within(&m[0], late, WAIT, || ()).is_some(),
            "card 0 left a CPU idle"
        );
        drop(computing);
    }

    #[test]
    fn a_worker_that_leaves_or_a_stop_releases_the_waiting() {
        let f = fixture(2);
        let turns = CpuTurns::new(1);
        let waiting = turns.join(f.inboxes[0].probe());
        let gone = turns.join(f.inboxes[1].probe());
        f.land(1);
        f.land(0);
        let late = f.pick_up(0);
        // Kept waiting by an older message nobody takes, the worker gives up when stopped
        // (`turn_within` stops it at the limit: this returns rather than hangs).
        assert!(
            turn_within(&waiting, late, BLOCKED, || ()).is_none(),
            "went ahead of an older message"
        );
        // The worker holding the older message stops for good.
        assert!(
            turn_within(&waiting, late, WAIT, move || drop(gone)).is_some(),
            "still waiting for a worker that left"
        );
    }
}
