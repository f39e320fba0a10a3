//! Mutual TLS: only certificates from the cluster CA get in, and a node cannot use another
//! node's name.

mod common;

use std::time::Duration;

use common::*;
use jetstream::{
    ClusterCa, Error, NodeIdentity, QuicConfig, QuicTransport, RegionConfig, Transport,
    WriteRequest,
};

fn bind(identity: NodeIdentity) -> QuicTransport {
    let mut config = QuicConfig::new(identity, LOOPBACK);
    config.tuning.connect_timeout = Duration::from_secs(3);
    QuicTransport::bind(config).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_from_another_ca_is_refused() {
    let cluster = ClusterCa::generate().unwrap();
    let card = bind(cluster.issue("card-0").unwrap());
    let inbox = card.register(RegionConfig::new(64).grant("attn")).unwrap();

    // Same node name, but signed by a different CA; it trusts the real cluster CA so that only
    // the client side of the check is exercised.
    let mut stranger = ClusterCa::generate().unwrap().issue("attn").unwrap();
    stranger.ca = cluster.certificate().clone();
    let intruder = bind(stranger);
    intruder.add_peer("card-0", card.local_addr().unwrap());
    let outcome = intruder
        .write(WriteRequest::new(&inbox.descriptor(), 0, pattern(64, 1)))
        .await;
    let error = outcome.unwrap_err();
    eprintln!("refused as expected: {error}");
    assert!(
        matches!(error, Error::Connect { .. } | Error::PeerGone { .. }),
        "unexpected error: {error}"
    );
    assert!(inbox.try_next_completion().unwrap().is_none());
    assert!(card.connected_peers().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_from_another_ca_is_not_trusted() {
    let cluster = ClusterCa::generate().unwrap();
    let attn = bind(cluster.issue("attn").unwrap());
    let fake_card = bind(ClusterCa::generate().unwrap().issue("card-0").unwrap());
    attn.add_peer("card-0", fake_card.local_addr().unwrap());
    let error = attn.connect("card-0").await.unwrap_err();
    eprintln!("refused as expected: {error}");
    assert!(
        matches!(error, Error::Connect { .. }),
        "unexpected error: {error}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_cannot_claim_another_nodes_name() {
    let cluster = ClusterCa::generate().unwrap();
    let card = bind(cluster.issue("card-0").unwrap());
    let inbox = card.register(RegionConfig::new(64).grant("attn")).unwrap();

    // `card-1` holds a valid cluster certificate, but for its own name; it claims `attn`.
    let mut impostor_identity = cluster.issue("card-1").unwrap();
    impostor_identity.node = "attn".into();
    let impostor = bind(impostor_identity);
    impostor.add_peer("card-0", card.local_addr().unwrap());
    let error = impostor
        .write(WriteRequest::new(&inbox.descriptor(), 0, pattern(64, 1)))
        .await
        .unwrap_err();
    eprintln!("refused as expected: {error}");
    assert!(
        matches!(error, Error::Connect { .. } | Error::PeerGone { .. }),
        "unexpected error: {error}"
    );
    assert!(inbox.try_next_completion().unwrap().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dialling_the_wrong_node_fails() {
    let cluster = ClusterCa::generate().unwrap();
    let attn = bind(cluster.issue("attn").unwrap());
    let card_one = bind(cluster.issue("card-1").unwrap());
    // The address book says card-0 lives where card-1 listens.
    attn.add_peer("card-0", card_one.local_addr().unwrap());
    let error = attn.connect("card-0").await.unwrap_err();
    eprintln!("refused as expected: {error}");
    assert!(
        matches!(error, Error::Connect { .. }),
        "unexpected error: {error}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connected_peer_writes_only_into_granted_regions() {
    let nodes = quic_cluster(&["attn", "card-0", "card-1"], jetstream::Limits::default());
    let (attn, card0, card1) = (&nodes[0], &nodes[1], &nodes[2]);
    let partials = attn
        .register(RegionConfig::new(128).grant("card-0"))
        .unwrap();
    let descriptor = partials.descriptor();
    card0
        .write(WriteRequest::new(&descriptor, 0, pattern(128, 1)))
        .await
        .unwrap();
    // card-1 is a legitimate, connected cluster member with the descriptor, but no grant.
    let error = card1
        .write(WriteRequest::new(&descriptor, 0, pattern(128, 2)))
        .await
        .unwrap_err();
    assert!(matches!(error, Error::NotGranted { .. }), "{error}");
    let done = partials.next_completion().await.unwrap();
    assert_eq!(&*done.peer, "card-0");
    assert!(partials.try_next_completion().unwrap().is_none());
    assert_eq!(&*partials.read(0..128).await.unwrap(), &pattern(128, 1)[..]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_from_pem_files_added_at_different_times_connect() {
    let dir = tempfile::tempdir().unwrap();
    jetstream::write_cluster(dir.path(), &["attn".to_owned()]).unwrap();
    // A second call reuses the CA in the directory.
    jetstream::write_cluster(dir.path(), &["card-0".to_owned()]).unwrap();
    let card = bind(NodeIdentity::read_pem(dir.path(), "card-0").unwrap());
    let attn = bind(NodeIdentity::read_pem(dir.path(), "attn").unwrap());
    attn.add_peer("card-0", card.local_addr().unwrap());
    let inbox = card.register(RegionConfig::new(64).grant("attn")).unwrap();
    let data = pattern(64, 3);
    attn.write(WriteRequest::new(&inbox.descriptor(), 0, data.clone()).immediate(11))
        .await
        .unwrap();
    let done = inbox.next_completion().await.unwrap();
    assert_eq!((&*done.peer, done.immediate), ("attn", 11));
    assert_eq!(&*inbox.read(done.range()).await.unwrap(), &data[..]);
}
