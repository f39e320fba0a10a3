//! The device path: the attention node's numerics as candle tensors on a [`candle_core::Device`]
//! (an NVIDIA GPU with the `cuda` feature, or candle's CPU device to check the same code without
//! one), beside the fast host path that `--device cpu` keeps.
//!
//! The weights stay in their stored format on the device ([`linear`]); the KV cache is paged in
//! device memory ([`kv`]); decode attention reads the block tables directly ([`paged`]); the
//! node's per-layer work ([`node`]) copies to the host only what crosses to the cards. Where
//! candle has no op for it, a custom op carries a CUDA kernel (`kernels/afd.cu`) and a CPU twin
//! that follows it step for step, so the CPU tests check the kernels' logic.

pub mod attention;
#[cfg(feature = "cuda")]
mod cuda;
pub mod experts;
pub mod inputs;
pub mod kv;
pub mod linear;
pub mod monolithic;
pub mod node;
pub mod paged;
mod spec;

pub use monolithic::DeviceMonolithicNode;
pub use node::{DeviceCompute, FfnInput};
pub use spec::{AttentionDevice, DeviceError};

#[cfg(test)]
mod tests;
