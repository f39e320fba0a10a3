//! The sending side: connections to peers (dialled lazily, kept open), one stream per channel,
//! and the task per channel that turns acknowledgments into send-side completions.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::OwnedSemaphorePermit;
use tracing::debug;

use super::acks::AckBoard;
use super::reader::FrameReader;
use super::{Shared, lock, serve};
use crate::codec::{Frame, WriteHeader, encode_write_header};
use crate::error::{Error, Result};
use crate::ticket::{PendingWrite, PendingWrites, WriteReceipt, WriteTicket};
use crate::transport::{Channel, WriteRequest};

/// An open connection to one peer and the channels this node opened on it.
pub(crate) struct PeerLink {
    pub(crate) peer: Arc<str>,
    pub(crate) connection: quinn::Connection,
    channels: Mutex<HashMap<Channel, Arc<ChannelTx>>>,
    /// Opening streams is serialized so a channel is opened once.
    opening: tokio::sync::Mutex<()>,
}

fn gone(peer: &str, reason: impl std::fmt::Display) -> Error {
    Error::PeerGone {
        peer: peer.to_owned(),
        reason: reason.to_string(),
    }
}

/// The connection to write to `peer`: the open one, or a new one dialled now.
pub(crate) async fn connect(shared: &Arc<Shared>, peer: &str) -> Result<Arc<PeerLink>> {
    if let Some(link) = live_link(shared, peer) {
        return Ok(link);
    }
    let dial_lock = lock(&shared.dials).entry(peer.into()).or_default().clone();
    let _dialling = dial_lock.lock().await;
    if let Some(link) = live_link(shared, peer) {
        return Ok(link);
    }
    let addr = shared
        .address_book
        .read()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .get(peer)
        .copied()
        .ok_or_else(|| Error::UnknownPeer {
            peer: peer.to_owned(),
        })?;
    let timeout = shared.tuning.connect_timeout;
    let connect_error = |source: Box<dyn std::error::Error + Send + Sync>| Error::Connect {
        peer: peer.to_owned(),
        addr,
        source,
    };
    let connection = async {
        let connecting = shared
            .endpoint
            .connect_with(shared.path_configs(addr).client.clone(), addr, peer)
            .map_err(|error| connect_error(error.into()))?;
        let connection = connecting
            .await
            .map_err(|error| connect_error(error.into()))?;
        // Claim our name on a control stream; the peer checks it against our certificate.
        let (mut send, recv) = connection
            .open_bi()
            .await
            .map_err(|error| connect_error(error.into()))?;
        let hello = Frame::Hello {
            node: shared.node.to_string(),
        }
        .to_vec();
        send.write_all(&hello)
            .await
            .map_err(|error| connect_error(error.into()))?;
        let mut reader = FrameReader::new(recv, 0);
        match reader.next_frame().await {
            Ok(Some(Frame::HelloAck)) => Ok(connection),
            Ok(other) => Err(connect_error(
                format!("expected a hello acknowledgment, got {other:?}").into(),
            )),
            Err(error) => {
                // The peer says why in its close frame, when it closed the connection.
                let reason = connection
                    .close_reason()
                    .map_or_else(|| error.to_string(), |reason| reason.to_string());
                Err(connect_error(
                    format!("the peer refused our hello: {reason}").into(),
                ))
            }
        }
    };
    let connection = tokio::time::timeout(timeout, connection)
        .await
        .map_err(|_| Error::Timeout {
            what: "the connection to a peer",
            after: timeout,
        })??;
    debug!(node = %shared.node, %peer, %addr, "connected");
    Ok(register(shared, peer.into(), connection))
}

fn live_link(shared: &Shared, peer: &str) -> Option<Arc<PeerLink>> {
    // A closed connection is removed by its watcher task; until then a write on it fails
    // with `PeerGone` (checking `close_reason` here would lock the connection on every write).
    lock(&shared.links).get(peer).cloned()
}

/// Records a verified connection with `peer` (dialled or accepted): it becomes the write path
/// unless a live one exists, its incoming streams are served, and it is forgotten once closed.
pub(crate) fn register(
    shared: &Arc<Shared>,
    peer: Arc<str>,
    connection: quinn::Connection,
) -> Arc<PeerLink> {
    let link = Arc::new(PeerLink {
        peer: peer.clone(),
        connection: connection.clone(),
        channels: Mutex::new(HashMap::new()),
        opening: tokio::sync::Mutex::new(()),
    });
    let chosen = {
        let mut links = lock(&shared.links);
        match links.get(&peer) {
            Some(existing) if existing.connection.close_reason().is_none() => existing.clone(),
            _ => {
                links.insert(peer.clone(), link.clone());
                link
            }
        }
    };
    tokio::spawn(serve::serve_connection(
        shared.clone(),
        peer.clone(),
        connection.clone(),
    ));
    let shared = Arc::downgrade(shared);
    tokio::spawn(async move {
        let reason = connection.closed().await;
        debug!(%peer, %reason, "connection closed");
        if let Some(shared) = shared.upgrade() {
            let mut links = lock(&shared.links);
            if links
                .get(&peer)
                .is_some_and(|link| link.connection.stable_id() == connection.stable_id())
            {
                links.remove(&peer);
            }
        }
    });
    chosen
}

impl PeerLink {
    /// The stream of `channel`, opened on first use.
    pub(crate) async fn channel(
        &self,
        shared: &Shared,
        channel: Channel,
    ) -> Result<Arc<ChannelTx>> {
        let open = |links: &HashMap<Channel, Arc<ChannelTx>>| {
            links
                .get(&channel)
                .filter(|tx| !lock(&tx.pending).is_closed())
                .cloned()
        };
        if let Some(tx) = open(&lock(&self.channels)) {
            return Ok(tx);
        }
        let _opening = self.opening.lock().await;
        if let Some(tx) = open(&lock(&self.channels)) {
            return Ok(tx);
        }
        let (mut send, recv) = self
            .connection
            .open_bi()
            .await
            .map_err(|error| gone(&self.peer, error))?;
        send.write_all(&Frame::OpenChannel { channel }.to_vec())
            .await
            .map_err(|error| gone(&self.peer, error))?;
        let tx = Arc::new(ChannelTx {
            peer: self.peer.clone(),
            acks: shared.ack_board(&self.peer),
            stream: tokio::sync::Mutex::new(TxState { send, next_seq: 0 }),
            pending: Mutex::new(PendingWrites::default()),
        });
        tokio::spawn(read_acks(
            tx.clone(),
            FrameReader::new(recv, shared.limits.max_write_bytes),
        ));
        lock(&self.channels).insert(channel, tx.clone());
        Ok(tx)
    }
}

struct TxState {
    send: quinn::SendStream,
    next_seq: u64,
}

/// One channel's stream towards a peer.
pub(crate) struct ChannelTx {
    peer: Arc<str>,
    /// Acknowledgments this node owes the same peer, sent just before each write.
    acks: Arc<AckBoard>,
    stream: tokio::sync::Mutex<TxState>,
    pending: Mutex<PendingWrites>,
}

impl ChannelTx {
    /// Queues one write on the stream (frame, then payload, without copying the payload).
    pub(crate) async fn send(
        &self,
        request: WriteRequest<'_>,
        window: OwnedSemaphorePermit,
        timeout: Duration,
    ) -> Result<WriteTicket> {
        let mut stream = self.stream.lock().await;
        let seq = stream.next_seq;
        let header = WriteHeader {
            seq,
            region: request.target.id,
            key: request.target.key,
            offset: request.offset,
            len: request.data.len() as u32,
            immediate: request.immediate,
        };
        let receipt = WriteReceipt {
            peer: self.peer.clone(),
            region: header.region,
            offset: header.offset,
            len: u64::from(header.len),
            immediate: header.immediate,
        };
        let (pending, ticket) = PendingWrite::new(seq, receipt, Some(window), timeout);
        let pending = pending.with_target_len(request.target.len);
        if lock(&self.pending).push(pending).is_err() {
            return Err(gone(&self.peer, "the channel's stream failed"));
        }
        stream.next_seq += 1;
        self.acks.flush_all().await;
        let mut chunks = [
            Bytes::copy_from_slice(&encode_write_header(&header)),
            request.data,
        ];
        if let Err(error) = stream.send.write_all_chunks(&mut chunks).await {
            // The stream is dead: fail everything still pending on it.
            for write in lock(&self.pending).close() {
                write.fail(gone(&self.peer, &error));
            }
            return Err(gone(&self.peer, error));
        }
        Ok(ticket)
    }
}

/// Resolves tickets from the acknowledgments the peer sends back on the channel's stream.
async fn read_acks(tx: Arc<ChannelTx>, mut reader: FrameReader<quinn::RecvStream>) {
    let peer = tx.peer.to_string();
    let failure = loop {
        match reader.next_frame().await {
            Ok(Some(Frame::Ack { through })) => {
                let acked = lock(&tx.pending).ack_through(through);
                for write in acked {
                    write.succeed();
                }
            }
            Ok(Some(Frame::Nack { seq, reason })) => {
                let refused = lock(&tx.pending).nack(seq);
                if let Some(write) = refused {
                    write.refuse(reason);
                }
            }
            Ok(Some(other)) => {
                let reason = format!("unexpected {other:?} on an acknowledgment stream");
                break Error::Protocol {
                    peer: peer.clone(),
                    reason,
                };
            }
            Ok(None) => break gone(&peer, "the peer finished the channel"),
            Err(error) => break gone(&peer, error),
        }
    };
    debug!(%peer, %failure, "channel closed");
    let _ = reader
        .source_mut()
        .stop(quinn::VarInt::from_u32(super::close_code::SHUTDOWN));
    let failed = lock(&tx.pending).close();
    for write in failed {
        write.fail(match &failure {
            Error::Protocol { reason, .. } => Error::Protocol {
                peer: peer.clone(),
                reason: reason.clone(),
            },
            Error::PeerGone { reason, .. } => gone(&peer, reason),
            other => gone(&peer, other),
        });
    }
}
