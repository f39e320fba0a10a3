//! Rotary position embedding tables for arbitrary positions.

use candle_core::{Device, Tensor};

use crate::config::ModelConfig;
use crate::error::Result;

/// Inverse frequencies and the YaRN attention factor of a model.
#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f32>,
    attention_factor: f32,
}

impl Rope {
    /// The model's rotary embedding.
    pub fn new(config: &ModelConfig) -> Self {
        Rope {
            inv_freq: config.rope.inv_freq(config.head_dim),
            attention_factor: config.rope.attention_factor(),
        }
    }

    /// The inverse frequencies (`head_dim / 2` of them).
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// `cos` and `sin` tables `[positions.len(), head_dim / 2]` for the given absolute positions,
    /// computed in f32 as transformers does: `freq = position * inv_freq`, then
    /// `cos(freq) * attention_factor`.
    pub fn tables(&self, positions: &[usize], device: &Device) -> Result<(Tensor, Tensor)> {
        let half = self.inv_freq.len();
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            for &f in &self.inv_freq {
                let angle = p as f32 * f;
                cos.push(angle.cos() * self.attention_factor);
                sin.push(angle.sin() * self.attention_factor);
            }
        }
        Ok((
            Tensor::from_vec(cos, (positions.len(), half), device)?,
            Tensor::from_vec(sin, (positions.len(), half), device)?,
        ))
    }
}
