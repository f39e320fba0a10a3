//! [`MonolithicNode`]: the whole model in this process (the reference forward), behind the
//! same step API as the disaggregated node. It is the baseline the disaggregated path is
//! measured and verified against, and a working engine before any card exists.
//!
//! KV blocks are accounted for (the block table must cover every token) but the keys and values
//! live in the reference model's contiguous cache.

use std::collections::HashMap;

use model::forward::{LogitsFor, ReferenceModel, SeqChunk};

use crate::merge::score_full_row;
use crate::prefix::FilledBlocks;
use crate::sampler::{RowToSample, TokenHistory, record_tokens, sample_rows};
use step::{
    AttentionNode, InvalidStep, KvCapacity, MAX_TOP_LOGPROBS, ModelFailure, PromptLogprobs,
    PromptScoring, SeqId, StepBatch, StepError, StepOutput,
};

/// The reference model as an attention node.
#[derive(Debug)]
pub struct MonolithicNode {
    model: ReferenceModel,
    capacity: KvCapacity,
    histories: HashMap<SeqId, TokenHistory>,
}

impl MonolithicNode {
    /// Wraps a reference model; `capacity` is what the router may allocate.
    pub fn new(model: ReferenceModel, capacity: KvCapacity) -> Self {
        MonolithicNode {
            model,
            capacity,
            histories: HashMap::new(),
        }
    }

    /// The model.
    pub fn model(&self) -> &ReferenceModel {
        &self.model
    }
}

/// Checks one batch against the node's state: every sequence once, starts that match what is
/// cached, block tables that cover the new tokens with valid block ids, and cached prefixes
/// only on a node that shares blocks (`filled`), on blocks it filled.
pub(crate) fn validate_batch(
    batch: &StepBatch,
    capacity: KvCapacity,
    filled: Option<&FilledBlocks>,
    cached_len: impl Fn(SeqId) -> usize,
) -> Result<(), StepError> {
    let mut seen = std::collections::HashSet::new();
    for e in &batch.entries {
        if !seen.insert(e.seq) {
            return Err(InvalidStep::DuplicateSequence { seq: e.seq }.into());
        }
        if e.tokens.is_empty() {
            return Err(InvalidStep::NoNewTokens { seq: e.seq }.into());
        }
        let cached = if e.cached_prefix.is_empty() {
            cached_len(e.seq)
        } else {
            match filled {
                Some(filled) => filled.check(e)?,
                None => {
                    return Err(InvalidStep::BlocksNotShared { seq: e.seq }.into());
                }
            }
            e.cached_prefix.len()
        };
        if e.start != cached {
            return Err(InvalidStep::StartMismatch {
                seq: e.seq,
                start: e.start,
                cached,
            }
            .into());
        }
        let needed = (e.start + e.tokens.len()).div_ceil(capacity.block_size);
        if e.block_table.len() < needed {
            return Err(InvalidStep::TooFewBlocks {
                seq: e.seq,
                needed,
                tokens: e.start + e.tokens.len(),
                got: e.block_table.len(),
            }
            .into());
        }
        if let Some(b) = e
            .block_table
            .iter()
            .find(|&&b| b as usize >= capacity.num_blocks)
        {
            return Err(InvalidStep::UnknownBlock {
                seq: e.seq,
                block: *b,
                num_blocks: capacity.num_blocks,
            }
            .into());
        }
        if let Some(p) = &e.prompt_logprobs {
            p.check(e.seq, e.tokens.len())?;
        }
        if let Some(s) = &e.sample
            && s.top_logprobs > MAX_TOP_LOGPROBS
        {
            return Err(InvalidStep::TooManyTopLogprobs {
                asked: s.top_logprobs,
                max: MAX_TOP_LOGPROBS,
            }
            .into());
        }
    }
    Ok(())
}

/// The prompt logprobs of one entry from its rows of logits (a vocabulary of `vocab` each):
/// row `i` scores `scoring.next[i]`.
pub(crate) fn score_prompt<'a>(
    seq: SeqId,
    rows: impl Iterator<Item = &'a [f32]>,
    vocab: usize,
    scoring: &PromptScoring,
) -> Result<PromptLogprobs, StepError> {
    let tokens = scoring
        .next
        .iter()
        .zip(rows)
        .map(|(&target, row)| {
            score_full_row(row, target, scoring.top_logprobs).ok_or(StepError::from(
                InvalidStep::TokenOutOfRange {
                    token: target,
                    vocab,
                },
            ))
        })
        .collect::<Result<Vec<_>, _>>()?;
    if tokens.len() != scoring.next.len() {
        return Err(ModelFailure::Unscored { seq }.into());
    }
    Ok(PromptLogprobs { seq, tokens })
}

impl AttentionNode for MonolithicNode {
    fn kv_capacity(&self) -> KvCapacity {
        self.capacity
    }

    fn step(&mut self, batch: &StepBatch) -> Result<StepOutput, StepError> {
        validate_batch(batch, self.capacity, None, |s| self.model.seq_len(s))?;
        let chunks: Vec<SeqChunk> = batch
            .entries
            .iter()
            .map(|e| SeqChunk {
                seq: e.seq,
                tokens: e.tokens.clone(),
            })
            .collect();
        // Every position's logits only when some entry scores its prompt tokens.
        let scoring = batch.entries.iter().any(|e| e.prompt_logprobs.is_some());
        let which = if scoring {
            LogitsFor::AllTokens
        } else {
            LogitsFor::LastToken
        };
        let mut logits = self
            .model
            .forward(&chunks, which)
            .map_err(StepError::compute)?;
        for e in &batch.entries {
            record_tokens(&mut self.histories, e);
        }
        let vocab = self.model.config().vocab_size;
        let mut prompt_logprobs = Vec::new();
        if scoring {
            for (e, rows) in batch.entries.iter().zip(&mut logits) {
                if let Some(p) = &e.prompt_logprobs {
                    let scored = rows.chunks_exact(vocab.max(1));
                    prompt_logprobs.push(score_prompt(e.seq, scored, vocab, p)?);
                }
                // Keep the last row, the one a sample reads.
                let last = rows.len().saturating_sub(vocab);
                rows.drain(..last);
            }
        }
        let rows: Vec<RowToSample<'_>> = batch
            .entries
            .iter()
            .zip(&logits)
            .filter_map(|(e, logits)| {
                Some(RowToSample {
                    seq: e.seq,
                    logits,
                    request: e.sample.as_ref()?,
                    history: self.histories.get(&e.seq)?,
                    position: (e.start + e.tokens.len()) as u64,
                })
            })
            .collect();
        Ok(StepOutput {
            sampled: sample_rows(&rows)?,
            prompt_logprobs,
        })
    }

    fn free(&mut self, seqs: &[SeqId]) -> Result<(), StepError> {
        for &s in seqs {
            self.model.free(s);
            self.histories.remove(&s);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use model::generate::{GenerationRequest, generate};
    use model::sampling::SamplingParams;
    use step::{AllowedTokens, SampleRequest, StepEntry, TokenMask};

    fn tiny() -> (tempfile::TempDir, model::ModelWeights) {
        let dir = tempfile::tempdir().unwrap();
        let opts = model::synth::SynthOptions {
            family: model::Family::GptOss,
            preset: model::synth::Preset::Tiny,
            format: None,
            seed: 3,
            config_only: false,
        };
        model::synth::synthesize(dir.path(), &opts, &mut |_, _| {}).unwrap();
        let w = model::ModelWeights::load(dir.path()).unwrap();
        (dir, w)
    }

    #[test]
    fn steps_reproduce_reference_generation() {
        let (_dir, weights) = tiny();
        let prompt = vec![5u32, 9, 77, 100, 3, 8];
        let mut reference = ReferenceModel::new(weights.clone()).unwrap();
        let expected = generate(
            &mut reference,
            &[GenerationRequest {
                prompt: prompt.clone(),
                max_tokens: 6,
                sampling: SamplingParams::greedy(),
                stop_token_ids: vec![],
            }],
            0,
        )
        .unwrap()
        .remove(0)
        .output_ids;
        let capacity = KvCapacity {
            block_size: 4,
            num_blocks: 8,
        };
        let mut node = MonolithicNode::new(ReferenceModel::new(weights).unwrap(), capacity);
        let request = SampleRequest {
            params: SamplingParams::greedy(),
            penalties: Default::default(),
            logprobs: true,
            top_logprobs: 2,
            allowed: None,
        };
        // Prefill in two chunks, then decode.
        let entry = |tokens: Vec<u32>, start: usize, sample: bool| StepEntry {
            seq: 7,
            tokens,
            start,
            prompt_len: prompt.len(),
            block_table: vec![0, 1, 2, 3],
            sample: sample.then(|| request.clone()),
            cached_prefix: Vec::new(),
            prompt_logprobs: None,
        };
        let none = node
            .step(&StepBatch {
                entries: vec![entry(prompt[..4].to_vec(), 0, false)],
            })
            .unwrap();
        assert!(none.sampled.is_empty());
        let mut out = Vec::new();
        let mut next = node
            .step(&StepBatch {
                entries: vec![entry(prompt[4..].to_vec(), 4, true)],
            })
            .unwrap()
            .sampled
            .remove(0);
        assert_eq!(next.top_logprobs.len(), 2);
        assert_eq!(next.top_logprobs[0].0, next.token);
        while out.len() < 5 {
            out.push(next.token);
            let start = prompt.len() + out.len() - 1;
            next = node
                .step(&StepBatch {
                    entries: vec![entry(vec![next.token], start, true)],
                })
                .unwrap()
                .sampled
                .remove(0);
        }
        out.push(next.token);
        assert_eq!(out, expected);
        node.free(&[7]).unwrap();
        assert_eq!(node.model().seq_len(7), 0);
    }

    /// Rows sampled together (on the pool) come back in batch order, each what the sequence
    /// alone gives: token, logprob and alternatives.
    #[test]
    fn a_batch_samples_each_row_as_alone_in_batch_order() {
        let (_dir, weights) = tiny();
        let capacity = KvCapacity {
            block_size: 4,
            num_blocks: 16,
        };
        let request = |seed: u64| SampleRequest {
            params: SamplingParams {
                temperature: 0.9,
                seed,
                ..Default::default()
            },
            penalties: Default::default(),
            logprobs: true,
            top_logprobs: 3,
            allowed: None,
        };
        let prompts: [(SeqId, Vec<u32>, bool); 4] = [
            (3, vec![5, 9, 77], true),
            (4, vec![1, 2], false),
            (9, vec![100, 3, 8, 8, 6], true),
            (1, vec![42], true),
        ];
        let entry = |(seq, tokens, sample): &(SeqId, Vec<u32>, bool), i: usize| StepEntry {
            seq: *seq,
            tokens: tokens.clone(),
            start: 0,
            prompt_len: tokens.len(),
            block_table: vec![2 * i as u32, 2 * i as u32 + 1],
            sample: sample.then_some(request(*seq)),
            cached_prefix: Vec::new(),
            prompt_logprobs: None,
        };
        let mut together =
            MonolithicNode::new(ReferenceModel::new(weights.clone()).unwrap(), capacity);
        let batch = StepBatch {
            entries: prompts
                .iter()
                .enumerate()
                .map(|(i, p)| entry(p, i))
                .collect(),
        };
        let got = together.step(&batch).unwrap().sampled;
        let mut alone = Vec::new();
        for (i, p) in prompts.iter().enumerate() {
            let mut node =
                MonolithicNode::new(ReferenceModel::new(weights.clone()).unwrap(), capacity);
            let batch = StepBatch {
                entries: vec![entry(p, i)],
            };
            alone.extend(node.step(&batch).unwrap().sampled);
        }
        assert_eq!(got.iter().map(|s| s.seq).collect::<Vec<_>>(), vec![3, 9, 1]);
        assert_eq!(got.len(), alone.len());
        for (g, a) in got.iter().zip(&alone) {
            assert_eq!((g.seq, g.token), (a.seq, a.token));
            assert_eq!(g.logprob.to_bits(), a.logprob.to_bits());
            assert_eq!(g.top_logprobs, a.top_logprobs);
            assert_eq!(g.top_logprobs.len(), 3);
        }
    }

    /// A greedy row whose mask refuses the unconstrained choice samples the second best token,
    /// waiting for a mask filled from another thread, with the unconstrained logprob and
    /// alternatives; a failed mask fails the step.
    #[test]
    fn a_constrained_greedy_row_samples_the_best_allowed_token() {
        let (_dir, weights) = tiny();
        let vocab = weights.config.vocab_size;
        let capacity = KvCapacity {
            block_size: 4,
            num_blocks: 8,
        };
        let entry = |allowed: Option<AllowedTokens>| StepEntry {
            seq: 2,
            tokens: vec![5, 9, 77, 100, 3],
            start: 0,
            prompt_len: 5,
            block_table: vec![0, 1],
            sample: Some(SampleRequest {
                params: SamplingParams::greedy(),
                penalties: Default::default(),
                logprobs: true,
                top_logprobs: vocab.min(20),
                allowed,
            }),
            cached_prefix: Vec::new(),
            prompt_logprobs: None,
        };
        let step = |allowed| {
            let mut node =
                MonolithicNode::new(ReferenceModel::new(weights.clone()).unwrap(), capacity);
            node.step(&StepBatch {
                entries: vec![entry(allowed)],
            })
            .map(|mut out| out.sampled.remove(0))
        };
        let free = step(None).unwrap();
        // The alternatives rank the unconstrained distribution: the second is the best token
        // once the first is refused (lowest id first on ties, as greedy breaks them).
        let second = free.top_logprobs[1];
        let mask = TokenMask::from_tokens(vocab, (0..vocab as u32).filter(|&t| t != free.token));
        let handle = AllowedTokens::pending();
        let filler = handle.clone();
        let fill = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(20));
            filler.fill(Ok(mask));
        });
        let got = step(Some(handle)).unwrap();
        fill.join().unwrap();
        assert_eq!(got.token, second.0);
        assert_eq!(got.logprob, second.1);
        assert_eq!(got.top_logprobs, free.top_logprobs);

        let failed = AllowedTokens::pending();
        failed.fill(Err("the grammar broke".into()));
        let err = step(Some(failed)).unwrap_err();
        assert!(
            matches!(&err, StepError::Model(ModelFailure::Mask { reason, .. }) if reason.contains("the grammar broke")),
            "{err}"
        );
    }

    #[test]
    fn inconsistent_batches_are_refused() {
        let (_dir, weights) = tiny();
        let capacity = KvCapacity {
            block_size: 4,
            num_blocks: 2,
        };
        let mut node = MonolithicNode::new(ReferenceModel::new(weights).unwrap(), capacity);
        let e = StepEntry {
            seq: 1,
            tokens: vec![1; 9],
            start: 0,
            prompt_len: 9,
            block_table: vec![0, 1],
            sample: None,
            cached_prefix: Vec::new(),
            prompt_logprobs: None,
        };
        let err = node
            .step(&StepBatch {
                entries: vec![e.clone()],
            })
            .unwrap_err()
            .to_string();
        assert!(err.contains("needs 3 KV blocks"), "{err}");
        let bad = StepEntry {
            tokens: vec![1],
            block_table: vec![5],
            ..e.clone()
        };
        assert!(
            node.step(&StepBatch { entries: vec![bad] })
                .unwrap_err()
                .to_string()
                .contains("block 5")
        );
        let late = StepEntry {
            tokens: vec![1],
            start: 3,
            block_table: vec![0],
            ..e
        };
        assert!(
            node.step(&StepBatch {
                entries: vec![late]
            })
            .unwrap_err()
            .to_string()
            .contains("starts at 3")
        );
    }
}
