//! The in-process twin: the same [`Transport`] over channels, no sockets and no TLS. Endpoints
//! created from one [`InprocFabric`] find each other by name; a write is handed to a delivery
//! task of the target (one per writer, target and channel, so ordering per channel holds),
//! which runs the same admission check and landing as the QUIC receiver.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use bytes::Bytes;
use tokio::sync::{Semaphore, mpsc};

use crate::codec::WriteHeader;
use crate::error::{Error, Result};
use crate::region::{Region, RegionConfig, RegionTable};
use crate::ticket::{PendingWrite, WriteReceipt, WriteTicket};
use crate::transport::{BoxFuture, Channel, Limits, Transport, WriteRequest, validate_node_name};

type Directory = Mutex<HashMap<String, Weak<InprocNode>>>;
/// Delivery queues from one node, per (target, channel).
type Links = HashMap<(Arc<str>, Channel), mpsc::UnboundedSender<Delivery>>;

/// A set of in-process endpoints that can reach each other by name.
#[derive(Clone, Default)]
pub struct InprocFabric {
    nodes: Arc<Directory>,
}

impl std::fmt::Debug for InprocFabric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InprocFabric").finish_non_exhaustive()
    }
}

impl InprocFabric {
    /// An empty fabric.
    pub fn new() -> Self {
        Self::default()
    }

    /// Creates the endpoint `name` with default limits.
    pub fn endpoint(&self, name: &str) -> Result<InprocTransport> {
        self.endpoint_with(name, Limits::default())
    }

    /// Creates the endpoint `name`.
    pub fn endpoint_with(&self, name: &str, limits: Limits) -> Result<InprocTransport> {
        validate_node_name(name)?;
        let mut nodes = lock(&self.nodes);
        if nodes.get(name).is_some_and(|node| node.strong_count() > 0) {
            return Err(Error::DuplicateNode {
                name: name.to_owned(),
            });
        }
        let node = Arc::new(InprocNode {
            name: name.into(),
            directory: self.nodes.clone(),
            regions: Arc::new(RegionTable::default()),
            limits,
            links: Mutex::new(HashMap::new()),
            windows: Mutex::new(HashMap::new()),
            closed: AtomicBool::new(false),
        });
        nodes.insert(name.to_owned(), Arc::downgrade(&node));
        Ok(InprocTransport { node })
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

struct Delivery {
    header: WriteHeader,
    data: Bytes,
    pending: PendingWrite,
}

struct InprocNode {
    name: Arc<str>,
    /// The fabric's directory; it holds only weak references back, so there is no cycle.
    directory: Arc<Directory>,
    regions: Arc<RegionTable>,
    limits: Limits,
    /// Delivery queues from this node, per (target, channel).
    links: Mutex<Links>,
    /// In-flight windows per target.
    windows: Mutex<HashMap<Arc<str>, Arc<Semaphore>>>,
    closed: AtomicBool,
}

impl InprocNode {
    fn find(&self, peer: &str) -> Result<Arc<InprocNode>> {
        let found = lock(&self.directory).get(peer).and_then(Weak::upgrade);
        match found {
            Some(node) if !node.closed.load(Ordering::Acquire) => Ok(node),
            _ => Err(Error::UnknownPeer {
                peer: peer.to_owned(),
            }),
        }
    }

    fn window(&self, peer: &Arc<str>) -> Arc<Semaphore> {
        lock(&self.windows)
            .entry(peer.clone())
            .or_insert_with(|| Arc::new(Semaphore::new(self.limits.window_permits() as usize)))
            .clone()
    }

    fn link(&self, target: &Arc<InprocNode>, channel: Channel) -> mpsc::UnboundedSender<Delivery> {
        let mut links = lock(&self.links);
        let key = (target.name.clone(), channel);
        if let Some(sender) = links.get(&key).filter(|sender| !sender.is_closed()) {
            return sender.clone();
        }
        let (sender, receiver) = mpsc::unbounded_channel();
        tokio::spawn(deliver(
            self.name.clone(),
            channel,
            target.name.clone(),
            Arc::downgrade(target),
            receiver,
        ));
        links.insert(key, sender.clone());
        sender
    }

    fn close(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        {
            let mut nodes = lock(&self.directory);
            if nodes
                .get(&*self.name)
                .is_some_and(|node| std::ptr::eq(node.as_ptr(), self))
            {
                nodes.remove(&*self.name);
            }
        }
        lock(&self.links).clear();
        self.regions.close_all();
    }
}

/// Lands the writes of one (writer, target, channel) in order.
async fn deliver(
    writer: Arc<str>,
    channel: Channel,
    target_name: Arc<str>,
    target: Weak<InprocNode>,
    mut queue: mpsc::UnboundedReceiver<Delivery>,
) {
    while let Some(delivery) = queue.recv().await {
        let node = match target
            .upgrade()
            .filter(|node| !node.closed.load(Ordering::Acquire))
        {
            Some(node) => node,
            None => {
                let reason = "the in-process endpoint was closed".to_owned();
                delivery.pending.fail(Error::PeerGone {
                    peer: target_name.to_string(),
                    reason,
                });
                continue;
            }
        };
        match node.regions.admit(&writer, &delivery.header) {
            Ok(region) => {
                let mut landing = region.begin_landing(&delivery.header).await;
                landing.put(&delivery.data);
                landing.finish(writer.clone(), channel, &delivery.header);
                delivery.pending.succeed();
            }
            Err(reason) => delivery.pending.refuse(reason),
        }
    }
}

/// An in-process endpoint. Dropping it closes it.
pub struct InprocTransport {
    node: Arc<InprocNode>,
}

impl std::fmt::Debug for InprocTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InprocTransport")
            .field("node", &self.node.name)
            .finish()
    }
}

impl Drop for InprocTransport {
    fn drop(&mut self) {
        self.node.close();
    }
}

impl InprocTransport {
    async fn post(&self, request: WriteRequest<'_>) -> Result<WriteTicket> {
        let node = &self.node;
        if node.closed.load(Ordering::Acquire) {
            return Err(Error::Closed { what: "endpoint" });
        }
        node.limits.check_write(&request)?;
        let target = node.find(&request.target.node)?;
        let window = node.window(&target.name);
        let cost = node.limits.window_cost(request.data.len());
        let timeout = node.limits.write_timeout;
        let permit = tokio::time::timeout(timeout, window.acquire_many_owned(cost))
            .await
            .map_err(|_| Error::Timeout {
                what: "in-flight window space",
                after: timeout,
            })?
            .map_err(|_| Error::Closed { what: "endpoint" })?;
        let header = WriteHeader {
            seq: 0,
            region: request.target.id,
            key: request.target.key,
            offset: request.offset,
            len: request.data.len() as u32,
            immediate: request.immediate,
        };
        let receipt = WriteReceipt {
            peer: target.name.clone(),
            region: header.region,
            offset: header.offset,
            len: u64::from(header.len),
            immediate: header.immediate,
        };
        let (pending, ticket) = PendingWrite::new(0, receipt, Some(permit), timeout);
        let pending = pending.with_target_len(request.target.len);
        let link = node.link(&target, request.channel);
        if let Err(mpsc::error::SendError(delivery)) = link.send(Delivery {
            header,
            data: request.data,
            pending,
        }) {
            let reason = "its delivery queue closed".to_owned();
            delivery.pending.fail(Error::PeerGone {
                peer: target.name.to_string(),
                reason,
            });
        }
        Ok(ticket)
    }
}

impl Transport for InprocTransport {
    fn node(&self) -> &str {
        &self.node.name
    }

    fn register(&self, config: RegionConfig) -> Result<Region> {
        self.node.regions.register(self.node.name.clone(), config)
    }

    fn post_write<'a>(&'a self, request: WriteRequest<'a>) -> BoxFuture<'a, Result<WriteTicket>> {
        Box::pin(self.post(request))
    }

    fn connect<'a>(&'a self, peer: &'a str) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move { self.node.find(peer).map(|_| ()) })
    }

    fn close(&self) {
        self.node.close();
    }
}
