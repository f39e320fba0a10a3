//! The semantics suite over real QUIC on loopback, plus QUIC-only behaviour: connection reuse,
//! lazy and eager connects, a peer going away, and use from a blocking thread.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use jetstream::{Error, Limits, RegionConfig, Transport, WriteRequest};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quic_write_and_answer() {
    let nodes = quic_cluster(&["attn", "card-0"], Limits::default());
    write_and_answer(&*nodes[0], &*nodes[1]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quic_ordering() {
    let nodes = quic_cluster(&["attn", "card-0"], Limits::default());
    ordering(&*nodes[0], &*nodes[1]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quic_refusals() {
    let nodes = quic_cluster(&["attn", "card-0"], Limits::default());
    refusals(&*nodes[0], &*nodes[1]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quic_backpressure() {
    let write_len = 100_000;
    let limits = Limits {
        max_in_flight_bytes: 2 * write_len as u64,
        ..Limits::default()
    };
    let nodes = quic_cluster(&["attn", "card-0"], limits);
    backpressure(nodes[0].clone(), &*nodes[1], write_len).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_card_answers_without_knowing_the_writers_address() {
    let ca = jetstream::ClusterCa::generate().unwrap();
    let card = jetstream::QuicTransport::bind(jetstream::QuicConfig::new(
        ca.issue("card-0").unwrap(),
        LOOPBACK,
    ))
    .unwrap();
    let mut attn_config = jetstream::QuicConfig::new(ca.issue("attn").unwrap(), LOOPBACK);
    attn_config
        .peers
        .insert("card-0".into(), card.local_addr().unwrap());
    let attn = jetstream::QuicTransport::bind(attn_config).unwrap();

    // The card has no address for `attn`: it cannot reach it before `attn` connects.
    let error = card.connect("attn").await.unwrap_err();
    assert!(matches!(error, Error::UnknownPeer { .. }), "{error}");
    attn.connect("card-0").await.unwrap();
    write_and_answer(&attn, &card).await;
    assert_eq!(attn.connected_peers(), vec!["card-0".to_owned()]);
    assert_eq!(card.connected_peers(), vec!["attn".to_owned()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_to_a_vanished_peer_fail_cleanly() {
    let nodes = quic_cluster(
        &["attn", "card-0"],
        Limits {
            write_timeout: Duration::from_secs(5),
            ..Limits::default()
        },
    );
    let inbox = nodes[1]
        .register(RegionConfig::new(4096).grant("attn"))
        .unwrap();
    let descriptor = inbox.descriptor();
    nodes[0]
        .write(WriteRequest::new(&descriptor, 0, pattern(4096, 1)))
        .await
        .unwrap();
    nodes[1].close();
    // Closing also closed the owner's completion queue, once drained.
    assert_eq!(inbox.next_completion().await.unwrap().offset, 0);
    assert!(matches!(
        inbox.next_completion().await,
        Err(Error::Closed { .. })
    ));
    let outcome = async {
        let ticket = nodes[0]
            .post_write(WriteRequest::new(&descriptor, 0, pattern(4096, 2)))
            .await?;
        ticket.wait().await
    }
    .await;
    let error = outcome.unwrap_err();
    assert!(
        matches!(
            error,
            Error::PeerGone { .. } | Error::Connect { .. } | Error::Timeout { .. }
        ),
        "unexpected error: {error}"
    );
}

#[test]
fn blocking_threads_can_write_and_wait() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let nodes = runtime.block_on(async { quic_cluster(&["attn", "card-0"], Limits::default()) });
    let (attn, card) = (nodes[0].clone(), nodes[1].clone());
    let inbox = card
        .register(RegionConfig::new(4096).grant("attn"))
        .unwrap();
    let descriptor = inbox.descriptor();
    let handle = runtime.handle().clone();

    // The card side: a plain thread waiting for completions and reading in place.
    let card_thread = std::thread::spawn(move || {
        let mut seen = Vec::new();
        for _ in 0..3 {
            let done = inbox
                .next_completion_blocking(Duration::from_secs(10))
                .unwrap();
            let view = inbox.read_blocking(done.range()).unwrap();
            seen.push((done.immediate, view[0]));
        }
        seen
    });
    // The writer side: a plain thread posting through the runtime's handle.
    let writer = std::thread::spawn(move || {
        for index in 0..3u8 {
            // Each write gets its own range: the writer does not wait for the reader, so reusing
            // one range could show a later write's bytes under an earlier completion.
            let offset = u64::from(index) * 1024;
            let request = WriteRequest::new(&descriptor, offset, pattern(1024, index))
                .immediate(u64::from(index));
            let ticket = handle.block_on(attn.post_write(request)).unwrap();
            ticket.wait_blocking().unwrap();
        }
    });
    writer.join().unwrap();
    let expected: Vec<(u64, u8)> = (0..3u8)
        .map(|index| (u64::from(index), pattern(1, index)[0]))
        .collect();
    assert_eq!(card_thread.join().unwrap(), expected);
    drop(Arc::clone(&card));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_peer_is_dialled_again() {
    let ca = jetstream::ClusterCa::generate().unwrap();
    let card_identity = ca.issue("card-0").unwrap();
    let bind_card = || {
        jetstream::QuicTransport::bind(jetstream::QuicConfig::new(card_identity.clone(), LOOPBACK))
            .unwrap()
    };
    let attn = jetstream::QuicTransport::bind(jetstream::QuicConfig::new(
        ca.issue("attn").unwrap(),
        LOOPBACK,
    ))
    .unwrap();

    let first = bind_card();
    attn.add_peer("card-0", first.local_addr().unwrap());
    let inbox = first.register(RegionConfig::new(64).grant("attn")).unwrap();
    attn.write(WriteRequest::new(&inbox.descriptor(), 0, pattern(64, 1)))
        .await
        .unwrap();
    drop(inbox);
    drop(first);

    // The card comes back elsewhere, with new regions; the old connection is gone.
    let second = bind_card();
    attn.add_peer("card-0", second.local_addr().unwrap());
    let inbox = second
        .register(RegionConfig::new(64).grant("attn"))
        .unwrap();
    let descriptor = inbox.descriptor();
    let mut outcome = Err(Error::Closed {
        what: "nothing tried yet",
    });
    for _ in 0..100 {
        // Writes racing the old connection's shutdown fail cleanly; a later one redials.
        outcome = attn
            .write(WriteRequest::new(&descriptor, 0, pattern(64, 2)))
            .await;
        if outcome.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    outcome.unwrap();
    assert_eq!(inbox.next_completion().await.unwrap().peer.as_ref(), "attn");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_peer_moves_writes_off_a_connection_that_still_looks_alive() {
    let ca = jetstream::ClusterCa::generate().unwrap();
    let card_identity = ca.issue("card-0").unwrap();
    let bind_card = || {
        jetstream::QuicTransport::bind(jetstream::QuicConfig::new(card_identity.clone(), LOOPBACK))
            .unwrap()
    };
    let attn = jetstream::QuicTransport::bind(jetstream::QuicConfig::new(
        ca.issue("attn").unwrap(),
        LOOPBACK,
    ))
    .unwrap();
    // The old card stays bound (as a stalled or killed process's connection stays open until
    // the idle timeout); a new one of the same name takes over elsewhere.
    let old = bind_card();
    attn.add_peer("card-0", old.local_addr().unwrap());
    let old_inbox = old.register(RegionConfig::new(64).grant("attn")).unwrap();
    attn.write(WriteRequest::new(
        &old_inbox.descriptor(),
        0,
        pattern(64, 1),
    ))
    .await
    .unwrap();
    let new = bind_card();
    let inbox = new.register(RegionConfig::new(64).grant("attn")).unwrap();
    attn.add_peer("card-0", new.local_addr().unwrap());
    // Without a reset the open connection is still the write path: the new card's region is
    // unknown there.
    let stale = attn
        .write(WriteRequest::new(&inbox.descriptor(), 0, pattern(64, 2)))
        .await;
    assert!(stale.is_err(), "{stale:?}");
    attn.reset_peer("card-0");
    assert!(attn.connected_peers().is_empty());
    attn.write(WriteRequest::new(&inbox.descriptor(), 0, pattern(64, 3)))
        .await
        .unwrap();
    let done = inbox.next_completion().await.unwrap();
    assert_eq!(done.peer.as_ref(), "attn");
}
