//! Send-side completions: the ticket a writer holds for each posted write, and the ordered
//! queue of unacknowledged writes per channel that acknowledgments resolve.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::OwnedSemaphorePermit;

use crate::codec::NackReason;
use crate::error::{Error, Result};
use crate::mailbox::{Mailbox, PopError};

/// A send-side completion: the target acknowledged that the write landed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteReceipt {
    /// The node written to.
    pub peer: Arc<str>,
    /// The region written to.
    pub region: u32,
    /// Where the bytes start.
    pub offset: u64,
    /// How many bytes.
    pub len: u64,
    /// The immediate that was delivered with them.
    pub immediate: u64,
}

/// The outcome of one posted write, available once the target answered (or the link failed).
#[must_use = "a ticket tells whether the write landed; wait on it or drop it deliberately"]
pub struct WriteTicket {
    slot: Arc<Mailbox<Result<WriteReceipt>>>,
    timeout: Duration,
}

impl std::fmt::Debug for WriteTicket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteTicket")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl WriteTicket {
    /// Waits for the acknowledgment, at most the endpoint's `Limits::write_timeout`.
    pub async fn wait(self) -> Result<WriteReceipt> {
        match tokio::time::timeout(self.timeout, self.slot.pop()).await {
            Ok(Ok(outcome)) => outcome,
            Ok(Err(_)) => Err(Error::Closed {
                what: "channel carrying this write",
            }),
            Err(_) => Err(Error::Timeout {
                what: "the write's acknowledgment",
                after: self.timeout,
            }),
        }
    }

    /// [`WriteTicket::wait`] for a plain (non-async) thread; needs no runtime handle.
    pub fn wait_blocking(self) -> Result<WriteReceipt> {
        match self.slot.pop_blocking(self.timeout) {
            Ok(outcome) => outcome,
            Err(PopError::Closed) => Err(Error::Closed {
                what: "channel carrying this write",
            }),
            Err(PopError::TimedOut) => Err(Error::Timeout {
                what: "the write's acknowledgment",
                after: self.timeout,
            }),
        }
    }

    /// The outcome if it is already known, without waiting.
    pub fn try_result(&self) -> Option<Result<WriteReceipt>> {
        self.slot.try_pop().ok().flatten()
    }
}

/// The sending side's record of one write until it is acknowledged.
pub(crate) struct PendingWrite {
    pub(crate) seq: u64,
    receipt: WriteReceipt,
    slot: Arc<Mailbox<Result<WriteReceipt>>>,
    /// The region length in the writer's descriptor.
    target_len: u64,
    /// Bytes of the peer's in-flight window, given back when this is dropped.
    _window: Option<OwnedSemaphorePermit>,
}

impl PendingWrite {
    /// A pending write and the ticket its caller waits on.
    pub(crate) fn new(
        seq: u64,
        receipt: WriteReceipt,
        window: Option<OwnedSemaphorePermit>,
        timeout: Duration,
    ) -> (Self, WriteTicket) {
        let slot = Arc::new(Mailbox::default());
        let ticket = WriteTicket {
            slot: slot.clone(),
            timeout,
        };
        (
            Self {
                seq,
                receipt,
                slot,
                target_len: 0,
                _window: window,
            },
            ticket,
        )
    }

    /// Also records the region length the writer's descriptor claimed, for error messages.
    pub(crate) fn with_target_len(mut self, len: u64) -> Self {
        self.target_len = len;
        self
    }

    pub(crate) fn succeed(self) {
        let _ = self.slot.push(Ok(self.receipt.clone()));
    }

    pub(crate) fn refuse(self, reason: NackReason) {
        let peer = self.receipt.peer.to_string();
        let region = self.receipt.region;
        let error = match reason {
            NackReason::UnknownRegion => Error::UnknownRegion { peer, region },
            NackReason::WrongKey => Error::WrongKey { peer, region },
            NackReason::NotGranted => Error::NotGranted { peer, region },
            // The writer checked against its descriptor, so the descriptor is stale or forged.
            NackReason::OutOfBounds => Error::OutOfBounds {
                region,
                offset: self.receipt.offset,
                len: self.receipt.len,
                region_len: self.target_len,
            },
        };
        let _ = self.slot.push(Err(error));
    }

    pub(crate) fn fail(self, error: Error) {
        let _ = self.slot.push(Err(error));
    }
}

impl Drop for PendingWrite {
    /// A write dropped without an outcome (its channel vanished) closes its ticket, so the
    /// writer learns at once instead of waiting for the timeout.
    fn drop(&mut self) {
        self.slot.close();
    }
}

/// Unacknowledged writes of one channel, in sequence order. Pure bookkeeping: no I/O.
#[derive(Default)]
pub(crate) struct PendingWrites {
    queue: VecDeque<PendingWrite>,
    closed: bool,
}

impl PendingWrites {
    /// Records a write; gives it back if the channel already failed.
    pub(crate) fn push(&mut self, write: PendingWrite) -> Result<(), PendingWrite> {
        if self.closed {
            return Err(write);
        }
        self.queue.push_back(write);
        Ok(())
    }

    /// Removes the write `seq` if it is still pending (its send failed).
    pub(crate) fn remove(&mut self, seq: u64) -> Option<PendingWrite> {
        let index = self.queue.iter().position(|write| write.seq == seq)?;
        self.queue.remove(index)
    }

    /// Everything up to and including `through` landed.
    pub(crate) fn ack_through(&mut self, through: u64) -> Vec<PendingWrite> {
        let count = self
            .queue
            .iter()
            .take_while(|write| write.seq <= through)
            .count();
        self.queue.drain(..count).collect()
    }

    /// The write `seq` was refused.
    pub(crate) fn nack(&mut self, seq: u64) -> Option<PendingWrite> {
        self.remove(seq)
    }

    /// The channel failed: nothing more is accepted, and every pending write is returned.
    pub(crate) fn close(&mut self) -> Vec<PendingWrite> {
        self.closed = true;
        self.queue.drain(..).collect()
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.closed
    }

    #[cfg(test)]
    fn seqs(&self) -> Vec<u64> {
        self.queue.iter().map(|write| write.seq).collect()
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn pending(seq: u64) -> (PendingWrite, WriteTicket) {
        let receipt = WriteReceipt {
            peer: "p".into(),
            region: 1,
            offset: 0,
            len: 8,
            immediate: seq,
        };
        PendingWrite::new(seq, receipt, None, Duration::from_millis(20))
    }

    proptest! {
        /// Acks resolve exactly the writes up to their sequence number, in order, and nacks
        /// resolve exactly one write with the matching error.
        #[test]
        fn acks_and_nacks_resolve_the_right_writes(count in 1u64..40, ack_at in 0u64..40, nack_at in 0u64..40) {
            let mut writes = PendingWrites::default();
            let mut tickets = Vec::new();
            for seq in 0..count {
                let (write, ticket) = pending(seq);
                prop_assert!(writes.push(write).is_ok());
                tickets.push(ticket);
            }
            let refused = writes.nack(nack_at);
            prop_assert_eq!(refused.is_some(), nack_at < count);
            if let Some(write) = refused {
                write.refuse(NackReason::WrongKey);
            }
            for write in writes.ack_through(ack_at) {
                write.succeed();
            }
            for (seq, ticket) in tickets.iter().enumerate() {
                let seq = seq as u64;
                let outcome = ticket.try_result();
                if seq == nack_at {
                    let refused = matches!(outcome, Some(Err(Error::WrongKey { .. })));
                    prop_assert!(refused);
                } else if seq <= ack_at {
                    let receipt = outcome.unwrap().unwrap();
                    prop_assert_eq!(receipt.immediate, seq);
                } else {
                    prop_assert!(outcome.is_none());
                }
            }
            let still: Vec<u64> = (0..count).filter(|&seq| seq > ack_at && seq != nack_at).collect();
            prop_assert_eq!(writes.seqs(), still);
        }
    }

    #[test]
    fn closing_fails_everything_and_refuses_more() {
        let mut writes = PendingWrites::default();
        let (write, ticket) = pending(0);
        writes.push(write).ok().unwrap();
        for write in writes.close() {
            write.fail(Error::PeerGone {
                peer: "p".into(),
                reason: "test".into(),
            });
        }
        assert!(writes.is_closed());
        assert!(matches!(
            ticket.try_result(),
            Some(Err(Error::PeerGone { .. }))
        ));
        let (late, _late_ticket) = pending(1);
        assert!(writes.push(late).is_err());
    }

    #[test]
    fn blocking_wait_reports_a_timeout() {
        let (_write, ticket) = pending(0);
        assert!(matches!(ticket.wait_blocking(), Err(Error::Timeout { .. })));
    }
}
