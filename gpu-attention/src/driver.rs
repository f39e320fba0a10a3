//! A minimal driver over the step API: prefill a set of prompts together, then decode them one
//! token per step until each stops. It is what `afd generate` and `afd verify` run and what the
//! tests compare against the reference; the server uses the router's scheduler instead.

use model::generate::{FinishReason, Generation, GenerationRequest};

use step::{
    AttentionNode, InvalidStep, Penalties, SampleRequest, SeqId, StepBatch, StepEntry, StepError,
};

/// Generates every request together; sequence ids are `first_seq + i`. Blocks are handed out
/// contiguously; the node's cache must hold every prompt plus its `max_tokens`. Each prompt
/// goes in one step; see [`generate_in_chunks`] for nodes that take fewer tokens a step.
pub fn generate(
    node: &mut dyn AttentionNode,
    requests: &[GenerationRequest],
    first_seq: SeqId,
) -> Result<Vec<Generation>, StepError> {
    generate_in_chunks(node, requests, first_seq, usize::MAX)
}

/// [`generate`] with at most `max_step_tokens` tokens a step (vLLM's
/// `max_num_batched_tokens`): longer prompts are prefilled in chunks, the last of which
/// samples the first output token; sequences that do not fit in a step wait for the next.
pub fn generate_in_chunks(
    node: &mut dyn AttentionNode,
    requests: &[GenerationRequest],
    first_seq: SeqId,
    max_step_tokens: usize,
) -> Result<Vec<Generation>, StepError> {
    if max_step_tokens == 0 {
        return Err(InvalidStep::Setup(
            "a step must take at least one token (raise --max-num-batched-tokens)".into(),
        )
        .into());
    }
    let capacity = node.kv_capacity();
    let bs = capacity.block_size;
    let mut next_block = 0u32;
    let mut tables = Vec::with_capacity(requests.len());
    for (i, r) in requests.iter().enumerate() {
        if r.prompt.is_empty() {
            return Err(InvalidStep::EmptyPrompt { request: i }.into());
        }
        let blocks = (r.prompt.len() + r.max_tokens).div_ceil(bs) as u32;
        if (next_block + blocks) as usize > capacity.num_blocks {
            return Err(InvalidStep::Setup(format!(
                "the KV cache holds {} blocks of {bs} tokens; these requests need more (raise \
                 --kv-cache-memory or lower --max-tokens)",
                capacity.num_blocks
            ))
            .into());
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
    // Prompt tokens already in each sequence's cache.
    let mut prefilled = vec![0usize; requests.len()];
    let outcome = (|| {
        while !running.is_empty() {
            let mut budget = max_step_tokens;
            let mut entries = Vec::with_capacity(running.len());
            // The requests whose entry samples this step, in entry order.
            let mut sampling = Vec::with_capacity(running.len());
            for &i in &running {
                let r = &requests[i];
                let out = &results[i].output_ids;
                let (tokens, start, last_chunk) = match out.last() {
                    None => {
                        let from = prefilled[i];
                        let to = r.prompt.len().min(from.saturating_add(budget));
                        (r.prompt[from..to].to_vec(), from, to == r.prompt.len())
                    }
                    Some(&t) => (vec![t], r.prompt.len() + out.len() - 1, true),
                };
                budget -= tokens.len();
                if out.is_empty() {
                    prefilled[i] += tokens.len();
                }
                if last_chunk {
                    sampling.push(i);
                }
                entries.push(StepEntry {
                    seq: first_seq + i as u64,
                    tokens,
                    start,
                    prompt_len: r.prompt.len(),
                    block_table: tables[i].clone(),
                    sample: last_chunk.then_some(SampleRequest {
                        params: r.sampling,
                        penalties: Penalties::default(),
                        // The JSON reports every token's logprob.
                        logprobs: true,
                        top_logprobs: 0,
                        allowed: None,
                    }),
                    cached_prefix: Vec::new(),
                    prompt_logprobs: None,
                });
                if budget == 0 {
                    break;
                }
            }
            let out = node.step(&StepBatch { entries })?;
            let mut done = Vec::new();
            for (&i, t) in sampling.iter().zip(&out.sampled) {
                let g = &mut results[i];
                g.output_ids.push(t.token);
                g.logprobs.push(t.logprob);
                if requests[i].stop_token_ids.contains(&t.token) {
                    g.finish_reason = FinishReason::Stop;
                    done.push(i);
                } else if g.output_ids.len() >= requests[i].max_tokens {
                    done.push(i);
                }
            }
            running.retain(|i| !done.contains(i));
        }
        Ok(())
    })();
    let seqs: Vec<SeqId> = (0..requests.len() as u64).map(|i| first_seq + i).collect();
    let freed = node.free(&seqs);
    outcome.and(freed).map(|()| results)
}
