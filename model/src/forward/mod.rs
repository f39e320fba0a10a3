//! The monolithic reference forward: the whole model in one process, f32 compute, a KV cache,
//! a batch of sequences of different lengths.
//!
//! Its parts are public so that the attention node and the cards compute the same math:
//! [`attention::AttentionBlock`] (norms, projections, RoPE, cache, sinks, window) over any
//! [`kv_cache::KvCache`], with decode rows attended in place by [`attend`];
//! [`moe::route`] and [`moe::gated_mlp`] (routing and expert math), [`LmHead`].

pub mod attend;
pub mod attention;
pub mod kv_cache;
pub mod moe;
pub mod ops;
pub mod rope;

use std::collections::HashMap;

use candle_core::{Device, Tensor};

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::kernels;
use crate::weights::{FfnWeights, ModelWeights, WeightMatrix};
use attention::{AttentionBlock, ContiguousKvCache, KvCache, SeqId, SeqSpan};
use ops::{rms_norm, to_f32_vec, vector};

/// New tokens of one sequence for one forward call (a whole prompt, a prompt chunk, or one
/// decoded token).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqChunk {
    /// The sequence (created on first use).
    pub seq: SeqId,
    /// Tokens appended to it.
    pub tokens: Vec<u32>,
}

/// Which positions' logits a forward call returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsFor {
    /// Only the last new token of each chunk (what generation needs).
    LastToken,
    /// Every new token (for verification).
    AllTokens,
}

/// Looks up embedding rows for token ids (`[tokens, hidden]`), checking the ids.
pub fn embed(embed: &WeightMatrix, tokens: &[u32]) -> Result<Vec<f32>> {
    let (vocab, hidden) = (embed.rows(), embed.cols());
    let mut out = vec![0f32; tokens.len() * hidden];
    for (row, &t) in out.chunks_exact_mut(hidden).zip(tokens) {
        if t as usize >= vocab {
            return Err(Error::InvalidInput(format!(
                "token id {t} is out of range: the vocabulary has {vocab} entries"
            )));
        }
        embed.decode_row(t as usize, crate::mxfp4::scale_table(), row);
    }
    Ok(out)
}

/// Final norm and LM head.
#[derive(Debug, Clone)]
pub struct LmHead {
    norm: Tensor,
    eps: f64,
    weight: WeightMatrix,
}

impl LmHead {
    /// The model's final norm and LM head.
    pub fn new(weights: &ModelWeights, device: &Device) -> Result<Self> {
        Ok(LmHead {
            norm: vector(&weights.final_norm, device)?,
            eps: weights.config.rms_norm_eps,
            weight: weights.lm_head.clone(),
        })
    }

    /// Final RMSNorm of hidden states `[tokens, hidden]`.
    pub fn norm(&self, x: &Tensor) -> Result<Tensor> {
        rms_norm(x, &self.norm, self.eps)
    }

    /// Logits `[tokens * vocab]` of already-normed hidden states.
    pub fn logits(&self, normed: &[f32], tokens: usize) -> Vec<f32> {
        let mut out = vec![0f32; tokens * self.weight.rows()];
        kernels::matmul(normed, tokens, &self.weight, None, &mut out);
        out
    }
}

#[derive(Debug)]
struct Layer {
    input_norm: Tensor,
    attention: AttentionBlock,
    post_attention_norm: Tensor,
}

/// The whole model in one process, with its own KV cache.
#[derive(Debug)]
pub struct ReferenceModel {
    weights: ModelWeights,
    device: Device,
    rope: rope::Rope,
    layers: Vec<Layer>,
    lm_head: LmHead,
    cache: ContiguousKvCache,
    seq_lens: HashMap<SeqId, usize>,
}

impl ReferenceModel {
    /// Prepares the model on the CPU.
    pub fn new(weights: ModelWeights) -> Result<Self> {
        let device = Device::Cpu;
        let layers = weights
            .layers
            .iter()
            .enumerate()
            .map(|(l, lw)| {
                Ok(Layer {
                    input_norm: vector(&lw.input_norm, &device)?,
                    attention: AttentionBlock::new(&weights.config, l, lw, &device)?,
                    post_attention_norm: vector(&lw.post_attention_norm, &device)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(ReferenceModel {
            cache: ContiguousKvCache::new(weights.config.kv_dim()),
            rope: rope::Rope::new(&weights.config),
            lm_head: LmHead::new(&weights, &device)?,
            layers,
            device,
            weights,
            seq_lens: HashMap::new(),
        })
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.weights.config
    }

    /// Over every layer, how often the row attention ran a decode batch's sequences side by
    /// side on the pool, and split rows' heads over it (see [`attention::AttentionPaths`]).
    pub fn attention_paths(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        self.layers.iter().fold((0, 0), |(side, split), l| {
            let p = l.attention.paths();
            (
                side + p.side_by_side.load(Relaxed),
                split + p.heads_split.load(Relaxed),
            )
        })
    }

    /// The weights.
    pub fn weights(&self) -> &ModelWeights {
        &self.weights
    }

    /// Tokens cached for `seq`.
    pub fn seq_len(&self, seq: SeqId) -> usize {
        self.seq_lens.get(&seq).copied().unwrap_or(0)
    }

    /// Forgets a sequence and its cache.
    pub fn free(&mut self, seq: SeqId) {
        self.cache.free(seq);
        self.seq_lens.remove(&seq);
    }

    /// Runs the model on new tokens of several sequences at once; returns, per chunk, the
    /// logits (`[rows, vocab]`, row-major) of the positions `which` asks for.
    pub fn forward(&mut self, chunks: &[SeqChunk], which: LogitsFor) -> Result<Vec<Vec<f32>>> {
        let cfg = &self.weights.config;
        let (hidden, vocab) = (cfg.hidden_size, cfg.vocab_size);
        let mut spans = Vec::with_capacity(chunks.len());
        let mut positions = Vec::new();
        let mut tokens = Vec::new();
        for c in chunks {
            if c.tokens.is_empty() {
                return Err(Error::InvalidInput(format!(
                    "sequence {} has no new tokens",
                    c.seq
                )));
            }
            if spans.iter().any(|s: &SeqSpan| s.seq == c.seq) {
                return Err(Error::InvalidInput(format!(
                    "sequence {} appears twice in one batch",
                    c.seq
                )));
            }
            let past = self.seq_len(c.seq);
            spans.push(SeqSpan {
                seq: c.seq,
                start: tokens.len(),
                len: c.tokens.len(),
                past,
            });
            positions.extend(past..past + c.tokens.len());
            tokens.extend_from_slice(&c.tokens);
        }
        let n = tokens.len();
        let rope = self.rope.tables(&positions);
        let mut x = Tensor::from_vec(
            embed(&self.weights.embed, &tokens)?,
            (n, hidden),
            &self.device,
        )?;
        for (l, layer) in self.layers.iter().enumerate() {
            let h = rms_norm(&x, &layer.input_norm, cfg.rms_norm_eps)?;
            let attn = layer.attention.forward(
                l,
                &h,
                &spans,
                &rope,
                &mut self.cache as &mut dyn KvCache,
            )?;
            x = (x + attn)?;
            let h = to_f32_vec(&rms_norm(&x, &layer.post_attention_norm, cfg.rms_norm_eps)?)?;
            let ffn = match &self.weights.layers[l].ffn {
                FfnWeights::Moe(moe) => {
                    let spec = cfg.moe.as_ref().ok_or_else(|| {
                        Error::InvalidInput("MoE layer without an MoE config".into())
                    })?;
                    moe::moe_forward(moe, spec, &h, n, hidden)?
                }
                FfnWeights::Dense(mlp) => {
                    moe::gated_mlp(mlp, crate::config::Activation::SwiGlu, &h, n)
                }
            };
            x = (x + Tensor::from_vec(ffn, (n, hidden), &self.device)?)?;
        }
        for s in &spans {
            self.seq_lens.insert(s.seq, s.past + s.len);
        }
        let rows: Vec<(usize, usize)> = spans
            .iter()
            .map(|s| match which {
                LogitsFor::LastToken => (s.start + s.len - 1, 1),
                LogitsFor::AllTokens => (s.start, s.len),
            })
            .collect();
        let mut selected = Vec::new();
        for &(start, len) in &rows {
            selected.push(x.narrow(0, start, len)?);
        }
        let selected = Tensor::cat(&selected, 0)?;
        let count = selected.dim(0)?;
        let normed = to_f32_vec(&self.lm_head.norm(&selected)?)?;
        let logits = self.lm_head.logits(&normed, count);
        let mut out = Vec::with_capacity(rows.len());
        let mut offset = 0;
        for &(_, len) in &rows {
            out.push(logits[offset * vocab..(offset + len) * vocab].to_vec());
            offset += len;
        }
        Ok(out)
    }
}
