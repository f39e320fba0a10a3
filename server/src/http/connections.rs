//! The open connections, so that the server can bound them without refusing work: at the
//! limit, a new connection makes room by closing the oldest idle one (no request in flight),
//! as an HTTP/1.1 client must expect of any kept-alive connection, and only when every
//! connection is busy is the new one refused. Closing at shutdown goes through here too.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::Notify;

/// One open connection, as the server's other tasks see it.
#[derive(Debug, Default)]
pub struct ConnState {
    /// Requests of this connection whose response is not finished.
    busy: AtomicUsize,
    /// Told to close at once (evicted, or the server is closing).
    close: Notify,
}

impl ConnState {
    /// Counts one request until the guard is dropped.
    pub fn request(self: &Arc<Self>) -> BusyGuard {
        self.busy.fetch_add(1, Ordering::AcqRel);
        BusyGuard(Arc::clone(self))
    }

    /// Resolves when the connection must close at once.
    pub async fn closed(&self) {
        self.close.notified().await;
    }

    fn is_idle(&self) -> bool {
        self.busy.load(Ordering::Acquire) == 0
    }
}

/// A request in flight on a connection (see [`ConnState::request`]).
#[derive(Debug)]
pub struct BusyGuard(Arc<ConnState>);

impl Drop for BusyGuard {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Every open connection, oldest first.
#[derive(Debug)]
pub struct Connections {
    open: Mutex<BTreeMap<u64, Arc<ConnState>>>,
    next_id: AtomicU64,
    limit: usize,
    emptied: Notify,
}

/// A connection that was let in: its id (to leave with) and its state.
pub type Admitted = (u64, Arc<ConnState>);

impl Connections {
    /// Room for `limit` connections (at least 1).
    pub fn new(limit: usize) -> Self {
        Connections {
            open: Mutex::new(BTreeMap::new()),
            next_id: AtomicU64::new(0),
            limit: limit.max(1),
            emptied: Notify::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Arc<ConnState>>> {
        self.open.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Lets a new connection in, closing the oldest idle one when at the limit; `None` when
    /// every connection is busy.
    pub fn admit(&self) -> Option<Admitted> {
        let mut open = self.lock();
        if open.len() >= self.limit && !Self::evict_oldest_idle(&mut open) {
            return None;
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let state = Arc::new(ConnState::default());
        open.insert(id, Arc::clone(&state));
        Some((id, state))
    }

    /// Closes the oldest idle connection (for a new one, or when file descriptors ran out);
    /// false when none is idle.
    pub fn evict_idle(&self) -> bool {
        Self::evict_oldest_idle(&mut self.lock())
    }

    fn evict_oldest_idle(open: &mut BTreeMap<u64, Arc<ConnState>>) -> bool {
        let Some(id) = open.iter().find(|(_, c)| c.is_idle()).map(|(&id, _)| id) else {
            return false;
        };
        if let Some(c) = open.remove(&id) {
            // A stored permit: the connection's task closes even if it is not waiting yet.
            c.close.notify_one();
        }
        true
    }

    /// A connection ended.
    pub fn leave(&self, id: u64) {
        let mut open = self.lock();
        open.remove(&id);
        if open.is_empty() {
            self.emptied.notify_waiters();
        }
    }

    /// Open connections.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether none is open.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Closes every connection at once.
    pub fn close_all(&self) {
        for c in std::mem::take(&mut *self.lock()).into_values() {
            c.close.notify_one();
        }
        self.emptied.notify_waiters();
    }

    /// Resolves once no connection is open.
    pub async fn empty(&self) {
        loop {
            let notified = self.emptied.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.is_empty() {
                return;
            }
            notified.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn at_the_limit_the_oldest_idle_connection_makes_room_and_busy_ones_stay() {
        let conns = Connections::new(3);
        let (a, sa) = conns.admit().unwrap();
        let (_b, sb) = conns.admit().unwrap();
        let (_c, sc) = conns.admit().unwrap();
        let busy_a = sa.request();
        let busy_b = sb.request();
        // a and b are busy: c, the oldest idle one, goes.
        let (_d, sd) = conns.admit().unwrap();
        tokio::time::timeout(std::time::Duration::from_secs(1), sc.closed())
            .await
            .expect("c was told to close");
        assert_eq!(conns.len(), 3);
        let _busy_d = sd.request();
        assert!(conns.admit().is_none(), "every connection is busy");
        drop(busy_a);
        assert!(conns.evict_idle(), "a is idle now");
        sa.closed().await;
        conns.leave(a);
        drop(busy_b);
        assert_eq!(conns.len(), 2);
        conns.close_all();
        sb.closed().await;
        conns.empty().await;
    }
}
