//! The formats both halves of afd agree on.
//!
//! Owns the control-plane schema (tonic/prost, generated from `proto/afd.proto`: loading card
//! shards, health, stats, the remote attention-node step) and the data-plane layouts written
//! into JetStream regions ([`data`]: dispatched rows with expert ids and weights, partial sums,
//! LM-head requests and proposals), as plain Rust types with checked encode/decode.
//!
//! Must not: depend on any other afd crate, do I/O, or know how either side computes anything.
//! The attention node and the cards know each other only through this crate.

pub mod data;

/// Generated control-plane messages and services (`afd.v1`).
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod control {
    tonic::include_proto!("afd.v1");
}
