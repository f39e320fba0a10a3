//! The crate's error type: every failure a caller can see, each saying what went wrong and
//! what to do about it.

use std::net::SocketAddr;
use std::time::Duration;

use crate::codec::FrameError;

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in JetStream.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The target node is not known to this endpoint.
    #[error(
        "unknown peer `{peer}`: add its address to the address book (QuicTransport::add_peer) \
         or create it in the same in-process fabric"
    )]
    UnknownPeer {
        /// The node name that was asked for.
        peer: String,
    },

    /// The connection to the peer failed or the peer went away.
    #[error("peer `{peer}` is gone ({reason}); check that it is running, then retry")]
    PeerGone {
        /// The node name of the peer.
        peer: String,
        /// What the transport reported.
        reason: String,
    },

    /// A connection could not be set up.
    #[error("could not connect to peer `{peer}` at {addr}: {source}")]
    Connect {
        /// The node name of the peer.
        peer: String,
        /// The address that was dialled.
        addr: SocketAddr,
        /// Why: quinn's error, or what the peer answered instead of accepting our hello.
        source: Box<dyn std::error::Error + Send + Sync>,
    },

    /// The peer has no region with this id (never registered, or dropped since).
    #[error(
        "peer `{peer}` has no region {region}: the descriptor is stale or wrong; \
         get a fresh descriptor from the region's owner"
    )]
    UnknownRegion {
        /// The node that owns (or owned) the region.
        peer: String,
        /// The region id that was written to.
        region: u32,
    },

    /// The key does not match the region's key.
    #[error(
        "wrong key for region {region} on peer `{peer}`: the descriptor is stale or forged; \
         get a fresh descriptor from the region's owner"
    )]
    WrongKey {
        /// The node that owns the region.
        peer: String,
        /// The region id that was written to.
        region: u32,
    },

    /// The region exists but was not granted to the writing node.
    #[error(
        "region {region} on peer `{peer}` is not granted to this node: its owner must call \
         Region::grant with this node's name"
    )]
    NotGranted {
        /// The node that owns the region.
        peer: String,
        /// The region id that was written to.
        region: u32,
    },

    /// A write or a local view reaches outside the region.
    #[error(
        "{len} bytes at offset {offset} do not fit in region {region} of {region_len} bytes: \
         keep offset + length within the region"
    )]
    OutOfBounds {
        /// The region id.
        region: u32,
        /// Requested offset.
        offset: u64,
        /// Requested length.
        len: u64,
        /// The region's length.
        region_len: u64,
    },

    /// A single write is larger than the configured maximum.
    #[error(
        "a write of {len} bytes is larger than the maximum of {max} bytes: split it or raise \
         Limits::max_write_bytes on both sides"
    )]
    TooLarge {
        /// Requested length.
        len: u64,
        /// The configured maximum.
        max: u64,
    },

    /// Something did not happen in time.
    #[error("timed out after {after:?} waiting for {what}: the peer may be overloaded or gone")]
    Timeout {
        /// What was awaited.
        what: &'static str,
        /// How long it was awaited.
        after: Duration,
    },

    /// The peer broke the wire protocol.
    #[error("protocol error on the link with `{peer}`: {reason}")]
    Protocol {
        /// The node name of the peer.
        peer: String,
        /// What was wrong.
        reason: String,
    },

    /// A frame could not be decoded.
    #[error("bad frame: {0}")]
    Frame(#[from] FrameError),

    /// Building the TLS configuration failed.
    #[error("TLS configuration: {0}")]
    Tls(String),

    /// rustls refused a part of the TLS configuration (the CA certificate, the node's key).
    #[error("TLS configuration: {what}: {source}")]
    TlsSetup {
        /// The part being set up.
        what: &'static str,
        /// rustls's error.
        source: rustls::Error,
    },

    /// The verifier of client certificates could not be built from the cluster CA.
    #[error("TLS configuration: client certificate verifier: {0}")]
    TlsVerifier(#[source] rustls::server::VerifierBuilderError),

    /// The TLS configuration offers no cipher suite QUIC can start with.
    #[error("TLS configuration: {what}: {source}")]
    QuicCrypto {
        /// Which side (server or client crypto).
        what: &'static str,
        /// quinn's error.
        source: quinn::crypto::rustls::NoInitialCipherSuite,
    },

    /// A QUIC tuning value is out of quinn's range.
    #[error("invalid configuration: QuicTuning::{setting}: {source}")]
    Tuning {
        /// The field of `QuicTuning`.
        setting: &'static str,
        /// quinn's error.
        source: quinn::ConfigError,
    },

    /// A setting is out of range or the environment is wrong.
    #[error("invalid configuration: {0}")]
    Config(String),

    /// Making, reading or checking a certificate failed.
    #[error("certificate: {0}")]
    Certificate(String),

    /// Making a key or a certificate, or reading the CA key, failed in rcgen.
    #[error("certificate: {what}: {source}")]
    CertificateKey {
        /// What was being made or read.
        what: &'static str,
        /// rcgen's error.
        source: rcgen::Error,
    },

    /// A PEM file does not hold the certificate or key it should (`afd certs` writes them).
    #[error("certificate: {path}: {source}")]
    Pem {
        /// The file.
        path: String,
        /// The PEM parser's error.
        source: rustls::pki_types::pem::Error,
    },

    /// The peer's certificate does not parse, or is not for the name the peer claims.
    #[error("certificate: {what}: {source}")]
    PeerCertificate {
        /// What was checked.
        what: String,
        /// rustls's error.
        source: rustls::Error,
    },

    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory involved.
        path: String,
        /// The underlying error.
        source: std::io::Error,
    },

    /// The UDP socket could not be bound.
    #[error("could not bind the QUIC endpoint to {addr}: {source} (is the port in use?)")]
    Bind {
        /// The address that was asked for.
        addr: SocketAddr,
        /// The underlying error.
        source: std::io::Error,
    },

    /// A node name that cannot be used as a certificate name.
    #[error(
        "invalid node name `{name}`: use a DNS label such as `card-0` (letters, digits and `-`, \
         at most 63 characters)"
    )]
    InvalidNodeName {
        /// The rejected name.
        name: String,
    },

    /// The node name is taken in an in-process fabric.
    #[error("node name `{name}` is already used in this in-process fabric: pick another name")]
    DuplicateNode {
        /// The name that is taken.
        name: String,
    },

    /// The local endpoint or region was closed.
    #[error("the {what} was closed")]
    Closed {
        /// What was closed.
        what: &'static str,
    },
}
