//! Helpers shared by the integration tests: loopback QUIC clusters, in-process pairs, and a
//! semantics suite that runs against any pair of transports.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use jetstream::{
    ClusterCa, Error, InprocFabric, Limits, QuicConfig, QuicTransport, RegionConfig, Transport,
    WriteRequest,
};

pub const LOOPBACK: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 0);

/// Endpoints `names` on loopback, each knowing every other's address.
pub fn quic_cluster(names: &[&str], limits: Limits) -> Vec<Arc<dyn Transport>> {
    let ca = ClusterCa::generate().unwrap();
    let endpoints: Vec<QuicTransport> = names
        .iter()
        .map(|name| {
            let mut config = QuicConfig::new(ca.issue(name).unwrap(), LOOPBACK);
            config.limits = limits.clone();
            QuicTransport::bind(config).unwrap()
        })
        .collect();
    for endpoint in &endpoints {
        for (name, other) in names.iter().zip(&endpoints) {
            endpoint.add_peer(*name, other.local_addr().unwrap());
        }
    }
    endpoints
        .into_iter()
        .map(|endpoint| Arc::new(endpoint) as Arc<dyn Transport>)
        .collect()
}

pub fn inproc_cluster(names: &[&str], limits: Limits) -> Vec<Arc<dyn Transport>> {
    let fabric = InprocFabric::new();
    names
        .iter()
        .map(|name| {
            Arc::new(fabric.endpoint_with(name, limits.clone()).unwrap()) as Arc<dyn Transport>
        })
        .collect()
}

pub fn pattern(len: usize, seed: u8) -> Bytes {
    Bytes::from(
        (0..len)
            .map(|index| (index as u8).wrapping_mul(31).wrapping_add(seed))
            .collect::<Vec<_>>(),
    )
}

const WAIT: Duration = Duration::from_secs(10);

/// A write lands at its offset, the owner gets the completion, the writer the receipt, and
/// the owner can answer over the same connection.
pub async fn write_and_answer(attn: &dyn Transport, card: &dyn Transport) {
    let inbox = card
        .register(RegionConfig::new(8192).grant(attn.node()))
        .unwrap();
    let sums = attn
        .register(RegionConfig::new(4096).grant(card.node()))
        .unwrap();
    let rows = pattern(4096, 7);
    let ticket = attn
        .post_write(WriteRequest::new(&inbox.descriptor(), 1000, rows.clone()).immediate(0xabcd))
        .await
        .unwrap();

    let done = inbox.next_completion_timeout(WAIT).await.unwrap();
    assert_eq!(&*done.peer, attn.node());
    assert_eq!(
        (done.region, done.offset, done.len, done.immediate),
        (inbox.id(), 1000, 4096, 0xabcd)
    );
    assert_eq!(&*inbox.read(done.range()).await.unwrap(), &rows[..]);
    assert_eq!(&*inbox.read(0..1000).await.unwrap(), &[0u8; 1000][..]);

    let receipt = ticket.wait().await.unwrap();
    assert_eq!(&*receipt.peer, card.node());
    assert_eq!(
        (receipt.offset, receipt.len, receipt.immediate),
        (1000, 4096, 0xabcd)
    );

    let reply = pattern(4096, 99);
    card.write(WriteRequest::new(&sums.descriptor(), 0, reply.clone()).immediate(5))
        .await
        .unwrap();
    let back = sums.next_completion_timeout(WAIT).await.unwrap();
    assert_eq!((&*back.peer, back.immediate), (card.node(), 5));
    assert_eq!(&*sums.read(back.range()).await.unwrap(), &reply[..]);
}

/// Writes on one channel complete in posting order; the last write to a range wins.
pub async fn ordering(attn: &dyn Transport, card: &dyn Transport) {
    let inbox = card
        .register(RegionConfig::new(64 * 1024).grant(attn.node()))
        .unwrap();
    let descriptor = inbox.descriptor();
    let count = 200u64;
    let mut tickets = Vec::new();
    for index in 0..count {
        // Sizes vary so that small writes could overtake large ones if order were not kept.
        let len = if index.is_multiple_of(3) { 60_000 } else { 16 };
        let data = pattern(len, index as u8);
        tickets.push(
            attn.post_write(
                WriteRequest::new(&descriptor, 0, data)
                    .immediate(index)
                    .channel(3),
            )
            .await
            .unwrap(),
        );
    }
    let mut landed = None;
    for expected in 0..count {
        let done = inbox.next_completion_timeout(WAIT).await.unwrap();
        assert_eq!((done.immediate, done.channel), (expected, 3));
        // Receive timestamps follow landing order.
        assert!(landed.is_none_or(|t| done.landed >= t));
        landed = Some(done.landed);
    }
    for ticket in tickets {
        ticket.wait().await.unwrap();
    }
    let last = count - 1;
    let last_len = if last.is_multiple_of(3) { 60_000 } else { 16 };
    assert_eq!(
        &*inbox.read(0..last_len).await.unwrap(),
        &pattern(last_len, last as u8)[..]
    );
    // The probe shows the oldest queued completion without taking it.
    let probe = inbox.probe();
    assert_eq!(probe.oldest_landed(), None);
    for index in [count, count + 1] {
        attn.post_write(WriteRequest::new(&descriptor, 0, pattern(16, 1)).immediate(index))
            .await
            .unwrap()
            .wait()
            .await
            .unwrap();
    }
    let oldest = probe.oldest_landed().expect("two completions are queued");
    let first = inbox.next_completion_timeout(WAIT).await.unwrap();
    assert_eq!((first.immediate, first.landed), (count, oldest));
    let second = inbox.next_completion_timeout(WAIT).await.unwrap();
    assert_eq!(probe.oldest_landed(), None);
    assert!(second.landed >= first.landed);
}

/// Refused writes fail cleanly with the right error, land nothing, and do not disturb the
/// channel.
pub async fn refusals(attn: &dyn Transport, card: &dyn Transport) {
    let inbox = card
        .register(RegionConfig::new(1024).grant(attn.node()))
        .unwrap();
    let private = card.register(RegionConfig::new(1024)).unwrap();
    let good = inbox.descriptor();
    let data = pattern(512, 1);

    // Beyond the descriptor's bounds: refused before sending.
    let error = attn
        .post_write(WriteRequest::new(&good, 600, data.clone()))
        .await
        .unwrap_err();
    assert!(matches!(error, Error::OutOfBounds { .. }), "{error}");

    // A forged, longer descriptor: refused by the receiver.
    let forged = jetstream::RegionDescriptor {
        len: 1 << 20,
        ..good.clone()
    };
    let error = attn
        .write(WriteRequest::new(&forged, 4096, data.clone()))
        .await
        .unwrap_err();
    assert!(matches!(error, Error::OutOfBounds { .. }), "{error}");

    let wrong_key = jetstream::RegionDescriptor {
        key: good.key ^ 0x55,
        ..good.clone()
    };
    let error = attn
        .write(WriteRequest::new(&wrong_key, 0, data.clone()))
        .await
        .unwrap_err();
    assert!(matches!(error, Error::WrongKey { .. }), "{error}");

    let unknown = jetstream::RegionDescriptor {
        id: 999,
        ..good.clone()
    };
    let error = attn
        .write(WriteRequest::new(&unknown, 0, data.clone()))
        .await
        .unwrap_err();
    assert!(matches!(error, Error::UnknownRegion { .. }), "{error}");

    let error = attn
        .write(WriteRequest::new(&private.descriptor(), 0, data.clone()))
        .await
        .unwrap_err();
    assert!(matches!(error, Error::NotGranted { .. }), "{error}");

    // Nothing landed, no completion, and the channel still works.
    assert!(inbox.try_next_completion().unwrap().is_none());
    assert!(private.try_next_completion().unwrap().is_none());
    assert!(
        inbox
            .read(0..1024)
            .await
            .unwrap()
            .iter()
            .all(|&byte| byte == 0)
    );
    assert!(
        private
            .read(0..1024)
            .await
            .unwrap()
            .iter()
            .all(|&byte| byte == 0)
    );
    attn.write(WriteRequest::new(&good, 512, data.clone()).immediate(8))
        .await
        .unwrap();
    assert_eq!(
        inbox.next_completion_timeout(WAIT).await.unwrap().immediate,
        8
    );

    // A revoked grant stops further writes.
    inbox.revoke(attn.node());
    let error = attn
        .write(WriteRequest::new(&good, 0, data.clone()))
        .await
        .unwrap_err();
    assert!(matches!(error, Error::NotGranted { .. }), "{error}");

    // A dropped region is gone.
    drop(inbox);
    let error = attn
        .write(WriteRequest::new(&good, 0, data))
        .await
        .unwrap_err();
    assert!(matches!(error, Error::UnknownRegion { .. }), "{error}");
}

/// With a window of two writes, a third waits while the receiver cannot land anything (a view
/// is held), and proceeds once it can.
pub async fn backpressure(attn: Arc<dyn Transport>, card: &dyn Transport, write_len: usize) {
    let inbox = card
        .register(RegionConfig::new(write_len).grant(attn.node()))
        .unwrap();
    let descriptor = inbox.descriptor();
    let view = inbox.read(0..write_len).await.unwrap();
    let mut tickets = Vec::new();
    for index in 0..2u64 {
        let request = WriteRequest::new(&descriptor, 0, pattern(write_len, 0)).immediate(index);
        tickets.push(attn.post_write(request).await.unwrap());
    }
    let third = {
        let attn = attn.clone();
        let descriptor = descriptor.clone();
        tokio::spawn(async move {
            let request = WriteRequest::new(&descriptor, 0, pattern(write_len, 0)).immediate(2);
            attn.post_write(request)
                .await
                .map(|ticket| ticket.try_result().is_some())
        })
    };
    // The receiver cannot land while the view is held, so nothing is acknowledged and the
    // third post cannot get window space however long we wait.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!third.is_finished(), "a post went past a full window");
    assert!(inbox.try_next_completion().unwrap().is_none());
    drop(view);
    third.await.unwrap().unwrap();
    for ticket in tickets {
        ticket.wait().await.unwrap();
    }
    for expected in 0..3 {
        assert_eq!(
            inbox.next_completion_timeout(WAIT).await.unwrap().immediate,
            expected
        );
    }
}
