//! The QUIC transport (quinn) with mutual TLS from the cluster CA.
//!
//! One quinn endpoint per node serves and dials on the same UDP socket. Between two nodes there
//! is one long-lived connection (both directions use it; if both dial at once, each side keeps
//! the first one it registered and still serves the other). Each (peer, channel) is one
//! long-lived bidirectional stream: writes go out on it as frame + payload, acknowledgments come
//! back on its other half. Nothing is set up per write.

mod acks;
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
    /// How long a landed write's acknowledgment may wait for this node's next write to the
    /// same peer to ride along with (see the crate docs on send-side completions).
    pub ack_delay: Duration,
    /// Acknowledge at once when this many landed bytes are unacknowledged on a channel.
    pub ack_every_bytes: u64,
    /// Requested UDP socket send and receive buffer sizes. Bursts that overflow the receive
    /// buffer are lost and slow QUIC down; the kernel caps the value (`net.core.rmem_max`).
    pub socket_buffer_bytes: usize,
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
            socket_buffer_bytes: 8 << 20,
            ack_delay: Duration::from_millis(1),
            ack_every_bytes: 1 << 20,
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
    /// Configurations for network paths and for loopback paths.
    network: PathConfigs,
    loopback: PathConfigs,
    address_book: RwLock<HashMap<String, SocketAddr>>,
    /// The connection used to write to each peer.
    links: Mutex<HashMap<Arc<str>, Arc<PeerLink>>>,
    /// One dial at a time per peer.
    dials: Mutex<HashMap<Arc<str>, Arc<tokio::sync::Mutex<()>>>>,
    /// Incoming channels per peer, whose owed acknowledgments ride along with writes to it.
    ack_boards: Arc<Mutex<HashMap<Arc<str>, Arc<acks::AckBoard>>>>,
    ack_clock: Arc<acks::AckClock>,
    /// In-flight byte windows per peer; they outlive reconnections.
    windows: Mutex<HashMap<Arc<str>, Arc<Semaphore>>>,
    regions: Arc<RegionTable>,
    limits: Limits,
    tuning: QuicTuning,
    closed: AtomicBool,
}

impl Shared {
    pub(crate) fn ack_board(&self, peer: &str) -> Arc<acks::AckBoard> {
        let mut boards = lock(&self.ack_boards);
        if let Some(board) = boards.get(peer) {
            return board.clone();
        }
        let board = Arc::new(acks::AckBoard::default());
        boards.insert(peer.into(), board.clone());
        board
    }

    pub(crate) fn path_configs(&self, remote: SocketAddr) -> &PathConfigs {
        if remote.ip().is_loopback() {
            &self.loopback
        } else {
            &self.network
        }
    }

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
        lock(&self.ack_boards).clear();
        self.ack_clock.stop();
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

/// Largest UDP payload on a loopback path: the loopback MTU is 65,536 bytes, less the IPv6
/// and UDP headers (IPv4 allows 19 bytes more; one value keeps it simple).
const LOOPBACK_UDP_PAYLOAD: u16 = 65_488;
/// The floor on loopback. Handshake packets are padded to it and their length field cannot
/// exceed 16,383 bytes, so it stays well below that.
const LOOPBACK_MIN_UDP_PAYLOAD: u16 = 12_000;

/// Transport settings for a path. On loopback the path MTU is known, so packets start at the
/// largest size and loss (a full socket buffer, not a small link) cannot shrink them below a
/// high floor: per-packet work is most of QUIC's cost, and 1,200-byte packets would cut
/// throughput several times.
fn transport_config(tuning: &QuicTuning, loopback: bool) -> Result<TransportConfig> {
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
        )?));
    if loopback {
        let payload = LOOPBACK_UDP_PAYLOAD.min(tuning.max_udp_payload.max(1200));
        let floor = LOOPBACK_MIN_UDP_PAYLOAD.min(payload);
        // The initial congestion window must hold whole packets of that size (RFC 9002 asks
        // for ten); quinn's default of 14,720 bytes would block the first one.
        let mut cubic = quinn::congestion::CubicConfig::default();
        cubic.initial_window(10 * u64::from(payload));
        let mut mtu = MtuDiscoveryConfig::default();
        mtu.upper_bound(payload)
            .black_hole_cooldown(Duration::from_secs(5));
        config
            .initial_mtu(payload)
            .min_mtu(floor)
            .mtu_discovery_config(Some(mtu))
            .congestion_controller_factory(Arc::new(cubic))
            // A GSO batch of such datagrams would exceed the kernel's 64 KiB per send and be
            // dropped whole.
            .enable_segmentation_offload(false);
    } else {
        let mut mtu = MtuDiscoveryConfig::default();
        mtu.upper_bound(tuning.max_udp_payload);
        config
            .initial_mtu(tuning.initial_mtu.min(tuning.max_udp_payload))
            .mtu_discovery_config(Some(mtu));
    }
    Ok(config)
}

/// Client and server configurations for one kind of path.
#[derive(Clone)]
pub(crate) struct PathConfigs {
    pub(crate) client: quinn::ClientConfig,
    pub(crate) server: Arc<quinn::ServerConfig>,
}

impl PathConfigs {
    fn new(identity: &NodeIdentity, tuning: &QuicTuning, loopback: bool) -> Result<Self> {
        let transport = Arc::new(transport_config(tuning, loopback)?);
        let crypto = |what| move |source| Error::QuicCrypto { what, source };
        let server_crypto = QuicServerConfig::try_from(tls::server_config(identity)?)
            .map_err(crypto("QUIC server crypto"))?;
        let mut server = quinn::ServerConfig::with_crypto(Arc::new(server_crypto));
        server.transport_config(transport.clone());
        let client_crypto = QuicClientConfig::try_from(tls::client_config(identity)?)
            .map_err(crypto("QUIC client crypto"))?;
        let mut client = quinn::ClientConfig::new(Arc::new(client_crypto));
        client.transport_config(transport);
        Ok(Self {
            client,
            server: Arc::new(server),
        })
    }
}

/// Asks for larger socket buffers; the kernel may grant less, which only costs speed.
fn size_socket_buffers(socket: &UdpSocket, bytes: usize) {
    let outcome = quinn::udp::UdpSocketState::new(socket.into()).and_then(|state| {
        state.set_recv_buffer_size(socket.into(), bytes)?;
        state.set_send_buffer_size(socket.into(), bytes)?;
        state.recv_buffer_size(socket.into())
    });
    match outcome {
        Ok(granted) => tracing::debug!(requested = bytes, granted, "UDP socket buffers"),
        Err(error) => {
            tracing::warn!(%error, "could not size the UDP socket buffers; throughput may suffer")
        }
    }
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
        let network = PathConfigs::new(&config.identity, &config.tuning, false)?;
        let loopback = PathConfigs::new(&config.identity, &config.tuning, true)?;

        let mut endpoint_config = quinn::EndpointConfig::default();
        endpoint_config
            .max_udp_payload_size(config.tuning.max_udp_payload.max(1200))
            .map_err(|source| Error::Tuning {
                setting: "max_udp_payload",
                source,
            })?;
        let bind = |source| Error::Bind {
            addr: config.listen,
            source,
        };
        let socket = UdpSocket::bind(config.listen).map_err(bind)?;
        size_socket_buffers(&socket, config.tuning.socket_buffer_bytes);
        let endpoint = quinn::Endpoint::new(
            endpoint_config,
            Some((*network.server).clone()),
            socket,
            Arc::new(quinn::TokioRuntime),
        )
        .map_err(bind)?;

        let shared = Arc::new(Shared {
            node,
            endpoint,
            network,
            loopback,
            address_book: RwLock::new(config.peers),
            links: Mutex::new(HashMap::new()),
            dials: Mutex::new(HashMap::new()),
            windows: Mutex::new(HashMap::new()),
            ack_boards: Arc::new(Mutex::new(HashMap::new())),
            ack_clock: Arc::new(acks::AckClock::default()),
            regions: Arc::new(RegionTable::default()),
            limits: config.limits,
            tuning: config.tuning,
            closed: AtomicBool::new(false),
        });
        tokio::spawn(serve::accept_loop(shared.clone()));
        tokio::spawn(acks::run_clock(
            shared.ack_clock.clone(),
            Arc::downgrade(&shared.ack_boards),
            shared.tuning.ack_delay,
        ));
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

    /// Closes the connection used to write to `peer`, if there is one: writes still
    /// unacknowledged on it fail with [`Error::PeerGone`], and the next write dials again (at
    /// the address book's address). For a peer known to have restarted or stalled, whose old
    /// connection would otherwise stay in use until the idle timeout.
    pub fn reset_peer(&self, peer: &str) {
        let link = lock(&self.shared.links).remove(peer);
        if let Some(link) = link {
            link.connection.close(
                VarInt::from_u32(close_code::SHUTDOWN),
                b"reset by the writer",
            );
        }
    }

    /// Nodes this endpoint currently has an open connection with.
    pub fn connected_peers(&self) -> Vec<String> {
        let links = lock(&self.shared.links);
        let mut peers: Vec<String> = links.keys().map(|peer| peer.to_string()).collect();
        peers.sort();
        peers
    }

    /// Statistics of the connection used to write to `peer` (path MTU, round-trip time,
    /// packets, losses), if one is open: for diagnosing throughput.
    pub fn connection_stats(&self, peer: &str) -> Option<quinn::ConnectionStats> {
        lock(&self.shared.links)
            .get(peer)
            .map(|link| link.connection.stats())
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
