//! Rotary position embedding tables for arbitrary positions.

use crate::config::ModelConfig;

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
    /// `cos(freq) * attention_factor`. Host rows: the attention block rotates host rows.
    pub fn tables(&self, positions: &[usize]) -> RopeTables {
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
        RopeTables { cos, sin }
    }
}

/// The rotation of a step's rows: `[rows, head_dim / 2]` each, row-major.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RopeTables {
    /// `cos(position * inv_freq) * attention_factor`.
    pub cos: Vec<f32>,
    /// `sin(position * inv_freq) * attention_factor`.
    pub sin: Vec<f32>,
}
