//! The attention node's side of the data plane: writing messages into the cards' inboxes and
//! receiving their replies in its own region.
//!
//! [`CardFabric`] is what the node's step logic uses; [`JetstreamFabric`] implements it over a
//! JetStream transport (QUIC or in-process). Each card's inbox and the node's reply region have
//! one slot per micro-batch, so two micro-batches can be in flight at once.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use jetstream::{
    EndpointRuntime, Region, RegionConfig, RegionDescriptor, Transport, WriteRequest, WriteTicket,
};
use proto::data::{HEADER_LEN, Immediate};

use step::{InvalidStep, StepError};

/// Micro-batch slots per inbox and reply region.
pub const SLOTS: usize = 2;

/// A received reply.
#[derive(Debug, Clone)]
pub struct Reply {
    /// The card that sent it.
    pub card: usize,
    /// Its immediate (step, layer, micro-batch).
    pub immediate: Immediate,
    /// The message.
    pub bytes: Vec<u8>,
}

/// Sending to cards and receiving their replies.
pub trait CardFabric: Send {
    /// Number of cards.
    fn cards(&self) -> usize;

    /// Writes `message` into card `card`'s inbox slot for `micro_batch`.
    fn send(
        &mut self,
        card: usize,
        micro_batch: u8,
        message: Vec<u8>,
        immediate: Immediate,
    ) -> Result<(), StepError>;

    /// The next reply from any card, waiting at most `timeout`.
    fn recv(&mut self, timeout: Duration) -> Result<Reply, StepError>;

    /// Bytes sent and received so far.
    fn traffic(&self) -> (u64, u64);

    /// Card `card` came back with a new inbox: later messages go there, and the failures of
    /// writes to its old one are forgotten. Fabrics whose cards cannot come back ignore it.
    fn replace_inbox(&mut self, card: usize, inbox: RegionDescriptor) {
        let _ = (card, inbox);
    }
}

/// Sizes of inbox and reply slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotSizes {
    /// Bytes of one card-inbox slot (the largest dispatch message).
    pub inbox: usize,
    /// Bytes of one reply slot (the largest reply message).
    pub reply: usize,
}

/// [`CardFabric`] over JetStream.
pub struct JetstreamFabric {
    transport: Arc<dyn Transport>,
    /// The node endpoint's runtime, driven by the node's thread whenever it sends or waits.
    runtime: Arc<EndpointRuntime>,
    card_names: Vec<String>,
    card_index: HashMap<String, usize>,
    inboxes: Vec<RegionDescriptor>,
    reply: Region,
    sizes: SlotSizes,
    pending: Vec<Vec<WriteTicket>>,
    bytes_sent: u64,
    bytes_received: u64,
}

impl std::fmt::Debug for JetstreamFabric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JetstreamFabric")
            .field("node", &self.transport.node())
            .field("cards", &self.card_names)
            .field("sizes", &self.sizes)
            .finish()
    }
}

impl JetstreamFabric {
    /// Registers the reply region (granted to every card) on `transport`, whose tasks run on
    /// `runtime` (the transport was bound inside it). The cards' inbox descriptors are attached
    /// with [`Self::set_inboxes`] once each card has loaded its shard.
    pub fn new(
        transport: Arc<dyn Transport>,
        runtime: Arc<EndpointRuntime>,
        card_names: Vec<String>,
        sizes: SlotSizes,
    ) -> Result<Self, jetstream::Error> {
        let mut config = RegionConfig::new(sizes.reply * SLOTS * card_names.len().max(1));
        for name in &card_names {
            config = config.grant(name.clone());
        }
        let reply = transport.register(config)?;
        Ok(JetstreamFabric {
            card_index: card_names
                .iter()
                .enumerate()
                .map(|(i, n)| (n.clone(), i))
                .collect(),
            pending: card_names.iter().map(|_| Vec::new()).collect(),
            inboxes: Vec::new(),
            transport,
            runtime,
            card_names,
            reply,
            sizes,
            bytes_sent: 0,
            bytes_received: 0,
        })
    }

    /// The region cards write replies into.
    pub fn reply_region(&self) -> RegionDescriptor {
        self.reply.descriptor()
    }

    /// Where card `card` writes its reply for `micro_batch` (byte offset in the reply region).
    pub fn reply_offset(sizes: SlotSizes, card: usize, micro_batch: usize) -> u64 {
        ((card * SLOTS + micro_batch) * sizes.reply) as u64
    }

    /// Attaches the cards' inboxes, in card order.
    pub fn set_inboxes(&mut self, inboxes: Vec<RegionDescriptor>) {
        self.inboxes = inboxes;
    }

    /// The first failed write to `card`, if any, as a step error.
    fn failed_write(&mut self, card: usize) -> Option<StepError> {
        let mut error = None;
        self.pending[card].retain(|t| match t.try_result() {
            Some(Err(e)) => {
                error.get_or_insert(e.to_string());
                false
            }
            Some(Ok(_)) => false,
            None => true,
        });
        error.map(|message| StepError::Card {
            card,
            message: format!("a write to {} failed: {message}", self.card_names[card]),
        })
    }
}

impl CardFabric for JetstreamFabric {
    fn cards(&self) -> usize {
        self.card_names.len()
    }

    fn send(
        &mut self,
        card: usize,
        micro_batch: u8,
        message: Vec<u8>,
        immediate: Immediate,
    ) -> Result<(), StepError> {
        let card_error = |message: String| StepError::Card { card, message };
        if let Some(e) = self.failed_write(card) {
            return Err(e);
        }
        let inbox = self
            .inboxes
            .get(card)
            .ok_or_else(|| card_error("no inbox: the card has not loaded its shard".into()))?;
        if message.len() > self.sizes.inbox {
            return Err(InvalidStep::MessageTooLarge {
                bytes: message.len(),
                slot: self.sizes.inbox,
            }
            .into());
        }
        let offset = (micro_batch as usize * self.sizes.inbox) as u64;
        let len = message.len() as u64;
        let request =
            WriteRequest::new(inbox, offset, Bytes::from(message)).immediate(immediate.pack());
        // Flushed: the node may compute before it next waits, and the cards should not wait
        // for that.
        let ticket = self
            .runtime
            .block_on_then_flush(self.transport.post_write(request))
            .map_err(|e| card_error(format!("cannot write to {}: {e}", self.card_names[card])))?;
        self.pending[card].push(ticket);
        self.bytes_sent += len;
        Ok(())
    }

    fn recv(&mut self, timeout: Duration) -> Result<Reply, StepError> {
        let completion = match self
            .runtime
            .block_on(self.reply.next_completion_timeout(timeout))
        {
            Ok(c) => c,
            Err(e) => {
                for card in 0..self.card_names.len() {
                    if let Some(err) = self.failed_write(card) {
                        return Err(err);
                    }
                }
                return Err(StepError::NoReply {
                    waited: timeout,
                    reason: format!("{e}; is every card process alive?"),
                });
            }
        };
        let card = *self
            .card_index
            .get(completion.peer.as_ref())
            .ok_or_else(|| {
                StepError::from(InvalidStep::Setup(format!(
                    "a reply came from unknown node {}: the fabric does not connect it",
                    completion.peer
                )))
            })?;
        let bytes = {
            let view =
                self.reply
                    .read_blocking(completion.range())
                    .map_err(|e| StepError::Card {
                        card,
                        message: e.to_string(),
                    })?;
            view.to_vec()
        };
        if bytes.len() < HEADER_LEN {
            return Err(StepError::Card {
                card,
                message: format!("a {}-byte reply is shorter than a header", bytes.len()),
            });
        }
        self.bytes_received += bytes.len() as u64;
        Ok(Reply {
            card,
            immediate: Immediate::unpack(completion.immediate),
            bytes,
        })
    }

    fn traffic(&self) -> (u64, u64) {
        (self.bytes_sent, self.bytes_received)
    }

    fn replace_inbox(&mut self, card: usize, inbox: RegionDescriptor) {
        if let Some(slot) = self.inboxes.get_mut(card) {
            *slot = inbox;
            self.pending[card].clear();
        }
    }
}
