//! Rotary position embedding settings, in both of Hugging Face's spellings:
//! transformers 5 writes `rope_parameters` (with `rope_theta` inside), hub configs of the
//! transformers 4 era write a top-level `rope_theta` plus an optional `rope_scaling`.

use std::path::Path;

use serde_json::Value;

use crate::error::{Error, Result};

/// How RoPE frequencies are rescaled for long context.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE (`rope_type: "default"`).
    None,
    /// Position interpolation (`rope_type: "linear"`): frequencies divided by `factor`.
    Linear {
        /// Divisor of every frequency.
        factor: f64,
    },
    /// YaRN (`rope_type: "yarn"`), as GPT-OSS uses it.
    Yarn {
        /// Context extension factor.
        factor: f64,
        /// Rotations at which interpolation stops (high-frequency end).
        beta_fast: f64,
        /// Rotations at which extrapolation stops (low-frequency end).
        beta_slow: f64,
        /// The pre-extension context length.
        original_max_position_embeddings: usize,
        /// Whether the correction range is rounded to whole dimensions.
        truncate: bool,
        /// Multiplier of cos and sin (`mscale`); 0.1 ln(factor) + 1 unless the config sets it.
        attention_factor: f64,
    },
}

/// Rotary embedding: base and scaling.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeConfig {
    /// `rope_theta`.
    pub theta: f64,
    /// Long-context rescaling.
    pub scaling: RopeScaling,
}

impl RopeConfig {
    /// Reads RoPE settings from the config value; `default_theta` is the family's default.
    pub fn parse(
        config: &Value,
        default_theta: f64,
        max_position: usize,
        path: &Path,
    ) -> Result<Self> {
        let top_theta = config.get("rope_theta").and_then(Value::as_f64);
        let params = match config.get("rope_parameters") {
            Some(Value::Object(map)) => Some(map),
            Some(Value::Null) | None => match config.get("rope_scaling") {
                Some(Value::Object(map)) => Some(map),
                _ => None,
            },
            Some(_) => {
                return Err(Error::config(path, "rope_parameters must be an object"));
            }
        };
        let Some(params) = params else {
            return Ok(RopeConfig {
                theta: top_theta.unwrap_or(default_theta),
                scaling: RopeScaling::None,
            });
        };
        let theta = params
            .get("rope_theta")
            .and_then(Value::as_f64)
            .or(top_theta)
            .unwrap_or(default_theta);
        let rope_type = params
            .get("rope_type")
            .or_else(|| params.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("default");
        let num = |key: &str| params.get(key).and_then(Value::as_f64);
        let factor = || {
            num("factor").ok_or_else(|| {
                Error::config(path, format!("rope_type `{rope_type}` needs a `factor`"))
            })
        };
        let scaling = match rope_type {
            "default" => RopeScaling::None,
            "linear" => RopeScaling::Linear { factor: factor()? },
            "yarn" => {
                let factor = factor()?;
                let original = num("original_max_position_embeddings")
                    .map(|v| v as usize)
                    .unwrap_or(max_position);
                let attention_factor = match num("attention_factor") {
                    Some(a) => a,
                    None => match (num("mscale"), num("mscale_all_dim")) {
                        (Some(m), Some(all)) => yarn_mscale(factor, m) / yarn_mscale(factor, all),
                        _ => yarn_mscale(factor, 1.0),
                    },
                };
                RopeScaling::Yarn {
                    factor,
                    beta_fast: num("beta_fast").unwrap_or(32.0),
                    beta_slow: num("beta_slow").unwrap_or(1.0),
                    original_max_position_embeddings: original,
                    truncate: params
                        .get("truncate")
                        .and_then(Value::as_bool)
                        .unwrap_or(true),
                    attention_factor,
                }
            }
            other => {
                return Err(Error::config(
                    path,
                    format!("rope_type `{other}` is not supported (default, linear and yarn are)"),
                ));
            }
        };
        Ok(RopeConfig { theta, scaling })
    }

    /// The multiplier of cos and sin (1 except for YaRN).
    pub fn attention_factor(&self) -> f32 {
        match self.scaling {
            RopeScaling::Yarn {
                attention_factor, ..
            } => attention_factor as f32,
            _ => 1.0,
        }
    }

    /// Inverse frequencies for a head of width `head_dim`, computed in f32 the way
    /// transformers computes them (so tables agree to the last bit or so).
    pub fn inv_freq(&self, head_dim: usize) -> Vec<f32> {
        let half = head_dim / 2;
        let base = self.theta as f32;
        let pos_freqs: Vec<f32> = (0..half)
            .map(|i| base.powf((2 * i) as f32 / head_dim as f32))
            .collect();
        match self.scaling {
            RopeScaling::None => pos_freqs.iter().map(|p| 1.0 / p).collect(),
            RopeScaling::Linear { factor } => pos_freqs
                .iter()
                .map(|p| (1.0 / p) / factor as f32)
                .collect(),
            RopeScaling::Yarn {
                factor,
                beta_fast,
                beta_slow,
                original_max_position_embeddings,
                truncate,
                ..
            } => {
                let dim = head_dim as f64;
                let orig = original_max_position_embeddings as f64;
                let correction_dim = |rotations: f64| {
                    dim * (orig / (rotations * 2.0 * std::f64::consts::PI)).ln()
                        / (2.0 * self.theta.ln())
                };
                let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
                if truncate {
                    low = low.floor();
                    high = high.ceil();
                }
                let low = low.max(0.0);
                let mut high = high.min(dim - 1.0);
                if low == high {
                    high += 0.001;
                }
                let (low, high) = (low as f32, high as f32);
                pos_freqs
                    .iter()
                    .enumerate()
                    .map(|(i, p)| {
                        let extrapolation = 1.0 / p;
                        let interpolation = 1.0 / (factor as f32 * p);
                        let ramp = ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
                        let extrapolation_factor = 1.0 - ramp;
                        interpolation * (1.0 - extrapolation_factor)
                            + extrapolation * extrapolation_factor
                    })
                    .collect()
            }
        }
    }
}

/// YaRN's `get_mscale`.
fn yarn_mscale(factor: f64, mscale: f64) -> f64 {
    if factor <= 1.0 {
        1.0
    } else {
        0.1 * mscale * factor.ln() + 1.0
    }
}
