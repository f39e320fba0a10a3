//! A minimal driver over the step API: prefill a set of prompts together, then decode them one
//! token per step until each stops. It is what `afd generate` and `afd verify` run and what the
//! tests compare against the reference; the server uses the router's scheduler instead.

use model::generate::{FinishReason, Generation, GenerationRequest};

use step::{AttentionNode, Penalties, SampleRequest, SeqId, StepBatch, StepEntry, StepError};

/// Generates every request together; sequence ids are `first_seq + i`. Blocks are handed out
/// contiguously; the node's cache must hold every prompt plus its `max_tokens`.
pub fn generate(
    node: &mut dyn AttentionNode,
    requests: &[GenerationRequest],
    first_seq: SeqId,
) -> Result<Vec<Generation>, StepError> {
    let capacity = node.kv_capacity();
    let bs = capacity.block_size;
    let mut next_block = 0u32;
    let mut tables = Vec::with_capacity(requests.len());
    for (i, r) in requests.iter().enumerate() {
        if r.prompt.is_empty() {
            return Err(StepError::Invalid(format!(
                "request {i} has an empty prompt"
            )));
        }
        let blocks = (r.prompt.len() + r.max_tokens).div_ceil(bs) as u32;
        if (next_block + blocks) as usize > capacity.num_blocks {
            return Err(StepError::Invalid(format!(
                "the KV cache holds {} blocks of {bs} tokens; these requests need more (raise --kv-cache-memory or lower --max-tokens)",
                capacity.num_blocks
            )));
        }
        tables.push((next_block..next_block + blocks).collect::<Vec<u32>>());
        next_block += blocks;
    }
    let mut results: Vec<Generation> = requests
        .iter()
        .map(|_| Generation {
            output_ids: Vec::new(),
            logprobs: Vec::new(),
            finish_reason: FinishReason::Length,
        })
        .collect();
    let mut running: Vec<usize> = (0..requests.len())
        .filter(|&i| requests[i].max_tokens > 0)
        .collect();
    let outcome = (|| {
        while !running.is_empty() {
            let entries: Vec<StepEntry> = running
                .iter()
                .map(|&i| {
                    let r = &requests[i];
                    let out = &results[i].output_ids;
                    let (tokens, start) = match out.last() {
                        None => (r.prompt.clone(), 0),
                        Some(&t) => (vec![t], r.prompt.len() + out.len() - 1),
                    };
                    StepEntry {
                        seq: first_seq + i as u64,
                        tokens,
                        start,
                        prompt_len: r.prompt.len(),
                        block_table: tables[i].clone(),
                        sample: Some(SampleRequest {
                            params: r.sampling,
                            penalties: Penalties::default(),
                            // The JSON reports every token's logprob.
                            logprobs: true,
                            top_logprobs: 0,
                        }),
                    }
                })
                .collect();
            let out = node.step(&StepBatch { entries })?;
            let mut still = Vec::new();
            for (&i, t) in running.iter().zip(&out.sampled) {
                let g = &mut results[i];
                g.output_ids.push(t.token);
                g.logprobs.push(t.logprob);
                if requests[i].stop_token_ids.contains(&t.token) {
                    g.finish_reason = FinishReason::Stop;
                } else if g.output_ids.len() < requests[i].max_tokens {
                    still.push(i);
                }
            }
            running = still;
        }
        Ok(())
    })();
    let seqs: Vec<SeqId> = (0..requests.len() as u64).map(|i| first_seq + i).collect();
    let freed = node.free(&seqs);
    outcome.and(freed).map(|()| results)
}
