//! [`DeviceMonolithicNode`]: the GPU-only baseline. The whole model on one device (experts
//! included, MXFP4 decoded in the kernel, bf16 as stored) behind the step API, so the seed's
//! "one H100 alone" row can be measured beside the disaggregated path (`afd serve --reference
//! --device cuda`, or a deployment with `cards.count = 0`).

use std::collections::HashMap;

use candle_core::DType;
use model::ModelWeights;
use model::forward::rope::Rope;
use step::{
    AttentionNode, InvalidStep, KvCapacity, ModelFailure, SeqId, StepBatch, StepError, StepOutput,
};

use super::inputs::SpanInput;
use super::node::DeviceCompute;
use super::spec::AttentionDevice;
use crate::kv_cache::KvCacheConfig;
use crate::monolithic::{score_prompt, validate_batch};
use crate::prefix::FilledBlocks;
use crate::sampler::{RowToSample, TokenHistory, record_tokens, sample_rows};

/// The whole model on a device as an attention node.
#[derive(Debug)]
pub struct DeviceMonolithicNode {
    device: AttentionDevice,
    compute: DeviceCompute,
    rope: Rope,
    vocab: usize,
    seq_lens: HashMap<SeqId, usize>,
    histories: HashMap<SeqId, TokenHistory>,
    /// The KV blocks this node filled, which a prefix-cache hit may name.
    filled: FilledBlocks,
}

impl DeviceMonolithicNode {
    /// Copies every weight (load them all) to `device` (not the host path) and sizes the KV
    /// cache from `kv`.
    pub fn new(
        weights: &ModelWeights,
        kv: &KvCacheConfig,
        device: AttentionDevice,
    ) -> Result<Self, StepError> {
        let dev = device
            .open()
            .map_err(|e| InvalidStep::Setup(e.to_string()))?
            .ok_or_else(|| {
                InvalidStep::Setup(
                    "the device baseline needs --device cuda (or candle-cpu); the CPU's \
                     baseline is the reference forward"
                        .into(),
                )
            })?;
        let compute =
            DeviceCompute::whole_model(weights, kv, &dev).map_err(|e| ModelFailure::Prepare {
                device: device.to_string(),
                reason: e.to_string(),
            })?;
        Ok(DeviceMonolithicNode {
            device,
            filled: FilledBlocks::new(compute.capacity()),
            compute,
            rope: Rope::new(&weights.config),
            vocab: weights.config.vocab_size,
            seq_lens: HashMap::new(),
            histories: HashMap::new(),
        })
    }

    /// Where it computes.
    pub fn device(&self) -> AttentionDevice {
        self.device
    }

    /// Bytes of weights on the device.
    pub fn weight_bytes(&self) -> usize {
        self.compute.weight_bytes()
    }
}

impl AttentionNode for DeviceMonolithicNode {
    fn kv_capacity(&self) -> KvCapacity {
        self.compute.capacity()
    }

    fn step(&mut self, batch: &StepBatch) -> Result<StepOutput, StepError> {
        for e in batch.entries.iter().filter(|e| e.starts_sequence()) {
            self.seq_lens.remove(&e.seq);
            self.histories.remove(&e.seq);
        }
        validate_batch(batch, self.compute.capacity(), Some(&self.filled), |s| {
            self.seq_lens.get(&s).copied().unwrap_or(0)
        })?;
        if batch.entries.is_empty() {
            return Ok(StepOutput::default());
        }
        let mut spans = Vec::with_capacity(batch.entries.len());
        let mut positions = Vec::new();
        let mut last_rows = Vec::new();
        for e in &batch.entries {
            if let Some(&t) = e.tokens.iter().find(|&&t| t as usize >= self.vocab) {
                return Err(InvalidStep::TokenOutOfRange {
                    token: t,
                    vocab: self.vocab,
                }
                .into());
            }
            spans.push(SpanInput {
                tokens: &e.tokens,
                past: e.start,
                table: &e.block_table,
            });
            let first = positions.len() as u32;
            positions.extend(e.start..e.start + e.tokens.len());
            // Scored prompt rows first, then the sampled row (the order they are read back).
            if let Some(p) = &e.prompt_logprobs {
                last_rows.extend((0..p.next.len() as u32).map(|j| first + j));
            }
            if e.sample.is_some() {
                last_rows.push((positions.len() - 1) as u32);
            }
        }
        let rope = self.rope.tables(&positions);
        let (mut x, inputs) = self
            .compute
            .prepare(&spans, &rope)
            .map_err(StepError::compute)?;
        for layer in 0..self.compute.layers() {
            self.compute
                .layer(layer, &mut x, &inputs)
                .map_err(StepError::compute)?;
        }
        let logits = if last_rows.is_empty() {
            Vec::new()
        } else {
            self.compute
                .logits(&x, &last_rows)
                .map_err(StepError::compute)?
        };
        debug_assert_eq!(x.dtype(), DType::F32);
        for e in &batch.entries {
            self.seq_lens.insert(e.seq, e.start + e.tokens.len());
            record_tokens(&mut self.histories, e);
        }
        self.filled.record(batch);
        let vocab = self.vocab.max(1);
        let mut logit_rows = logits.chunks_exact(vocab);
        let mut rows = Vec::new();
        let mut prompt_logprobs = Vec::new();
        for e in &batch.entries {
            if let Some(p) = &e.prompt_logprobs {
                let scored = logit_rows.by_ref().take(p.next.len());
                prompt_logprobs.push(score_prompt(e.seq, scored, vocab, p)?);
            }
            let (Some(request), Some(history)) = (&e.sample, self.histories.get(&e.seq)) else {
                continue;
            };
            let logits = logit_rows
                .next()
                .ok_or(ModelFailure::Missing("a row of logits for each sample"))?;
            rows.push(RowToSample {
                seq: e.seq,
                logits,
                request,
                history,
                position: (e.start + e.tokens.len()) as u64,
            });
        }
        Ok(StepOutput {
            sampled: sample_rows(&rows)?,
            prompt_logprobs,
        })
    }

    fn free(&mut self, seqs: &[SeqId]) -> Result<(), StepError> {
        for s in seqs {
            self.seq_lens.remove(s);
            self.histories.remove(s);
        }
        Ok(())
    }

    fn shares_kv_blocks(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use model::generate::{GenerationRequest, generate};
    use model::sampling::SamplingParams;

    use super::*;

    /// On candle's CPU device the baseline gives the reference's greedy tokens for every
    /// family (MXFP4, bf16 and f32 experts; dense layers; sinks and windows).
    #[test]
    fn the_device_baseline_matches_the_reference() {
        for name in [
            "gpt-oss-bf16",
            "gpt-oss-mxfp4",
            "mixtral",
            "mixtral-sliding",
            "qwen3-moe",
            "qwen3-moe-fused",
        ] {
            let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../fixtures")
                .join(name);
            let weights = ModelWeights::load(&dir).unwrap();
            let requests: Vec<GenerationRequest> =
                [vec![5u32, 17, 99, 3, 42, 8, 77, 12, 1, 30], vec![7, 7, 200]]
                    .into_iter()
                    .map(|prompt| GenerationRequest {
                        prompt,
                        max_tokens: 8,
                        sampling: SamplingParams::greedy(),
                        stop_token_ids: vec![],
                    })
                    .collect();
            let mut reference = model::ReferenceModel::new(weights.clone()).unwrap();
            let want: Vec<Vec<u32>> = generate(&mut reference, &requests, 0)
                .unwrap()
                .into_iter()
                .map(|g| g.output_ids)
                .collect();
            let kv = KvCacheConfig {
                block_size: 4,
                memory_bytes: 4 << 20,
                gpu_memory_utilization: None,
            };
            let mut node =
                DeviceMonolithicNode::new(&weights, &kv, AttentionDevice::CandleCpu).unwrap();
            let got: Vec<Vec<u32>> = crate::driver::generate(&mut node, &requests, 0)
                .unwrap()
                .into_iter()
                .map(|g| g.output_ids)
                .collect();
            assert_eq!(got, want, "{name}");
        }
    }

    #[test]
    fn the_host_path_has_no_device_baseline() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/mixtral");
        let weights = ModelWeights::load(&dir).unwrap();
        let err =
            DeviceMonolithicNode::new(&weights, &KvCacheConfig::default(), AttentionDevice::Cpu)
                .unwrap_err()
                .to_string();
        assert!(err.contains("--device cuda"), "{err}");
    }
}
