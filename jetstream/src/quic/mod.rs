//! The QUIC transport (quinn) with mutual TLS from the cluster CA.
//!
//! One quinn endpoint per node serves and dials on the same UDP socket. Between two nodes there
//! is one long-lived connection (both directions use it; if both dial at once, each side keeps
//! the first one it registered and still serves the other). Each (peer, channel) is one
//! long-lived bidirectional stream: writes go out on it as frame + payload, acknowledgments come
//! back on its other half. Nothing is set up per write.

mod link;
mod reader;
mod serve;

use std::collections::HashMap;
use std::net::{SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{IdleTimeout, MtuDiscoveryConfig, TransportConfig, VarInt};
use tokio::sync::Semaphore;

use crate::certs::NodeIdentity;
use crate::error::{Error, Result};
use crate::region::{Region, RegionConfig, RegionTable};
use crate::ticket::WriteTicket;
use crate::tls;
use crate::transport::{BoxFuture, Limits, Transport, WriteRequest, validate_node_name};

use link::PeerLink;

/// Application close codes carried in QUIC CONNECTION_CLOSE.
pub(crate) mod close_code {
    /// The endpoint is shutting down.
    pub(crate) const SHUTDOWN: u32 = 0;
    /// The peer's claimed name does not match its certificate.
    pub(crate) const IDENTITY: u32 = 1;
    /// The peer broke the protocol.
    pub(crate) const PROTOCOL: u32 = 2;
}

/// QUIC-specific settings; every one has a default that suits a cluster network.
#[derive(Debug, Clone)]
pub struct QuicTuning {
    /// Longest wait for a connection (handshake and hello) to a peer.
    pub connect_timeout: Duration,
    /// A connection with no traffic at all for this long is considered dead.
    pub idle_timeout: Duration,
    /// Keep-alive interval, so idle connections stay open (must be below `idle_timeout`).
    pub keep_alive: Duration,
    /// Bytes a peer may send on one channel before the receiver has consumed them.
    pub stream_receive_window: u64,
    /// Bytes a peer may send over all channels of a connection before they are consumed.
    pub connection_receive_window: u64,
    /// Bytes of unacknowledged data buffered for sending per connection.
    pub send_window: u64,
    /// Largest UDP payload, and the upper bound of path MTU discovery. Large values only cost
    /// a few probes on paths that do not support them; on loopback they save most per-packet
    /// work.
    pub max_udp_payload: u16,
    /// UDP payload size used before MTU discovery completes (at least 1200).
    pub initial_mtu: u16,
    /// Most channels a peer may open towards this node.
    pub max_channels: u32,
}

impl Default for QuicTuning {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(30),
            keep_alive: Duration::from_secs(5),
            stream_receive_window: 16 << 20,
            connection_receive_window: 64 << 20,
            send_window: 64 << 20,
            max_udp_payload: 65_527,
            initial_mtu: 1200,
            max_channels: 1024,
        }
    }
}

/// How to build a [`QuicTransport`].
#[derive(Debug, Clone)]
pub struct QuicConfig {
    /// This node's certificate and key and the cluster CA; the certificate's name is the
    /// endpoint's node name.
    pub identity: NodeIdentity,
    /// UDP address to listen on; port 0 picks a free port (see [`QuicTransport::local_addr`]).
    pub listen: SocketAddr,
    /// Known peers, node name to address; more can be added with [`QuicTransport::add_peer`].
    /// A peer that dials this node needs no entry to be written back to.
    pub peers: HashMap<String, SocketAddr>,
    /// Backpressure and size limits.
    pub limits: Limits,
    /// QUIC settings.
    pub tuning: QuicTuning,
}

impl QuicConfig {
    /// Defaults for `identity` listening on `listen`.
    pub fn new(identity: NodeIdentity, listen: SocketAddr) -> Self {
        Self {
            identity,
            listen,
            peers: HashMap::new(),
            limits: Limits::default(),
            tuning: QuicTuning::default(),
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// State shared by the endpoint handle and its background tasks.
pub(crate) struct Shared {
    node: Arc<str>,
    endpoint: quinn::Endpoint,
    client_config: quinn::ClientConfig,
    address_book: RwLock<HashMap<String, SocketAddr>>,
    /// The connection used to write to each peer.
    links: Mutex<HashMap<Arc<str>, Arc<PeerLink>>>,
    /// One dial at a time per peer.
    dials: Mutex<HashMap<Arc<str>, Arc<tokio::sync::Mutex<()>>>>,
    /// In-flight byte windows per peer; they outlive reconnections.
    windows: Mutex<HashMap<Arc<str>, Arc<Semaphore>>>,
    regions: Arc<RegionTable>,
    limits: Limits,
    tuning: QuicTuning,
    closed: AtomicBool,
}

impl Shared {
    fn window(&self, peer: &str) -> Arc<Semaphore> {
        let mut windows = lock(&self.windows);
        if let Some(window) = windows.get(peer) {
            return window.clone();
        }
        let window = Arc::new(Semaphore::new(self.limits.window_permits() as usize));
        windows.insert(peer.into(), window.clone());
        window
    }

    fn close(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        self.endpoint
            .close(VarInt::from_u32(close_code::SHUTDOWN), b"endpoint closed");
        lock(&self.links).clear();
        self.regions.close_all();
    }
}

/// A data-plane endpoint on the network. Dropping it closes it.
pub struct QuicTransport {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for QuicTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuicTransport")
            .field("node", &self.shared.node)
            .finish_non_exhaustive()
    }
}

impl Drop for QuicTransport {
    fn drop(&mut self) {
        self.shared.close();
    }
}

fn transport_config(tuning: &QuicTuning) -> Result<TransportConfig> {
    let var = |value: u64, what: &str| {
        VarInt::from_u64(value)
            .map_err(|_| Error::Config(format!("QuicTuning::{what} is too large: {value}")))
    };
    let mut config = TransportConfig::default();
    config
        .max_concurrent_bidi_streams(VarInt::from_u32(tuning.max_channels.saturating_add(1)))
        .max_concurrent_uni_streams(VarInt::from_u32(0))
        .stream_receive_window(var(tuning.stream_receive_window, "stream_receive_window")?)
        .receive_window(var(
            tuning.connection_receive_window,
            "connection_receive_window",
        )?)
        .send_window(tuning.send_window)
        .keep_alive_interval(Some(tuning.keep_alive))
        .max_idle_timeout(Some(IdleTimeout::try_from(tuning.idle_timeout).map_err(
            |_| {
                Error::Config(format!(
                    "QuicTuning::idle_timeout {:?} is too large",
                    tuning.idle_timeout
                ))
            },
        )?))
        .initial_mtu(tuning.initial_mtu.min(tuning.max_udp_payload));
    let mut mtu = MtuDiscoveryConfig::default();
    mtu.upper_bound(tuning.max_udp_payload);
    config.mtu_discovery_config(Some(mtu));
    Ok(config)
}

impl QuicTransport {
    /// Binds the endpoint and starts accepting peers. Must be called inside a tokio runtime
    /// (the endpoint's tasks run on it).
    pub fn bind(config: QuicConfig) -> Result<Self> {
        let node: Arc<str> = config.identity.node.as_str().into();
        validate_node_name(&node)?;
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(Error::Config(
                "QuicTransport::bind must be called inside a tokio runtime".into(),
            ));
        }
        let transport = Arc::new(transport_config(&config.tuning)?);
        let server_crypto = QuicServerConfig::try_from(tls::server_config(&config.identity)?)
            .map_err(|error| Error::Tls(format!("QUIC server crypto: {error}")))?;
        let mut server_config = quinn::ServerConfig::with_crypto(Arc::new(server_crypto));
        server_config.transport_config(transport.clone());
        let client_crypto = QuicClientConfig::try_from(tls::client_config(&config.identity)?)
            .map_err(|error| Error::Tls(format!("QUIC client crypto: {error}")))?;
        let mut client_config = quinn::ClientConfig::new(Arc::new(client_crypto));
        client_config.transport_config(transport);

        let mut endpoint_config = quinn::EndpointConfig::default();
        endpoint_config
            .max_udp_payload_size(config.tuning.max_udp_payload.max(1200))
            .map_err(|error| Error::Config(format!("QuicTuning::max_udp_payload: {error}")))?;
        let bind = |source| Error::Bind {
            addr: config.listen,
            source,
        };
        let socket = UdpSocket::bind(config.listen).map_err(bind)?;
        let endpoint = quinn::Endpoint::new(
            endpoint_config,
            Some(server_config),
            socket,
            Arc::new(quinn::TokioRuntime),
        )
        .map_err(bind)?;

        let shared = Arc::new(Shared {
            node,
            endpoint,
            client_config,
            address_book: RwLock::new(config.peers),
            links: Mutex::new(HashMap::new()),
            dials: Mutex::new(HashMap::new()),
            windows: Mutex::new(HashMap::new()),
            regions: Arc::new(RegionTable::default()),
            limits: config.limits,
            tuning: config.tuning,
            closed: AtomicBool::new(false),
        });
        tokio::spawn(serve::accept_loop(shared.clone()));
        Ok(Self { shared })
    }

    /// The UDP address the endpoint is bound to.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.shared
            .endpoint
            .local_addr()
            .map_err(|source| Error::Io {
                path: "QUIC socket".into(),
                source,
            })
    }

    /// Adds or replaces a peer's address (used for the next connection to it).
    pub fn add_peer(&self, node: impl Into<String>, addr: SocketAddr) {
        self.shared
            .address_book
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .insert(node.into(), addr);
    }

    /// Nodes this endpoint currently has an open connection with.
    pub fn connected_peers(&self) -> Vec<String> {
        let links = lock(&self.shared.links);
        let mut peers: Vec<String> = links.keys().map(|peer| peer.to_string()).collect();
        peers.sort();
        peers
    }

    async fn post(&self, request: WriteRequest<'_>) -> Result<WriteTicket> {
        let shared = &self.shared;
        if shared.closed.load(Ordering::Acquire) {
            return Err(Error::Closed { what: "endpoint" });
        }
        shared.limits.check_write(&request)?;
        let link = link::connect(shared, &request.target.node).await?;
        let window = shared.window(&request.target.node);
        let cost = shared.limits.window_cost(request.data.len());
        let timeout = shared.limits.write_timeout;
        let permit = tokio::time::timeout(timeout, window.acquire_many_owned(cost))
            .await
            .map_err(|_| Error::Timeout {
                what: "in-flight window space",
                after: timeout,
            })?
            .map_err(|_| Error::Closed { what: "endpoint" })?;
        let channel = link.channel(shared, request.channel).await?;
        channel.send(request, permit, timeout).await
    }
}

impl Transport for QuicTransport {
    fn node(&self) -> &str {
        &self.shared.node
    }

    fn register(&self, config: RegionConfig) -> Result<Region> {
        self.shared
            .regions
            .register(self.shared.node.clone(), config)
    }

    fn post_write<'a>(&'a self, request: WriteRequest<'a>) -> BoxFuture<'a, Result<WriteTicket>> {
        Box::pin(self.post(request))
    }

    fn connect<'a>(&'a self, peer: &'a str) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move { link::connect(&self.shared, peer).await.map(|_| ()) })
    }

    fn close(&self) {
        self.shared.close();
    }
}
