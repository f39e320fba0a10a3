//! The receiving side: accepting connections (mutual TLS, then the hello whose name must match
//! the client certificate), and serving each channel stream: admit, land, complete, acknowledge.
//! Whatever a peer sends, this code only refuses, stops streams or closes connections.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use quinn::VarInt;
use rustls_pki_types::CertificateDer;
use tracing::{debug, warn};

use super::acks::AckLane;
use super::reader::{FrameReader, ReadError};
use super::{Shared, close_code, link};
use crate::codec::Frame;
use crate::tls;

/// Accepts connections until the endpoint closes.
pub(crate) async fn accept_loop(shared: Arc<Shared>) {
    while let Some(incoming) = shared.endpoint.accept().await {
        if shared.closed.load(Ordering::Acquire) {
            incoming.refuse();
            continue;
        }
        tokio::spawn(handshake(shared.clone(), incoming));
    }
}

/// Completes the TLS handshake and the hello; registers the connection under the verified name.
async fn handshake(shared: Arc<Shared>, incoming: quinn::Incoming) {
    let remote = incoming.remote_address();
    let timeout = shared.tuning.connect_timeout;
    let outcome = tokio::time::timeout(timeout, async {
        let connecting = incoming
            .accept_with(shared.path_configs(remote).server.clone())
            .map_err(|error| format!("could not accept: {error}"))?;
        // A client without a certificate from the cluster CA fails here, inside TLS.
        let connection = connecting
            .await
            .map_err(|error| format!("handshake failed: {error}"))?;
        let chain = connection
            .peer_identity()
            .and_then(|identity| identity.downcast::<Vec<CertificateDer<'static>>>().ok())
            .ok_or_else(|| "the client presented no certificate".to_owned())?;
        let (mut send, recv) = connection
            .accept_bi()
            .await
            .map_err(|error| format!("no hello stream: {error}"))?;
        let mut reader = FrameReader::new(recv, 0);
        let claimed = match reader.next_frame().await {
            Ok(Some(Frame::Hello { node })) => node,
            other => {
                connection.close(VarInt::from_u32(close_code::PROTOCOL), b"expected a hello");
                return Err(format!("expected a hello, got {other:?}"));
            }
        };
        if let Err(error) = tls::verify_peer_name(&chain, &claimed) {
            connection.close(
                VarInt::from_u32(close_code::IDENTITY),
                b"claimed name does not match the certificate",
            );
            return Err(error.to_string());
        }
        send.write_all(&Frame::HelloAck.to_vec())
            .await
            .map_err(|error| format!("hello acknowledgment: {error}"))?;
        Ok((claimed, connection))
    })
    .await;
    match outcome {
        Ok(Ok((peer, connection))) => {
            debug!(node = %shared.node, %peer, %remote, "accepted");
            link::register(&shared, peer.into(), connection);
        }
        Ok(Err(reason)) => warn!(node = %shared.node, %remote, %reason, "refused a connection"),
        Err(_) => warn!(node = %shared.node, %remote, "refused a connection: handshake timed out"),
    }
}

/// Serves the channels `peer` opens on `connection` until it closes.
pub(crate) async fn serve_connection(
    shared: Arc<Shared>,
    peer: Arc<str>,
    connection: quinn::Connection,
) {
    loop {
        match connection.accept_bi().await {
            Ok((send, recv)) => {
                tokio::spawn(serve_channel(shared.clone(), peer.clone(), send, recv));
            }
            Err(error) => {
                debug!(%peer, %error, "stopped serving a connection");
                return;
            }
        }
    }
}

/// Why a channel stopped being served.
enum ChannelEnd {
    /// The stream or connection went away (normal when a peer stops).
    Gone(String),
    /// The peer sent something invalid.
    Misbehaved(String),
}

impl From<ReadError> for ChannelEnd {
    fn from(error: ReadError) -> Self {
        match error {
            ReadError::Source(reason) => ChannelEnd::Gone(reason),
            other => ChannelEnd::Misbehaved(other.to_string()),
        }
    }
}

/// Serves one channel: each write is admitted (region, key, grant, bounds) before its payload
/// is read; admitted payloads land in region memory, refused ones are read and dropped so the
/// stream stays in step, and every write is answered in order.
async fn serve_channel(
    shared: Arc<Shared>,
    peer: Arc<str>,
    send: quinn::SendStream,
    recv: quinn::RecvStream,
) {
    let mut reader = FrameReader::new(recv, shared.limits.max_write_bytes);
    let lane = Arc::new(AckLane::new(send, shared.ack_clock.clone()));
    shared.ack_board(&peer).add(&lane);
    let ack_every_bytes = shared.tuning.ack_every_bytes;
    let gone = |error: quinn::WriteError| ChannelEnd::Gone(error.to_string());
    let outcome: Result<(), ChannelEnd> = async {
        let channel = match reader.next_frame().await? {
            Some(Frame::OpenChannel { channel }) => channel,
            None => return Ok(()),
            Some(other) => {
                return Err(ChannelEnd::Misbehaved(format!(
                    "expected a channel opening, got {other:?}"
                )));
            }
        };
        loop {
            let next = reader.next_frame().await;
            let header = match next? {
                Some(Frame::Write(header)) => header,
                None => return Ok(()),
                Some(other) => {
                    return Err(ChannelEnd::Misbehaved(format!(
                        "unexpected {other:?} on a write stream"
                    )));
                }
            };
            match shared.regions.admit(&peer, &header) {
                Ok(region) => {
                    let mut landing = match region.try_begin_landing(&header) {
                        Some(landing) => landing,
                        None => {
                            // The owner holds a view: do not keep earlier writes unacknowledged
                            // while waiting for it.
                            lane.flush().await.map_err(gone)?;
                            region.begin_landing(&header).await
                        }
                    };
                    reader
                        .read_payload(header.len as usize, |chunk| landing.put(chunk))
                        .await?;
                    landing.finish(peer.clone(), channel, &header);
                    if lane.owe(header.seq, u64::from(header.len)) >= ack_every_bytes {
                        lane.flush().await.map_err(gone)?;
                    }
                }
                Err(reason) => {
                    reader.read_payload(header.len as usize, |_| {}).await?;
                    lane.refuse(header.seq, reason).await.map_err(gone)?;
                }
            }
        }
    }
    .await;
    match outcome {
        Ok(()) => lane.close(None).await,
        Err(end) => {
            match end {
                ChannelEnd::Gone(reason) => {
                    debug!(node = %shared.node, %peer, %reason, "channel ended")
                }
                ChannelEnd::Misbehaved(reason) => {
                    warn!(node = %shared.node, %peer, %reason, "closing a misbehaving channel")
                }
            }
            let code = VarInt::from_u32(close_code::PROTOCOL);
            let _ = reader.source_mut().stop(code);
            lane.close(Some(code)).await;
        }
    }
}
