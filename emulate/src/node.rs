//! An attention node without numerics, for emulations that do not run the model: it keeps no
//! KV cache, samples a fixed token that ends no sequence (so every request runs to its
//! `max_tokens`, as with `ignore_eos`), and routes every token of every MoE layer with a
//! [`RoutingGenerator`]. The router's scheduler drives it exactly as it drives a real node.

use std::collections::HashSet;

use step::{
    AttentionNode, KvCapacity, SampledToken, SeqId, StepBatch, StepError, StepOutput, StepRouting,
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
                return Err(StepError::Invalid(format!(
                    "sequence {} appears twice in one step",
                    e.seq
                )));
            }
            let blocks = (e.start + e.tokens.len()).div_ceil(self.kv.block_size.max(1));
            if e.block_table.len() < blocks {
                return Err(StepError::Invalid(format!(
                    "sequence {} needs {blocks} KV blocks but has {}",
                    e.seq,
                    e.block_table.len()
                )));
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
        Ok(StepOutput {
            sampled: batch
                .entries
                .iter()
                .filter(|e| e.sample.is_some())
                .map(|e| SampledToken {
                    seq: e.seq,
                    token: self.token,
                    logprob: 0.0,
                    top_logprobs: Vec::new(),
                })
                .collect(),
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
