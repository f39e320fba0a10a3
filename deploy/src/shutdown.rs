//! Stopping the long-running roles (`afd serve`, `afd frontend`, `afd attention`, `afd card`):
//! SIGTERM, what Kubernetes and `afd up` send, and SIGINT, Ctrl-C, both ask a role to drain
//! and exit 0; a second signal while draining ends the drain at once. An attention node drains
//! by serving steps until its frontend has freed every sequence it holds ([`CountedNode`]).

use std::collections::HashSet;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

use step::{AttentionNode, HealthSource, KvCapacity, SeqId, StepBatch, StepError, StepOutput};
use tokio::signal::unix::{Signal, SignalKind, signal};

/// Which stop signal arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopSignal {
    /// SIGINT (Ctrl-C).
    Interrupt,
    /// SIGTERM.
    Terminate,
}

impl fmt::Display for StopSignal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            StopSignal::Interrupt => "SIGINT",
            StopSignal::Terminate => "SIGTERM",
        })
    }
}

/// SIGINT and SIGTERM, caught from [`StopSignals::install`] on (the default action, death,
/// no longer applies to them).
#[derive(Debug)]
pub struct StopSignals {
    interrupt: Signal,
    terminate: Signal,
}

impl StopSignals {
    /// Catches both signals from now on. Call it inside a tokio runtime.
    pub fn install() -> std::io::Result<Self> {
        Ok(StopSignals {
            interrupt: signal(SignalKind::interrupt())?,
            terminate: signal(SignalKind::terminate())?,
        })
    }

    /// The next stop signal.
    pub async fn recv(&mut self) -> StopSignal {
        tokio::select! {
            _ = self.interrupt.recv() => StopSignal::Interrupt,
            _ = self.terminate.recv() => StopSignal::Terminate,
        }
    }
}

/// The sequences an attention node holds: stepped at least once and not freed since.
#[derive(Debug, Clone, Default)]
pub struct LiveSequences(Arc<Mutex<HashSet<SeqId>>>);

impl LiveSequences {
    /// How many there are now.
    pub fn count(&self) -> usize {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).len()
    }
}

/// An attention node that keeps [`LiveSequences`] up to date.
pub struct CountedNode {
    inner: Box<dyn AttentionNode>,
    live: LiveSequences,
}

impl CountedNode {
    /// Counts what `inner` holds.
    pub fn new(inner: Box<dyn AttentionNode>) -> Self {
        CountedNode {
            inner,
            live: LiveSequences::default(),
        }
    }

    /// A handle on the count, for the drain.
    pub fn live(&self) -> LiveSequences {
        self.live.clone()
    }
}

impl AttentionNode for CountedNode {
    fn kv_capacity(&self) -> KvCapacity {
        self.inner.kv_capacity()
    }

    fn step(&mut self, batch: &StepBatch) -> Result<StepOutput, StepError> {
        // Counted whatever the outcome: a failed step may still have cached some tokens, and
        // the frontend frees its sequences either way.
        {
            let mut live = self.live.0.lock().unwrap_or_else(PoisonError::into_inner);
            live.extend(batch.entries.iter().map(|e| e.seq));
        }
        self.inner.step(batch)
    }

    fn free(&mut self, seqs: &[SeqId]) -> Result<(), StepError> {
        {
            let mut live = self.live.0.lock().unwrap_or_else(PoisonError::into_inner);
            for seq in seqs {
                live.remove(seq);
            }
        }
        self.inner.free(seqs)
    }

    fn shares_kv_blocks(&self) -> bool {
        self.inner.shares_kv_blocks()
    }

    fn health_source(&self) -> Option<Arc<dyn HealthSource>> {
        self.inner.health_source()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_counted_node_holds_what_was_stepped_and_not_freed() {
        use router::fake::{FakeNode, FakeNodeConfig};
        use step::StepEntry;

        let mut node = CountedNode::new(Box::new(FakeNode::new(FakeNodeConfig::default())));
        let live = node.live();
        let entry = |seq: SeqId| StepEntry {
            seq,
            tokens: vec![40, 41],
            start: 0,
            prompt_len: 2,
            block_table: vec![seq as u32],
            sample: None,
            cached_prefix: Vec::new(),
            prompt_logprobs: None,
        };
        node.step(&StepBatch {
            entries: vec![entry(1), entry(2)],
        })
        .unwrap();
        assert_eq!(live.count(), 2);
        node.free(&[1]).unwrap();
        assert_eq!(live.count(), 1);
        node.free(&[2, 3]).unwrap();
        assert_eq!(live.count(), 0);
    }

    #[test]
    fn a_counted_node_passes_on_the_view_of_its_cards() {
        // `afd attention` serves its node through a CountedNode; without this its Health
        // answered no cards and the frontend never saw one go down.
        struct Board;
        impl HealthSource for Board {
            fn health(&self) -> step::NodeHealth {
                step::NodeHealth {
                    unserved: Some("card 1 is down".into()),
                    ..Default::default()
                }
            }
        }
        struct WithCards;
        impl AttentionNode for WithCards {
            fn kv_capacity(&self) -> KvCapacity {
                KvCapacity {
                    block_size: 16,
                    num_blocks: 1,
                }
            }
            fn step(&mut self, _: &StepBatch) -> Result<StepOutput, StepError> {
                Err(step::ModelFailure::Missing("a step here").into())
            }
            fn free(&mut self, _: &[SeqId]) -> Result<(), StepError> {
                Ok(())
            }
            fn health_source(&self) -> Option<Arc<dyn HealthSource>> {
                Some(Arc::new(Board))
            }
        }
        let node = CountedNode::new(Box::new(WithCards));
        let health = node
            .health_source()
            .expect("the inner node's view")
            .health();
        assert_eq!(health.unserved.as_deref(), Some("card 1 is down"));
    }

    #[tokio::test]
    async fn both_signals_are_caught_and_named() {
        let mut signals = StopSignals::install().unwrap();
        for (raw, want) in [
            (libc::SIGTERM, StopSignal::Terminate),
            (libc::SIGINT, StopSignal::Interrupt),
        ] {
            // SAFETY: raise(3) sends a signal to this process, whose handler is installed above
            // (the process does not die of it).
            assert_eq!(unsafe { libc::raise(raw) }, 0);
            let got = tokio::time::timeout(std::time::Duration::from_secs(5), signals.recv())
                .await
                .expect("the signal arrives");
            assert_eq!(got, want);
        }
        assert_eq!(StopSignal::Terminate.to_string(), "SIGTERM");
    }
}
