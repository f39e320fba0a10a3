//! afd-loadtest: an OpenAI-API load generator.
//!
//! Owns arrival processes, the streaming HTTP client, vLLM `bench serve` metric definitions
//! (TTFT, TPOT, ITL, end-to-end latency, throughput, goodput), result files, tables and plots.
//!
//! Must not: depend on any other afd crate: it measures any OpenAI-compatible server.
