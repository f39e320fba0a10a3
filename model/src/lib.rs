//! Hugging Face checkpoints and the monolithic reference forward.
//!
//! Owns `config.json` parsing for GPT-OSS, Mixtral and Qwen3-MoE, safetensors loading (single and
//! sharded, memory-mapped), MXFP4 blocks and scales, the mapping from per-family tensor names to
//! one family-neutral description of the model, tokenizers and chat templates, the f32 reference
//! forward that everything else is verified against, and synthetic checkpoints.
//!
//! Must not: depend on any other afd crate or do network I/O.
