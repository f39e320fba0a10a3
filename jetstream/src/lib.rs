//! JetStream: an RDMA-style one-sided data plane.
//!
//! Owns registered memory regions, one-sided writes with immediates, receive- and send-side
//! completions, the QUIC transport (quinn) with mutual TLS from a cluster CA, and an in-process
//! transport with the same trait.
//!
//! Must not: depend on any other afd crate or interpret the bytes it moves.
