//! The OpenAI-compatible HTTP API.
//!
//! Owns the axum routes, request validation, tokenization and streaming detokenization, chat
//! templates, server-sent events and the metrics endpoint.
//!
//! Must not: schedule or compute; it hands validated requests to `router`.
