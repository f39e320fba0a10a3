//! A small FIFO queue that can be awaited from async code and waited on (with a timeout) from a
//! plain thread, without needing a runtime handle. Used for receive completions and for write
//! tickets.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

/// Why a pop returned nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PopError {
    /// The queue is closed and empty.
    Closed,
    /// The timeout passed with the queue still empty.
    TimedOut,
}

struct State<T> {
    items: VecDeque<T>,
    closed: bool,
    /// Threads blocked in `pop_blocking`; the condvar is signalled only when there are some
    /// (signalling costs a system call even with nobody waiting).
    blocked: usize,
}

pub(crate) struct Mailbox<T> {
    state: Mutex<State<T>>,
    condvar: Condvar,
    notify: Notify,
}

impl<T> Default for Mailbox<T> {
    fn default() -> Self {
        Self {
            state: Mutex::new(State {
                items: VecDeque::new(),
                closed: false,
                blocked: 0,
            }),
            condvar: Condvar::new(),
            notify: Notify::new(),
        }
    }
}

impl<T> Mailbox<T> {
    fn lock(&self) -> MutexGuard<'_, State<T>> {
        // A panic while holding this lock cannot leave the queue inconsistent (every critical
        // section is a single VecDeque operation), so a poisoned lock is still usable.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Appends an item; returns it back if the mailbox is closed.
    pub(crate) fn push(&self, item: T) -> Result<(), T> {
        let blocked = {
            let mut state = self.lock();
            if state.closed {
                return Err(item);
            }
            state.items.push_back(item);
            state.blocked
        };
        if blocked > 0 {
            self.condvar.notify_one();
        }
        self.notify.notify_one();
        Ok(())
    }

    /// Closes the mailbox: items already queued can still be popped, later pushes fail and
    /// waiters wake up.
    pub(crate) fn close(&self) {
        let blocked = {
            let mut state = self.lock();
            if state.closed {
                return;
            }
            state.closed = true;
            state.blocked
        };
        if blocked > 0 {
            self.condvar.notify_all();
        }
        self.notify.notify_waiters();
        // A waiter that registered between its check and `notify_waiters` gets the permit.
        self.notify.notify_one();
    }

    /// `f` of the oldest item, left in place.
    pub(crate) fn peek<R>(&self, f: impl FnOnce(&T) -> R) -> Option<R> {
        self.lock().items.front().map(f)
    }

    pub(crate) fn try_pop(&self) -> Result<Option<T>, PopError> {
        let mut state = self.lock();
        match state.items.pop_front() {
            Some(item) => Ok(Some(item)),
            None if state.closed => Err(PopError::Closed),
            None => Ok(None),
        }
    }

    /// Waits for the next item.
    pub(crate) async fn pop(&self) -> Result<T, PopError> {
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(item) = self.try_pop()? {
                return Ok(item);
            }
            notified.await;
        }
    }

    /// Blocks the calling thread until the next item or the timeout. Must not be called from
    /// an async task (it would block the runtime's worker thread).
    pub(crate) fn pop_blocking(&self, timeout: Duration) -> Result<T, PopError> {
        let deadline = Instant::now() + timeout;
        let mut state = self.lock();
        loop {
            if let Some(item) = state.items.pop_front() {
                return Ok(item);
            }
            if state.closed {
                return Err(PopError::Closed);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(PopError::TimedOut);
            }
            state.blocked += 1;
            state = self
                .condvar
                .wait_timeout(state, deadline - now)
                .map(|(guard, _)| guard)
                .unwrap_or_else(|poisoned| poisoned.into_inner().0);
            state.blocked -= 1;
        }
    }

    /// Number of queued items.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.lock().items.len()
    }
}

/// Runs a future to completion on the calling thread (for the blocking API: tokio's sync
/// primitives work without a runtime). Never call it from an async task.
pub(crate) fn block_on<F: std::future::Future>(future: F) -> F::Output {
    use std::sync::Arc;
    use std::task::{Context, Poll, Wake, Waker};

    struct ThreadWaker(std::thread::Thread);
    impl Wake for ThreadWaker {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
        fn wake_by_ref(self: &Arc<Self>) {
            self.0.unpark();
        }
    }

    let waker = Waker::from(Arc::new(ThreadWaker(std::thread::current())));
    let mut context = Context::from_waker(&waker);
    let mut future = std::pin::pin!(future);
    loop {
        match future.as_mut().poll(&mut context) {
            Poll::Ready(output) => return output,
            Poll::Pending => std::thread::park(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[tokio::test]
    async fn async_pop_sees_items_in_order() {
        let mailbox = Arc::new(Mailbox::default());
        let consumer = {
            let mailbox = mailbox.clone();
            tokio::spawn(async move {
                let mut seen = Vec::new();
                for _ in 0..100 {
                    seen.push(mailbox.pop().await.unwrap());
                }
                seen
            })
        };
        for value in 0..100 {
            mailbox.push(value).unwrap();
            if value % 7 == 0 {
                tokio::task::yield_now().await;
            }
        }
        assert_eq!(consumer.await.unwrap(), (0..100).collect::<Vec<_>>());
    }

    #[test]
    fn blocking_pop_times_out_then_receives() {
        let mailbox = Arc::new(Mailbox::default());
        assert_eq!(
            mailbox.pop_blocking(Duration::from_millis(10)),
            Err(PopError::TimedOut)
        );
        let producer = {
            let mailbox = mailbox.clone();
            std::thread::spawn(move || mailbox.push(42u32).unwrap())
        };
        assert_eq!(mailbox.pop_blocking(Duration::from_secs(10)), Ok(42));
        producer.join().unwrap();
    }

    #[tokio::test]
    async fn close_wakes_waiters_and_refuses_pushes() {
        let mailbox = Arc::new(Mailbox::<u8>::default());
        let waiter = {
            let mailbox = mailbox.clone();
            tokio::spawn(async move { mailbox.pop().await })
        };
        tokio::task::yield_now().await;
        mailbox.close();
        assert_eq!(waiter.await.unwrap(), Err(PopError::Closed));
        assert_eq!(mailbox.push(1), Err(1));
        assert_eq!(
            mailbox.pop_blocking(Duration::from_millis(1)),
            Err(PopError::Closed)
        );
    }

    #[test]
    fn items_pushed_before_close_are_still_delivered() {
        let mailbox = Mailbox::default();
        mailbox.push(1).unwrap();
        mailbox.close();
        assert_eq!(mailbox.len(), 1);
        assert_eq!(mailbox.try_pop(), Ok(Some(1)));
        assert_eq!(mailbox.try_pop(), Err(PopError::Closed));
    }
}
