//! An attention node without numerics, for emulations that do not run the model: it keeps no
//! KV cache, samples a fixed token that ends no sequence (so every request runs to its
//! `max_tokens`, as with `ignore_eos`; a constrained row takes the next token its mask allows), and routes every token of every MoE layer with a
//! [`RoutingGenerator`]. The router's scheduler drives it exactly as it drives a real node.

use std::collections::HashSet;

use step::{
    AttentionNode, InvalidStep, KvCapacity, SampledToken, SeqId, StepBatch, StepError, StepOutput,
    StepRouting,
};

use crate::routing::RoutingGenerator;

/// A node whose steps cost nothing to compute and whose routing is generated.
#[derive(Debug)]
pub struct SyntheticNode {
    kv: KvCapacity,
    routing: Option<RoutingGenerator>,
    token: u32,
    recording: bool,
    last: Option<StepRouting>,
    known: HashSet<SeqId>,
}

impl SyntheticNode {
    /// A node of `kv` cache geometry, routing with `routing` (`None`: a model without
    /// experts), answering `token` (which must be no sequence's stop token).
    pub fn new(kv: KvCapacity, routing: Option<RoutingGenerator>, token: u32) -> Self {
        SyntheticNode {
            kv,
            routing,
            token,
            recording: false,
            last: None,
            known: HashSet::new(),
        }
    }
}

impl AttentionNode for SyntheticNode {
    fn kv_capacity(&self) -> KvCapacity {
        self.kv
    }

    fn step(&mut self, batch: &StepBatch) -> Result<StepOutput, StepError> {
        let mut seen = HashSet::with_capacity(batch.entries.len());
        for e in &batch.entries {
            if !seen.insert(e.seq) {
                return Err(InvalidStep::DuplicateSequence { seq: e.seq }.into());
            }
            let blocks = (e.start + e.tokens.len()).div_ceil(self.kv.block_size.max(1));
            if e.block_table.len() < blocks {
                return Err(InvalidStep::TooFewBlocks {
                    seq: e.seq,
                    needed: blocks,
                    tokens: e.start + e.tokens.len(),
                    got: e.block_table.len(),
                }
                .into());
            }
            self.known.insert(e.seq);
        }
        if let Some(g) = self.routing.as_mut() {
            let tokens: usize = batch.entries.iter().map(|e| e.tokens.len()).sum();
            let mut layers = Vec::with_capacity(g.num_layers());
            for layer in 0..g.num_layers() {
                let mut experts = Vec::new();
                g.route(layer, tokens, &mut experts);
                layers.push((!experts.is_empty()).then_some(experts));
            }
            if self.recording {
                self.last = Some(StepRouting {
                    top_k: g.top_k(),
                    layers,
                });
            }
        }
        let mut sampled = Vec::new();
        for e in &batch.entries {
            let Some(sample) = &e.sample else { continue };
            // Under a structured-output mask, the next allowed token from its usual one, so
            // an emulation drives the grammar as a real node would.
            let token = match sample.allowed_mask(e.seq)? {
                None => self.token,
                Some(mask) => mask.first_allowed_from(self.token),
            };
            sampled.push(SampledToken {
                seq: e.seq,
                token,
                logprob: 0.0,
                top_logprobs: Vec::new(),
            });
        }
        Ok(StepOutput {
            sampled,
            prompt_logprobs: Vec::new(),
        })
    }

    fn free(&mut self, seqs: &[SeqId]) -> Result<(), StepError> {
        for s in seqs {
            self.known.remove(s);
        }
        Ok(())
    }

    fn record_routing(&mut self, on: bool) {
        self.recording = on;
        if !on {
            self.last = None;
        }
    }

    fn take_routing(&mut self) -> Option<StepRouting> {
        self.last.take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use step::ModelFailure;
    use step::{AllowedTokens, SampleRequest, StepEntry, TokenMask};

    fn entry(seq: SeqId, allowed: Option<AllowedTokens>) -> StepEntry {
        StepEntry {
            seq,
            tokens: vec![1, 2, 3],
            start: 0,
            prompt_len: 3,
            block_table: vec![seq as u32],
            sample: Some(SampleRequest {
                params: Default::default(),
                penalties: Default::default(),
                logprobs: false,
                top_logprobs: 0,
                allowed,
            }),
            cached_prefix: Vec::new(),
            prompt_logprobs: None,
        }
    }

    /// A constrained row answers the node's token when its mask allows it, else the next
    /// allowed one (wrapping); a row without a mask the node's token; a mask that failed fails
    /// the step.
    #[test]
    fn constrained_rows_answer_an_allowed_token() {
        let kv = KvCapacity {
            block_size: 4,
            num_blocks: 8,
        };
        let mut node = SyntheticNode::new(kv, None, 5);
        let ready = |tokens: &[u32]| {
            Some(AllowedTokens::ready(TokenMask::from_tokens(
                16,
                tokens.iter().copied(),
            )))
        };
        let batch = StepBatch {
            entries: vec![
                entry(0, None),
                entry(1, ready(&[2, 9, 12])),
                entry(2, ready(&[1, 3])),
                entry(3, ready(&[5, 6])),
            ],
        };
        let tokens: Vec<u32> = node
            .step(&batch)
            .unwrap()
            .sampled
            .iter()
            .map(|s| s.token)
            .collect();
        assert_eq!(tokens, vec![5, 9, 1, 5]);

        let failed = AllowedTokens::pending();
        failed.fill(Err("the grammar broke".into()));
        let err = node
            .step(&StepBatch {
                entries: vec![entry(4, Some(failed))],
            })
            .unwrap_err();
        assert!(
            matches!(&err, StepError::Model(ModelFailure::Mask { reason, .. }) if reason.contains("the grammar broke")),
            "{err}"
        );
    }
}
