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

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use jetstream::CompletionProbe;

use crate::executor::ExecOptions;

/// How often a waiting worker checks whether it should stop.
const POLL: Duration = Duration::from_millis(200);

/// The CPUs shared by a process's card workers; see the module docs.
#[derive(Debug)]
pub struct CpuTurns {
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Debug)]
struct State {
    /// Turns not taken (one per CPU).
    free: usize,
    members: Vec<Member>,
    next_id: u64,
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
}

impl CpuTurns {
    /// Turns for `cpus` CPUs (at least 1).
    pub fn new(cpus: usize) -> Arc<Self> {
        Arc::new(CpuTurns {
            state: Mutex::new(State {
                free: cpus.max(1),
                members: Vec::new(),
                next_id: 0,
            }),
            changed: Condvar::new(),
        })
    }

    /// Turns for cards of `exec.threads` executor threads each (0: every core) on the CPUs
    /// of `exec.cpu_mask` (0: every CPU of the host): one turn per whole card's worth.
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
        state.members.push(Member {
            id,
            inbox,
            waiting: None,
            running: false,
        });
        TurnMember {
            turns: self.clone(),
            id,
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
        older_ready < self.free
    }

    fn member(&mut self, id: u64) -> Option<&mut Member> {
        self.members.iter_mut().find(|m| m.id == id)
    }
}

/// One worker's membership; leaving (drop) lets the others stop waiting for its inbox.
#[derive(Debug)]
pub struct TurnMember {
    turns: Arc<CpuTurns>,
    id: u64,
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
                turns.changed.notify_all();
                return None;
            }
            // A timeout also re-reads the other inboxes: a message that lands elsewhere only
            // ever makes this worker wait longer, so nothing needs to wake it then.
            state = turns
                .changed
                .wait_timeout(state, POLL)
                .map(|(s, _)| s)
                .unwrap_or_else(|p| p.into_inner().0);
        }
        state.free -= 1;
        if let Some(m) = state.member(self.id) {
            m.waiting = None;
            m.running = true;
        }
        // Others may now be next in line.
        turns.changed.notify_all();
        Some(Turn { member: self })
    }
}

impl Drop for TurnMember {
    fn drop(&mut self) {
        let mut state = self.turns.lock();
        state.members.retain(|m| m.id != self.id);
        self.turns.changed.notify_all();
    }
}

/// A CPU held for one message's compute; given back on drop.
#[derive(Debug)]
pub struct Turn<'a> {
    member: &'a TurnMember,
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        let turns = &self.member.turns;
        let mut state = turns.lock();
        state.free += 1;
        if let Some(m) = state.member(self.member.id) {
            m.running = false;
        }
        turns.changed.notify_all();
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
