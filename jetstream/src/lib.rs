//! JetStream: an RDMA-style one-sided data plane.
//!
//! Owns registered memory regions, one-sided writes with immediates, receive- and send-side
//! completions, the QUIC transport (quinn) with mutual TLS from a cluster CA, an in-process
//! transport with the same trait, and the runtime an endpoint runs on ([`EndpointRuntime`]).
//!
//! Must not: depend on any other afd crate or interpret the bytes it moves.
//!
//! # Model
//!
//! Every participant is an endpoint named by its *node name* (`attn`, `card-0`, ...). An
//! endpoint registers [`Region`]s: byte buffers it owns, each with an id, a length and a random
//! 64-bit key. The owner hands a [`RegionDescriptor`] (node, id, length, key; serde-serializable)
//! to writers over the control plane and [grants](Region::grant) the region to the writer
//! nodes. A writer then calls [`Transport::post_write`] with the descriptor, an offset, the
//! bytes and a 64-bit *immediate*: the bytes land at that offset in the owner's memory and the
//! owner receives a [`Completion`] (peer, channel, region, offset, length, immediate). The owner
//! reads the bytes in place through a [`RegionView`] (no copy after landing) and reuses the
//! region for the next write. Two implementations: [`QuicTransport`] (the network) and
//! [`InprocTransport`] (channels in one process, for tests and `--transport inproc`); code
//! written against `dyn Transport` works with both.
//!
//! ```no_run
//! # async fn demo(attn: &dyn jetstream::Transport, card: &dyn jetstream::Transport) -> jetstream::Result<()> {
//! use jetstream::{RegionConfig, WriteRequest};
//! let inbox = card.register(RegionConfig::new(368 * 1024).grant("attn"))?;
//! let descriptor = inbox.descriptor(); // sent to `attn` over the control plane
//! let rows = bytes::Bytes::from(vec![0u8; 4096]);
//! let ticket = attn.post_write(WriteRequest::new(&descriptor, 0, rows).immediate(42)).await?;
//! let done = inbox.next_completion().await?; // on the card
//! let view = inbox.read(done.range()).await?; // the landed bytes, in place
//! assert_eq!((done.immediate, view.len()), (42, 4096));
//! drop(view); // let the next write land
//! ticket.wait().await?; // on attn: the card acknowledged
//! # Ok(()) }
//! ```
//!
//! # Guarantees
//!
//! **Landing and completions.** A receive completion is delivered only after every byte of
//! that write is in region memory. Bytes land while the region's internal lock is held for the
//! whole write, so a [`RegionView`] never shows a write half landed: a write waits while a view
//! of the same region is held (hold views briefly, or drop them before the next write is
//! expected). Each region has its own completion queue, in landing order. A write that fails
//! midway (connection lost) may leave some of its bytes in memory but produces no completion:
//! only bytes covered by a completion are defined.
//!
//! **Ordering.** Writes posted one after another from one endpoint to one peer on the same
//! *channel* ([`WriteRequest::channel`], default 0) land, complete and are acknowledged in the
//! order they were posted (`post_write` returns once the write is queued, so awaiting each call
//! in turn fixes the order). Writes on different channels, or to different peers, are not
//! ordered with respect to each other; a slow or large write on one channel does not hold back
//! another channel. Writes from two different writers into one region are not ordered.
//!
//! **Send-side completion.** [`Transport::post_write`] returns a [`WriteTicket`];
//! [`WriteTicket::wait`] yields a [`WriteReceipt`] once the target acknowledged that the bytes
//! landed and the completion was queued. Waiting is optional (dropping the ticket is fine) but
//! it is the only confirmation a writer gets. Acknowledgments are delayed like TCP's: on QUIC
//! the target sends one with its next write to the writer (so a request/reply exchange costs
//! one packet each way), after 1 MiB of unacknowledged data, or at the latest after
//! [`QuicTuning::ack_delay`] (1 ms by default). A writer that waits on each ticket with no
//! traffic coming back therefore waits up to that long; the window and the hot path (which
//! waits for the reply, not the ticket) do not.
//!
//! **Failures.** Every failure reaches the caller as an [`Error`], either from `post_write`
//! (checked before sending: [`Error::TooLarge`], [`Error::OutOfBounds`] against the
//! descriptor, [`Error::UnknownPeer`], [`Error::Connect`], [`Error::Timeout`] waiting for
//! window space) or from the ticket (checked by the receiver: [`Error::UnknownRegion`],
//! [`Error::WrongKey`], [`Error::NotGranted`], [`Error::OutOfBounds`]; and
//! [`Error::PeerGone`] if the connection fails before the acknowledgment, [`Error::Timeout`]
//! after [`Limits::write_timeout`]). A refused write lands nothing and later writes on the
//! channel are unaffected. A failed connection fails every write still unacknowledged on it;
//! the next write to that peer dials again. There are no automatic retries: a write whose
//! ticket failed may or may not have landed, so the application decides whether to resend.
//! The receiver checks every frame (version, lengths, region, key, grant, bounds) before a byte
//! lands; whatever a peer sends, it never writes outside a region and never panics: a
//! malformed stream is reset and logged.
//!
//! **Backpressure.** Each endpoint allows at most [`Limits::max_in_flight_bytes`] of posted
//! but unacknowledged writes per peer; `post_write` waits for space (up to the write timeout).
//! Below that, QUIC flow control bounds what a receiver buffers ([`QuicTuning`]).
//!
//! **Security (QUIC).** Mutual TLS 1.3 with a cluster CA ([`certs`]): an endpoint accepts only
//! peers whose certificate the cluster CA signed, and dials only peers whose certificate names
//! the node it meant to reach. Each node's certificate carries its node name as its only name;
//! a connecting node states its name in a hello, which the acceptor checks against the client
//! certificate, so no node can act under another's name. A connected peer can write only into
//! regions that were granted to its (certified) name and only with the right key; it cannot
//! read anything. The in-process transport has no TLS (there is no wire); grants and keys are
//! checked the same way.
//!
//! # Blocking threads
//!
//! Waiting needs no runtime handle: [`Region::next_completion_blocking`],
//! [`Region::read_blocking`] and [`WriteTicket::wait_blocking`] block the calling thread. To
//! *post* from a plain thread, run the future on the runtime that owns the transport:
//! `handle.block_on(transport.post_write(request))` with a `tokio::runtime::Handle` captured
//! beforehand (never from inside an async task), or, for a transport bound inside an
//! [`EndpointRuntime`], `runtime.block_on(...)`, which also drives the endpoint while it waits.
//! [`QuicTransport::bind`] must be called inside a tokio runtime.
//!
//! # Runtimes and performance
//!
//! A QUIC endpoint's tasks (quinn's drivers, the receive and acknowledgment tasks) run on the
//! runtime it was bound in; in-process deliveries run on the writer's runtime. For the lowest
//! latency bind each node's transport in its own [`EndpointRuntime`] and have the threads that
//! compute wait through it ([`EndpointRuntime::block_on`]): they then send and receive their
//! packets themselves, with no I/O thread to wake on the way. `cargo run --release -p
//! jetstream --example bench` compares against raw TCP.
//! On loopback the path MTU is known, so packets start at 64 KB (see [`QuicTuning`]); on a
//! network, path MTU discovery raises them from 1,200 bytes. Each endpoint is one UDP socket
//! and one QUIC connection per peer: on a single connection the sender's encryption and the
//! receiver's decryption each run on one core.
//!
//! # Wire
//!
//! See [`codec`] for the frame layout. Per QUIC connection: one control stream carrying the
//! hello, then one bidirectional stream per (writer, channel) carrying `Write` frames with their
//! payloads one way and `Ack`/`Nack` frames the other way. Both nodes write over the same
//! connection, whichever dialled; if both dial at once, both connections stay usable.

pub mod certs;
pub mod codec;
mod endpoint_runtime;
mod error;
mod inproc;
mod mailbox;
mod quic;
mod region;
mod ticket;
mod tls;
mod transport;

pub use certs::{ClusterCa, NodeIdentity, write_cluster};
pub use endpoint_runtime::EndpointRuntime;
pub use error::{Error, Result};
pub use inproc::{InprocFabric, InprocTransport};
pub use quic::{QuicConfig, QuicTransport, QuicTuning};
pub use region::{
    Completion, CompletionProbe, Region, RegionConfig, RegionDescriptor, RegionId, RegionView,
    RegionViewMut,
};
pub use ticket::{WriteReceipt, WriteTicket};
pub use tls::{control_client_config, control_server_config, peer_node_name, verify_peer_name};
pub use transport::{BoxFuture, Channel, Limits, Transport, WriteRequest, validate_node_name};
