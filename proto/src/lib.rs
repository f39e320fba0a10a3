//! The formats both halves of afd agree on.
//!
//! Owns the control-plane schema (tonic/prost, generated from `proto/*.proto`) and the data-plane
//! layouts written into JetStream regions: dispatched rows (hidden states, expert ids, routing
//! weights), partial sums and LM-head proposals, as plain Rust types with checked encode/decode.
//!
//! Must not: depend on any other afd crate, do I/O, or know how either side computes anything.
//! The attention node and the cards know each other only through this crate.
