//! The same semantics suite over the in-process twin.

mod common;

use common::*;
use jetstream::{Error, InprocFabric, Limits, Transport};

#[tokio::test]
async fn inproc_write_and_answer() {
    let nodes = inproc_cluster(&["attn", "card-0"], Limits::default());
    write_and_answer(&*nodes[0], &*nodes[1]).await;
}

#[tokio::test]
async fn inproc_ordering() {
    let nodes = inproc_cluster(&["attn", "card-0"], Limits::default());
    ordering(&*nodes[0], &*nodes[1]).await;
}

#[tokio::test]
async fn inproc_refusals() {
    let nodes = inproc_cluster(&["attn", "card-0"], Limits::default());
    refusals(&*nodes[0], &*nodes[1]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inproc_backpressure() {
    let write_len = 100_000;
    let limits = Limits {
        max_in_flight_bytes: 2 * write_len as u64,
        ..Limits::default()
    };
    let nodes = inproc_cluster(&["attn", "card-0"], limits);
    backpressure(nodes[0].clone(), &*nodes[1], write_len).await;
}

#[tokio::test]
async fn names_are_unique_and_closed_nodes_are_unreachable() {
    let fabric = InprocFabric::new();
    let attn = fabric.endpoint("attn").unwrap();
    assert!(matches!(
        fabric.endpoint("attn"),
        Err(Error::DuplicateNode { .. })
    ));
    assert!(matches!(
        fabric.endpoint("bad name"),
        Err(Error::InvalidNodeName { .. })
    ));
    let card = fabric.endpoint("card-0").unwrap();
    attn.connect("card-0").await.unwrap();
    drop(card);
    assert!(matches!(
        attn.connect("card-0").await,
        Err(Error::UnknownPeer { .. })
    ));
    // The name is free again.
    let _card = fabric.endpoint("card-0").unwrap();
    attn.connect("card-0").await.unwrap();
}
