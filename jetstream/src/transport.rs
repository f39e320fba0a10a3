//! The [`Transport`] trait both implementations share, the write request, and the limits.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use bytes::Bytes;

use crate::error::{Error, Result};
use crate::region::{Region, RegionConfig, RegionDescriptor};
use crate::ticket::{WriteReceipt, WriteTicket};

/// A boxed, sendable future (keeps [`Transport`] usable as `dyn Transport`).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Limits shared by both transports.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Most bytes of writes to one peer that may be posted but not yet acknowledged. A
    /// `post_write` beyond it waits (backpressure). A single larger write waits until nothing
    /// else is in flight, then goes alone.
    pub max_in_flight_bytes: u64,
    /// Largest single write; the receiver refuses larger frames before reading their payload.
    /// Both sides should agree.
    pub max_write_bytes: u64,
    /// How long a write may wait for window space, and then for its acknowledgment, before it
    /// fails with [`Error::Timeout`].
    pub write_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_in_flight_bytes: 64 << 20,
            max_write_bytes: 64 << 20,
            write_timeout: Duration::from_secs(10),
        }
    }
}

impl Limits {
    /// Window permits a write of `len` bytes takes (clamped so that one write can always go).
    pub(crate) fn window_cost(&self, len: usize) -> u32 {
        let window = self.window_permits();
        (len as u64).min(u64::from(window)) as u32
    }

    pub(crate) fn window_permits(&self) -> u32 {
        self.max_in_flight_bytes.clamp(1, u64::from(u32::MAX)) as u32
    }

    /// Checks a write against the sender-side rules: size limit and the descriptor's bounds.
    pub(crate) fn check_write(&self, request: &WriteRequest<'_>) -> Result<()> {
        let len = request.data.len() as u64;
        let max = self.max_write_bytes.min(u64::from(u32::MAX));
        if len > max {
            return Err(Error::TooLarge { len, max });
        }
        request.target.check_range(request.offset, len)
    }
}

/// Ordering is guaranteed per (peer, channel); independent flows can use separate channels so
/// that one does not wait behind the other.
pub type Channel = u32;

/// One one-sided write: `data` lands at `offset` in the region `target` describes, and the
/// target's owner gets a completion carrying `immediate`.
#[derive(Debug, Clone)]
pub struct WriteRequest<'a> {
    /// The region to write into (it names the node).
    pub target: &'a RegionDescriptor,
    /// Byte offset in the region.
    pub offset: u64,
    /// The bytes; `Bytes` so that the transport sends them without copying.
    pub data: Bytes,
    /// Delivered with the receive completion (for example step, layer and micro-batch).
    pub immediate: u64,
    /// Ordering channel; 0 unless set.
    pub channel: Channel,
}

impl<'a> WriteRequest<'a> {
    /// A write of `data` at `offset` with immediate 0 on channel 0.
    pub fn new(target: &'a RegionDescriptor, offset: u64, data: Bytes) -> Self {
        Self {
            target,
            offset,
            data,
            immediate: 0,
            channel: 0,
        }
    }

    /// Sets the immediate value.
    pub fn immediate(mut self, immediate: u64) -> Self {
        self.immediate = immediate;
        self
    }

    /// Sets the ordering channel.
    pub fn channel(mut self, channel: Channel) -> Self {
        self.channel = channel;
        self
    }
}

/// An endpoint of the data plane. Implemented by [`crate::QuicTransport`] (the real network)
/// and [`crate::InprocTransport`] (channels in one process); the semantics are the same.
pub trait Transport: Send + Sync {
    /// This endpoint's node name.
    fn node(&self) -> &str;

    /// Registers a zeroed region of `config.len` bytes owned by this endpoint.
    fn register(&self, config: RegionConfig) -> Result<Region>;

    /// Posts a write. Resolves once the write is queued on its channel, after waiting for
    /// in-flight window space (backpressure) and, on first use, for the connection. Writes
    /// posted one after another on the same channel land in that order. The returned ticket
    /// resolves when the target acknowledges that the bytes landed.
    fn post_write<'a>(&'a self, request: WriteRequest<'a>) -> BoxFuture<'a, Result<WriteTicket>>;

    /// Posts a write and waits for its acknowledgment.
    fn write<'a>(&'a self, request: WriteRequest<'a>) -> BoxFuture<'a, Result<WriteReceipt>> {
        Box::pin(async move { self.post_write(request).await?.wait().await })
    }

    /// Opens the connection to `peer` now rather than at the first write.
    fn connect<'a>(&'a self, peer: &'a str) -> BoxFuture<'a, Result<()>>;

    /// Shuts the endpoint down: connections close, unacknowledged writes fail, and every
    /// region's completion queue is closed once drained.
    fn close(&self);
}

/// Checks that `name` can serve as a node name: a DNS label (it is the certificate's name).
pub fn validate_node_name(name: &str) -> Result<()> {
    let valid = !name.is_empty()
        && name.len() <= crate::codec::MAX_NAME_LEN
        && name
            .bytes()
            .all(|byte| byte.is_ascii_alphanumeric() || byte == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-');
    if valid {
        Ok(())
    } else {
        Err(Error::InvalidNodeName {
            name: name.to_owned(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_names_are_dns_labels() {
        for good in ["a", "card-0", "attention0", "A-b-C"] {
            assert!(validate_node_name(good).is_ok(), "{good}");
        }
        let too_long = "x".repeat(64);
        for bad in ["", "-a", "a-", "a.b", "a_b", "é", too_long.as_str()] {
            assert!(validate_node_name(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn sender_checks_size_and_bounds() {
        let target = RegionDescriptor {
            node: "n".into(),
            id: 0,
            len: 100,
            key: 1,
        };
        let limits = Limits {
            max_write_bytes: 64,
            ..Limits::default()
        };
        assert!(
            limits
                .check_write(&WriteRequest::new(&target, 0, Bytes::from(vec![0; 64])))
                .is_ok()
        );
        assert!(matches!(
            limits.check_write(&WriteRequest::new(&target, 0, Bytes::from(vec![0; 65]))),
            Err(Error::TooLarge { len: 65, max: 64 })
        ));
        assert!(matches!(
            limits.check_write(&WriteRequest::new(&target, 40, Bytes::from(vec![0; 61]))),
            Err(Error::OutOfBounds { .. })
        ));
        assert!(
            limits
                .check_write(&WriteRequest::new(&target, u64::MAX, Bytes::new()))
                .is_err()
        );
    }

    #[test]
    fn window_cost_is_clamped_to_the_window() {
        let limits = Limits {
            max_in_flight_bytes: 1000,
            ..Limits::default()
        };
        assert_eq!(limits.window_cost(10), 10);
        assert_eq!(limits.window_cost(5000), 1000);
    }
}
