//! QUIC endpoints on runtimes of their own, driven by plain threads (`EndpointRuntime`): the
//! way afd's attention node and cards use them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use jetstream::{
    ClusterCa, EndpointRuntime, QuicConfig, QuicTransport, RegionConfig, Transport, WriteRequest,
};

const LOOPBACK: std::net::SocketAddr =
    std::net::SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 0);

/// Two endpoints, `attn` and `card-0`, each bound inside its own runtime.
fn pair() -> [(Arc<EndpointRuntime>, Arc<QuicTransport>); 2] {
    let ca = ClusterCa::generate().expect("cluster CA");
    let bind = |name: &str| {
        let runtime = EndpointRuntime::new(name).expect("runtime");
        let transport = {
            let _guard = runtime.enter();
            Arc::new(
                QuicTransport::bind(QuicConfig::new(ca.issue(name).expect("identity"), LOOPBACK))
                    .expect("bind"),
            )
        };
        (runtime, transport)
    };
    let (attn, card) = (bind("attn"), bind("card-0"));
    attn.1
        .add_peer("card-0", card.1.local_addr().expect("card address"));
    card.1
        .add_peer("attn", attn.1.local_addr().expect("attn address"));
    [attn, card]
}

#[test]
fn plain_threads_exchange_messages_through_their_own_runtimes() {
    let [(attn_runtime, attn), (card_runtime, card)] = pair();
    let inbox = card
        .register(RegionConfig::new(4096).grant("attn"))
        .expect("inbox");
    let replies = attn
        .register(RegionConfig::new(4096).grant("card-0"))
        .expect("replies");
    let (inbox_at, replies_at) = (inbox.descriptor(), replies.descriptor());
    const ROUNDS: u64 = 60;
    // The card: waits on its runtime, answers each message with its first byte plus one.
    let card_thread = std::thread::spawn(move || {
        for _ in 0..ROUNDS {
            let done = card_runtime
                .block_on(inbox.next_completion_timeout(Duration::from_secs(10)))
                .expect("a message");
            let first = inbox.read_blocking(done.range()).expect("view")[0];
            let answer = Bytes::from(vec![first.wrapping_add(1); 1000]);
            let _ticket = card_runtime
                .block_on_then_flush(card.post_write(
                    WriteRequest::new(&replies_at, 0, answer).immediate(done.immediate),
                ))
                .expect("reply posted");
        }
    });
    for round in 0..ROUNDS {
        if round % 20 == 10 {
            // Long enough for both idle drivers to take over, and to hand back.
            std::thread::sleep(EndpointRuntime::IDLE_AFTER * 3);
        }
        let message = Bytes::from(vec![round as u8; 3000]);
        let _ticket = attn_runtime
            .block_on_then_flush(
                attn.post_write(WriteRequest::new(&inbox_at, 0, message).immediate(round)),
            )
            .expect("posted");
        let done = attn_runtime
            .block_on(replies.next_completion_timeout(Duration::from_secs(10)))
            .expect("a reply");
        assert_eq!(done.immediate, round);
        let view = replies.read_blocking(done.range()).expect("view");
        assert_eq!((view.len(), view[0]), (1000, round as u8 + 1));
    }
    card_thread.join().expect("card thread");
}

#[test]
fn an_endpoint_whose_thread_is_busy_still_lands_and_acknowledges() {
    let [(attn_runtime, attn), (_card_runtime, card)] = pair();
    let inbox = card
        .register(RegionConfig::new(4096).grant("attn"))
        .expect("inbox");
    let inbox_at = inbox.descriptor();
    // Nobody on the card side calls block_on (its thread is computing, say): the idle driver
    // accepts the connection, lands the write and acknowledges it.
    let started = Instant::now();
    let receipt = attn_runtime.block_on(async {
        attn.write(WriteRequest::new(&inbox_at, 0, Bytes::from(vec![9u8; 2048])).immediate(7))
            .await
    });
    assert!(receipt.is_ok(), "{receipt:?}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "took {:?}",
        started.elapsed()
    );
    let done = inbox
        .try_next_completion()
        .expect("inbox open")
        .expect("the write landed before its acknowledgment");
    assert_eq!((done.immediate, done.len), (7, 2048));
}
