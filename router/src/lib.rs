//! Request scheduling.
//!
//! Owns continuous batching (a vLLM-v1-style `schedule()` / `update_from_output()` core with a
//! token budget and chunked prefill), KV-block accounting, preemption, admission and queue limits,
//! and spreading requests over several attention nodes.
//!
//! Must not: do HTTP or know the model's numerics; it drives attention nodes through their step API.
