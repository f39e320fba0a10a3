//! Registered memory regions: descriptors, grants, local views, receive completions, and the
//! admission check every incoming write passes before a byte of it lands.

use std::collections::{HashMap, HashSet};
use std::ops::{Deref, DerefMut, Range};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, RwLock, Weak};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::{OwnedRwLockMappedWriteGuard, OwnedRwLockReadGuard, OwnedRwLockWriteGuard};

use crate::codec::{NackReason, WriteHeader};
use crate::error::{Error, Result};
use crate::mailbox::{Mailbox, PopError};

/// Region ids are small integers chosen by the owner, unique per endpoint.
pub type RegionId = u32;

/// What a writer needs to target a region: a plain value to pass over the control plane.
///
/// Holding a descriptor is not enough to write: the owner must also grant the region to the
/// writing node, and the connection proves the writer's node name with its certificate.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RegionDescriptor {
    /// The node that owns the region.
    pub node: String,
    /// The region id on that node.
    pub id: RegionId,
    /// Length in bytes.
    pub len: u64,
    /// The region's random 64-bit key; every write must carry it.
    pub key: u64,
}

impl RegionDescriptor {
    /// Checks that `len` bytes at `offset` fit in the region.
    pub fn check_range(&self, offset: u64, len: u64) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::OutOfBounds {
                region: self.id,
                offset,
                len,
                region_len: self.len,
            }),
        }
    }
}

/// How to register a region.
#[derive(Debug, Clone, Default)]
pub struct RegionConfig {
    /// Length in bytes; the memory starts zeroed.
    pub len: usize,
    /// Nodes allowed to write into the region (more can be granted later).
    pub granted_to: Vec<String>,
}

impl RegionConfig {
    /// A region of `len` bytes granted to nobody yet.
    pub fn new(len: usize) -> Self {
        Self {
            len,
            granted_to: Vec::new(),
        }
    }

    /// Also grants the region to `node`.
    pub fn grant(mut self, node: impl Into<String>) -> Self {
        self.granted_to.push(node.into());
        self
    }
}

/// A receive-side completion: a write from `peer` landed in one of this node's regions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// The node that wrote (proved by its certificate on QUIC).
    pub peer: Arc<str>,
    /// The channel the write came on.
    pub channel: u32,
    /// The region written to.
    pub region: RegionId,
    /// Where the bytes start.
    pub offset: u64,
    /// How many bytes landed.
    pub len: u64,
    /// The writer's immediate value.
    pub immediate: u64,
    /// When the last byte landed (a receive timestamp, as a NIC puts on its completions):
    /// consumers of several regions use it to serve their work in arrival order.
    pub landed: Instant,
}

impl Completion {
    /// The written byte range, ready for [`Region::read`].
    pub fn range(&self) -> Range<usize> {
        // Admission checked offset + len <= region length, which is a usize.
        self.offset as usize..(self.offset + self.len) as usize
    }
}

pub(crate) struct RegionShared {
    pub(crate) id: RegionId,
    pub(crate) key: u64,
    pub(crate) len: usize,
    memory: Arc<tokio::sync::RwLock<Box<[u8]>>>,
    grants: RwLock<HashSet<String>>,
    pub(crate) completions: Mailbox<Completion>,
}

impl RegionShared {
    fn is_granted(&self, node: &str) -> bool {
        self.grants
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .contains(node)
    }

    /// [`RegionShared::begin_landing`] if the memory is free right now.
    pub(crate) fn try_begin_landing(self: &Arc<Self>, header: &WriteHeader) -> Option<Landing> {
        let guard = self.memory.clone().try_write_owned().ok()?;
        let start = header.offset as usize;
        Some(Landing {
            region: self.clone(),
            guard,
            at: start,
            end: start + header.len as usize,
        })
    }

    /// Takes the region's write lock for one write; bytes are then copied in chunk by chunk as
    /// they arrive, so a local reader never sees a write half landed.
    pub(crate) async fn begin_landing(self: &Arc<Self>, header: &WriteHeader) -> Landing {
        let guard = self.memory.clone().write_owned().await;
        let start = header.offset as usize;
        Landing {
            region: self.clone(),
            guard,
            at: start,
            end: start + header.len as usize,
        }
    }
}

/// One admitted write being copied into region memory.
pub(crate) struct Landing {
    region: Arc<RegionShared>,
    guard: OwnedRwLockWriteGuard<Box<[u8]>>,
    at: usize,
    end: usize,
}

impl Landing {
    /// Bytes still expected.
    pub(crate) fn remaining(&self) -> usize {
        self.end - self.at
    }

    /// Copies the next bytes of the payload in; extra bytes beyond the admitted length are
    /// ignored (callers never pass more than `remaining`).
    pub(crate) fn put(&mut self, bytes: &[u8]) {
        let take = bytes.len().min(self.remaining());
        self.guard[self.at..self.at + take].copy_from_slice(&bytes[..take]);
        self.at += take;
    }

    /// Releases the memory and delivers the completion to the region's owner.
    pub(crate) fn finish(self, peer: Arc<str>, channel: u32, header: &WriteHeader) {
        drop(self.guard);
        // A closed mailbox means the owner dropped the region: nobody is left to tell.
        let _ = self.region.completions.push(Completion {
            peer,
            channel,
            region: header.region,
            offset: header.offset,
            len: u64::from(header.len),
            immediate: header.immediate,
            landed: Instant::now(),
        });
    }
}

/// The regions one endpoint owns.
#[derive(Default)]
pub(crate) struct RegionTable {
    regions: RwLock<HashMap<RegionId, Arc<RegionShared>>>,
    next_id: AtomicU32,
}

impl RegionTable {
    pub(crate) fn register(
        self: &Arc<Self>,
        node: Arc<str>,
        config: RegionConfig,
    ) -> Result<Region> {
        let memory = vec![0u8; config.len].into_boxed_slice();
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let shared = Arc::new(RegionShared {
            id,
            key: rand::random(),
            len: config.len,
            memory: Arc::new(tokio::sync::RwLock::new(memory)),
            grants: RwLock::new(config.granted_to.into_iter().collect()),
            completions: Mailbox::default(),
        });
        self.regions
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .insert(id, shared.clone());
        Ok(Region {
            shared,
            node,
            table: Arc::downgrade(self),
        })
    }

    /// Decides whether `writer` may land `header`; pure apart from reading the table.
    pub(crate) fn admit(
        &self,
        writer: &str,
        header: &WriteHeader,
    ) -> Result<Arc<RegionShared>, NackReason> {
        let regions = self
            .regions
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let region = regions
            .get(&header.region)
            .ok_or(NackReason::UnknownRegion)?;
        if region.key != header.key {
            return Err(NackReason::WrongKey);
        }
        if !region.is_granted(writer) {
            return Err(NackReason::NotGranted);
        }
        match header.offset.checked_add(u64::from(header.len)) {
            Some(end) if end <= region.len as u64 => Ok(region.clone()),
            _ => Err(NackReason::OutOfBounds),
        }
    }

    fn remove(&self, id: RegionId) {
        self.regions
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .remove(&id);
    }

    /// Closes every region's completion queue (the endpoint is shutting down).
    pub(crate) fn close_all(&self) {
        for region in self
            .regions
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .values()
        {
            region.completions.close();
        }
    }
}

/// A registered region, owned by the node that registered it.
///
/// Dropping it deregisters the region: later writes to it fail with
/// [`Error::UnknownRegion`]; views still held stay valid. The memory is plain bytes with no
/// alignment promised beyond one byte: decode values from views with unaligned reads (for
/// example `f32::from_le_bytes`) rather than by casting pointers.
pub struct Region {
    shared: Arc<RegionShared>,
    node: Arc<str>,
    table: Weak<RegionTable>,
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("node", &self.node)
            .field("id", &self.shared.id)
            .field("len", &self.shared.len)
            .finish()
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        if let Some(table) = self.table.upgrade() {
            table.remove(self.shared.id);
        }
        self.shared.completions.close();
    }
}

impl Region {
    /// The descriptor to hand to writers (over the control plane).
    pub fn descriptor(&self) -> RegionDescriptor {
        RegionDescriptor {
            node: self.node.to_string(),
            id: self.shared.id,
            len: self.shared.len as u64,
            key: self.shared.key,
        }
    }

    /// The region id.
    pub fn id(&self) -> RegionId {
        self.shared.id
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.shared.len
    }

    /// Whether the region has zero length.
    pub fn is_empty(&self) -> bool {
        self.shared.len == 0
    }

    /// Allows `node` to write into this region from now on.
    pub fn grant(&self, node: impl Into<String>) {
        self.shared
            .grants
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .insert(node.into());
    }

    /// Stops `node` from writing into this region; writes already admitted still land.
    pub fn revoke(&self, node: &str) {
        self.shared
            .grants
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .remove(node);
    }

    fn check(&self, range: &Range<usize>) -> Result<()> {
        if range.start <= range.end && range.end <= self.shared.len {
            Ok(())
        } else {
            Err(Error::OutOfBounds {
                region: self.shared.id,
                offset: range.start as u64,
                len: range.end.saturating_sub(range.start) as u64,
                region_len: self.shared.len as u64,
            })
        }
    }

    /// A read-only view of `range` of the region's memory, without copying. While any view is
    /// held, incoming writes to this region wait (they never tear a view).
    pub async fn read(&self, range: Range<usize>) -> Result<RegionView> {
        self.check(&range)?;
        let guard = self.shared.memory.clone().read_owned().await;
        Ok(RegionView {
            guard: OwnedRwLockReadGuard::map(guard, |memory| &memory[range]),
        })
    }

    /// [`Region::read`] for a plain (non-async) thread; needs no runtime handle. Never call it
    /// from an async task (it would block a runtime thread): use `read().await` there.
    pub fn read_blocking(&self, range: Range<usize>) -> Result<RegionView> {
        self.check(&range)?;
        let guard = crate::mailbox::block_on(self.shared.memory.clone().read_owned());
        Ok(RegionView {
            guard: OwnedRwLockReadGuard::map(guard, |memory| &memory[range]),
        })
    }

    /// A writable view of `range` of the owner's own memory (to clear or prepare it). Incoming
    /// writes wait while it is held.
    pub async fn write_local(&self, range: Range<usize>) -> Result<RegionViewMut> {
        self.check(&range)?;
        let guard = self.shared.memory.clone().write_owned().await;
        Ok(RegionViewMut {
            guard: OwnedRwLockWriteGuard::map(guard, |memory| &mut memory[range]),
        })
    }

    /// The next receive completion of this region, in landing order.
    pub async fn next_completion(&self) -> Result<Completion> {
        self.shared
            .completions
            .pop()
            .await
            .map_err(|_| Error::Closed { what: "region" })
    }

    /// [`Region::next_completion`] with a timeout.
    pub async fn next_completion_timeout(&self, timeout: Duration) -> Result<Completion> {
        tokio::time::timeout(timeout, self.next_completion())
            .await
            .map_err(|_| Error::Timeout {
                what: "a receive completion",
                after: timeout,
            })?
    }

    /// Blocks the calling (non-async) thread until the next completion or the timeout. Needs no
    /// runtime handle.
    pub fn next_completion_blocking(&self, timeout: Duration) -> Result<Completion> {
        self.shared
            .completions
            .pop_blocking(timeout)
            .map_err(|error| match error {
                PopError::Closed => Error::Closed { what: "region" },
                PopError::TimedOut => Error::Timeout {
                    what: "a receive completion",
                    after: timeout,
                },
            })
    }

    /// The next completion if one is already queued.
    pub fn try_next_completion(&self) -> Result<Option<Completion>> {
        self.shared
            .completions
            .try_pop()
            .map_err(|_| Error::Closed { what: "region" })
    }

    /// A handle that shows, from any thread, when this region's oldest queued completion
    /// landed; it neither pops nor keeps the region registered.
    pub fn probe(&self) -> CompletionProbe {
        CompletionProbe {
            shared: self.shared.clone(),
        }
    }
}

/// See [`Region::probe`].
#[derive(Clone)]
pub struct CompletionProbe {
    shared: Arc<RegionShared>,
}

impl std::fmt::Debug for CompletionProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompletionProbe")
            .field("region", &self.shared.id)
            .finish()
    }
}

impl CompletionProbe {
    /// When the oldest completion still queued landed; `None` when none is queued.
    pub fn oldest_landed(&self) -> Option<Instant> {
        self.shared.completions.peek(|c| c.landed)
    }
}

/// A borrowed, read-only byte range of a region (no copy). Derefs to `[u8]`.
pub struct RegionView {
    guard: OwnedRwLockReadGuard<Box<[u8]>, [u8]>,
}

impl Deref for RegionView {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.guard
    }
}

/// A borrowed, writable byte range of the owner's region. Derefs to `[u8]`.
pub struct RegionViewMut {
    guard: OwnedRwLockMappedWriteGuard<Box<[u8]>, [u8]>,
}

impl Deref for RegionViewMut {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.guard
    }
}

impl DerefMut for RegionViewMut {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.guard
    }
}

#[cfg(test)]
mod tests;
