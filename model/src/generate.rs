//! Batched generation with the reference forward: prefill every prompt, then decode the
//! sequences that are still running, one token per step.

use crate::error::{Error, Result};
use crate::forward::{LogitsFor, ReferenceModel, SeqChunk};
use crate::sampling::{self, SamplingParams};

/// One sequence to generate.
#[derive(Debug, Clone)]
pub struct GenerationRequest {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Token selection.
    pub sampling: SamplingParams,
    /// Ids that end generation (the model's end-of-sequence ids, usually).
    pub stop_token_ids: Vec<u32>,
}

/// Why a sequence stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// A stop token was generated (it is included in the output).
    Stop,
    /// `max_tokens` was reached.
    Length,
}

/// One generated sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    /// Generated ids.
    pub output_ids: Vec<u32>,
    /// Log-probability of each generated token under the unfiltered, temperature-1 distribution.
    pub logprobs: Vec<f32>,
    /// Why it stopped.
    pub finish_reason: FinishReason,
}

/// Generates every request together in one batch (sequence ids `0..requests.len()` plus
/// `first_seq`), freeing their caches at the end.
pub fn generate(
    model: &mut ReferenceModel,
    requests: &[GenerationRequest],
    first_seq: u64,
) -> Result<Vec<Generation>> {
    let vocab = model.config().vocab_size;
    let mut results: Vec<Generation> = requests
        .iter()
        .map(|_| Generation {
            output_ids: Vec::new(),
            logprobs: Vec::new(),
            finish_reason: FinishReason::Length,
        })
        .collect();
    let mut running: Vec<usize> = Vec::new();
    for (i, r) in requests.iter().enumerate() {
        if r.prompt.is_empty() {
            return Err(Error::InvalidInput(format!(
                "request {i} has an empty prompt"
            )));
        }
        if r.max_tokens > 0 {
            running.push(i);
        }
    }
    let mut next: Vec<SeqChunk> = running
        .iter()
        .map(|&i| SeqChunk {
            seq: first_seq + i as u64,
            tokens: requests[i].prompt.clone(),
        })
        .collect();
    let outcome = (|| -> Result<()> {
        while !running.is_empty() {
            let logits = model.forward(&next, LogitsFor::LastToken)?;
            let mut still = Vec::new();
            let mut chunks = Vec::new();
            for (k, &i) in running.iter().enumerate() {
                let r = &requests[i];
                let row = &logits[k][..vocab];
                let position = (r.prompt.len() + results[i].output_ids.len()) as u64;
                let tok = sampling::sample(row, &r.sampling, position);
                let lp = sampling::log_prob(row[tok as usize], sampling::log_sum_exp(row));
                let g = &mut results[i];
                g.output_ids.push(tok);
                g.logprobs.push(lp);
                if r.stop_token_ids.contains(&tok) {
                    g.finish_reason = FinishReason::Stop;
                } else if g.output_ids.len() < r.max_tokens {
                    still.push(i);
                    chunks.push(SeqChunk {
                        seq: first_seq + i as u64,
                        tokens: vec![tok],
                    });
                }
            }
            running = still;
            next = chunks;
        }
        Ok(())
    })();
    for i in 0..requests.len() {
        model.free(first_seq + i as u64);
    }
    outcome.map(|()| results)
}
