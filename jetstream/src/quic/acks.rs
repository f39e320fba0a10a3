//! Delayed, piggybacked acknowledgments.
//!
//! Acknowledging every write in its own packet would double the packets of a request/reply
//! exchange (and make QUIC send extra ACK-only packets). So, like TCP's delayed ACK, a landed
//! write's acknowledgment is *owed* and sent: just before this node's next write to the same
//! peer (so both share a packet), once `ack_every_bytes` are owed, before a refusal, or at the
//! latest about `ack_delay` later by the endpoint's ack clock. Acknowledgments are cumulative,
//! so sending the latest owed one covers all earlier ones.
//!
//! The clock is one task per endpoint that sleeps only while acknowledgments are owed: a timer
//! per write would cost more than the packet it saves (on a multi-threaded runtime, arming a
//! timer often wakes a parked worker).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::Notify;

use crate::codec::{Frame, NackReason};

/// The answer half of one incoming channel's stream.
pub(crate) struct AckLane {
    send: tokio::sync::Mutex<quinn::SendStream>,
    clock: Arc<AckClock>,
    /// Sequence number of the latest landed, unacknowledged write plus one; 0 when none.
    owed_through: AtomicU64,
    /// Payload bytes landed since the last acknowledgment was sent.
    owed_bytes: AtomicU64,
}

impl AckLane {
    pub(crate) fn new(send: quinn::SendStream, clock: Arc<AckClock>) -> Self {
        Self {
            send: tokio::sync::Mutex::new(send),
            clock,
            owed_through: AtomicU64::new(0),
            owed_bytes: AtomicU64::new(0),
        }
    }

    /// Records that write `seq` of `len` bytes landed; returns the bytes now owed.
    pub(crate) fn owe(&self, seq: u64, len: u64) -> u64 {
        self.owed_through.store(seq + 1, Ordering::Release);
        self.clock.arm();
        self.owed_bytes.fetch_add(len, Ordering::AcqRel) + len
    }

    pub(crate) fn is_owed(&self) -> bool {
        self.owed_through.load(Ordering::Acquire) != 0
    }

    async fn write_owed(&self, send: &mut quinn::SendStream) -> Result<(), quinn::WriteError> {
        let through = self.owed_through.swap(0, Ordering::AcqRel);
        if through == 0 {
            return Ok(());
        }
        self.owed_bytes.store(0, Ordering::Release);
        send.write_all(
            &Frame::Ack {
                through: through - 1,
            }
            .to_vec(),
        )
        .await
    }

    /// Sends the owed acknowledgment, if any.
    pub(crate) async fn flush(&self) -> Result<(), quinn::WriteError> {
        if !self.is_owed() {
            return Ok(());
        }
        let mut send = self.send.lock().await;
        self.write_owed(&mut send).await
    }

    /// Sends what is owed, then the refusal of `seq`, in that order.
    pub(crate) async fn refuse(
        &self,
        seq: u64,
        reason: NackReason,
    ) -> Result<(), quinn::WriteError> {
        let mut send = self.send.lock().await;
        self.write_owed(&mut send).await?;
        send.write_all(&Frame::Nack { seq, reason }.to_vec()).await
    }

    /// Ends the answer stream: cleanly (after a last acknowledgment), or with an error code.
    pub(crate) async fn close(&self, error_code: Option<quinn::VarInt>) {
        let mut send = self.send.lock().await;
        match error_code {
            None => {
                let _ = self.write_owed(&mut send).await;
                let _ = send.finish();
            }
            Some(code) => {
                let _ = send.reset(code);
            }
        }
    }
}

/// The incoming channels of one peer, so that a write to that peer can carry their owed
/// acknowledgments along.
#[derive(Default)]
pub(crate) struct AckBoard {
    lanes: Mutex<Vec<Weak<AckLane>>>,
}

impl AckBoard {
    pub(crate) fn add(&self, lane: &Arc<AckLane>) {
        let mut lanes = self
            .lanes
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        lanes.retain(|lane| lane.strong_count() > 0);
        lanes.push(Arc::downgrade(lane));
    }

    /// Sends every owed acknowledgment (best effort: a failing lane reports through its own
    /// channel).
    pub(crate) async fn flush_all(&self) {
        let owed: Vec<Arc<AckLane>> = {
            let lanes = self
                .lanes
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            lanes
                .iter()
                .filter_map(Weak::upgrade)
                .filter(|lane| lane.is_owed())
                .collect()
        };
        for lane in owed {
            let _ = lane.flush().await;
        }
    }
}

/// Wakes the endpoint's ack clock when the first acknowledgment becomes owed.
#[derive(Default)]
pub(crate) struct AckClock {
    armed: AtomicBool,
    notify: Notify,
}

impl AckClock {
    fn arm(&self) {
        if !self.armed.swap(true, Ordering::AcqRel) {
            self.notify.notify_one();
        }
    }

    /// Stops the clock task (the endpoint closed).
    pub(crate) fn stop(&self) {
        self.notify.notify_one();
    }
}

/// The ack clock: once armed, waits `delay`, then sends every owed acknowledgment of the
/// endpoint. Ends when the endpoint is gone.
pub(crate) async fn run_clock(
    clock: Arc<AckClock>,
    boards: Weak<Mutex<std::collections::HashMap<Arc<str>, Arc<AckBoard>>>>,
    delay: Duration,
) {
    loop {
        clock.notify.notified().await;
        if boards.strong_count() == 0 || !clock.armed.load(Ordering::Acquire) {
            return; // the endpoint is gone, or stop() woke us
        }
        tokio::time::sleep(delay).await;
        // Disarm before scanning, so that a write landing during the scan re-arms the clock.
        clock.armed.store(false, Ordering::Release);
        let Some(boards) = boards_snapshot(&boards) else {
            return;
        };
        for board in boards {
            board.flush_all().await;
        }
    }
}

fn boards_snapshot(
    boards: &Weak<Mutex<std::collections::HashMap<Arc<str>, Arc<AckBoard>>>>,
) -> Option<Vec<Arc<AckBoard>>> {
    let boards = boards.upgrade()?;
    let boards = boards
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    Some(boards.values().cloned().collect())
}
