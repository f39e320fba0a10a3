//! The device path: the attention node's numerics as candle tensors on a [`candle_core::Device`]
//! (an NVIDIA GPU with the `cuda` feature, or candle's CPU device to check the same code without
//! one), beside the fast host path that `--device cpu` keeps.
//!
//! The weights stay in their stored format on the device ([`linear`]); the KV cache is paged in
//! device memory ([`kv`]); decode attention reads the block tables directly ([`paged`]); the
//! node's per-layer work ([`node`]) copies to the host only what crosses to the cards. Where
//! candle has no op for it, a custom op carries a CUDA kernel (`gpu-attention/kernels/afd.cu`)
//! and a CPU implementation. Paged attention's follows its kernel step for step (a twin), so
//! the CPU tests check that kernel's logic; the linear and MoE ops' are plain dot products of
//! the same arithmetic, which check shapes and weight decoding but not their kernels' indexing
//! (only `scripts/gpu_check.sh`, on a GPU, runs those).

pub mod attention;
#[cfg(feature = "cuda")]
mod cuda;
/// The kernels' integer constants (`#define`s of `gpu-attention/kernels/afd.cu`), written by
/// the build script so Rust and CUDA share one source.
pub mod kernel_constants {
    include!(concat!(env!("OUT_DIR"), "/kernel_constants.rs"));
}
pub mod experts;
pub mod inputs;
pub mod kv;
pub mod linear;
pub mod monolithic;
pub mod node;
pub mod paged;
mod spec;
mod twins;

pub use monolithic::DeviceMonolithicNode;
pub use node::{DeviceCompute, FfnInput};
pub use spec::{AttentionDevice, DeviceError};

#[cfg(test)]
mod tests;
