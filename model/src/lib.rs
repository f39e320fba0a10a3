//! Hugging Face checkpoints and the monolithic reference forward.
//!
//! Owns `config.json` parsing for GPT-OSS, Mixtral and Qwen3-MoE, safetensors loading (single and
//! sharded, memory-mapped), MXFP4 blocks and scales, the mapping from per-family tensor names to
//! one family-neutral description of the model, tokenizers and the checkpoint's chat template, the
//! CPU numerics kernel layer that the reference forward and the Corsair card executor share
//! ([`kernels`]), sampling parameters, synthetic checkpoints, and, behind the default feature
//! `forward`, the f32 reference forward (on candle) that everything else is verified against.
//!
//! Must not: depend on any other afd crate, do network I/O, or need candle without `forward` (the
//! light part that `step`, `router`, `server`, `planner` and `corsair-ffn` use). It has no CUDA
//! code: its `cuda` feature only switches on candle's CUDA backend.

pub mod config;
pub mod error;

pub use config::{Family, ModelConfig};
pub use error::{Error, Result};
pub mod checkpoint;
pub mod kernels;
pub mod mxfp4;
pub mod test_support;
pub mod weights;

pub use weights::{ModelWeights, WeightFormat, WeightMatrix};
#[cfg(feature = "forward")]
pub mod forward;

#[cfg(feature = "forward")]
pub use forward::{LogitsFor, ReferenceModel, SeqChunk};
pub mod synth;
pub mod tokenizer;

pub use tokenizer::{ModelTokenizer, TokenPiece};
#[cfg(feature = "forward")]
pub mod generate;
pub mod sampling;
