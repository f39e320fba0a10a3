//! The server's life after a stop signal: draining, then cutting off what is left.
//!
//! While it drains the server takes no new work (the API answers 503, `/health` says it is
//! draining) and lets every request in flight finish. At the deadline it cuts off what is
//! left: every generation still running ends with an error (an SSE `error` event then
//! `data: [DONE]` for streams, an error JSON otherwise). [`Lifecycle`] holds the two flags and
//! counts the HTTP exchanges still in flight, so the server knows when it may close.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use tokio::sync::{Notify, watch};

use crate::error::ApiError;

/// What a request refused or cut off by a shutdown is told.
pub const SHUTTING_DOWN: &str = "the server is shutting down (draining): it takes no new \
     requests; send this one to another replica, or retry once it is back";

/// What a request still running at the end of the drain is told.
pub const CUT_OFF: &str = "the server is shutting down and this request was still running at \
     the end of its drain (shutdown_timeout): retry it on another replica, or once the server is \
     back";

/// Draining and cut-off flags, and the count of HTTP exchanges in flight.
#[derive(Debug)]
pub struct Lifecycle {
    draining: AtomicBool,
    cut: watch::Sender<bool>,
    in_flight: AtomicUsize,
    idle: Notify,
}

impl Default for Lifecycle {
    fn default() -> Self {
        Lifecycle {
            draining: AtomicBool::new(false),
            cut: watch::Sender::new(false),
            in_flight: AtomicUsize::new(0),
            idle: Notify::new(),
        }
    }
}

impl Lifecycle {
    /// Whether the server has stopped taking new work.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// Stops taking new work.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::Release);
    }

    /// Ends every generation still running (the drain deadline has passed).
    pub fn cut_off(&self) {
        self.start_draining();
        self.cut.send_replace(true);
    }

    /// Resolves once [`Lifecycle::cut_off`] has been called (at once if it already was).
    pub fn cut_signal(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = self.cut.subscribe();
        async move {
            // An error means the lifecycle is gone, and the server with it: cut off too.
            let _ = rx.wait_for(|cut| *cut).await;
        }
    }

    /// The error a request refused while draining gets.
    pub fn refusal() -> ApiError {
        ApiError::Unavailable(SHUTTING_DOWN.into())
    }

    /// The error a request still running at the end of the drain ends with.
    pub fn cut_off_error() -> ApiError {
        ApiError::Unavailable(CUT_OFF.into())
    }

    /// Counts one HTTP exchange until the guard is dropped (when its response has been sent
    /// or abandoned).
    pub fn exchange(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        InFlight(Arc::clone(self))
    }

    /// HTTP exchanges in flight.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }

    /// Resolves once no HTTP exchange is in flight.
    pub async fn idle(&self) {
        loop {
            let notified = self.idle.notified();
            tokio::pin!(notified);
            // Registered before the check, so a last exchange ending in between still wakes us.
            notified.as_mut().enable();
            if self.in_flight() == 0 {
                return;
            }
            notified.await;
        }
    }
}

/// One HTTP exchange in flight (see [`Lifecycle::exchange`]).
#[derive(Debug)]
pub struct InFlight(Arc<Lifecycle>);

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.0.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn idle_waits_for_the_last_exchange_and_cut_off_reaches_late_subscribers() {
        let life = Arc::new(Lifecycle::default());
        life.idle().await;
        let a = life.exchange();
        let b = life.exchange();
        assert_eq!(life.in_flight(), 2);
        let waiter = tokio::spawn({
            let life = Arc::clone(&life);
            async move { life.idle().await }
        });
        drop(a);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished(), "one exchange is still in flight");
        drop(b);
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("idle once the last exchange ended")
            .unwrap();

        assert!(!life.is_draining());
        let early = life.cut_signal();
        life.cut_off();
        assert!(life.is_draining(), "a cut-off server drains too");
        early.await;
        life.cut_signal().await;
    }
}
