//! A deterministic stand-in for an attention node, for tests and demos without a model.
//!
//! It keeps a real "KV cache" of token ids in the blocks the router assigns, checks that block
//! tables are consistent (enough blocks, positions that continue where the sequence left off, no
//! block written while another live sequence holds it, a cached prefix that holds the tokens the
//! router says it does), and picks each next token as a hash of every token of the sequence read
//! back through its block table. So a sequence's tokens depend only on the sequence, never on
//! what else is in the batch, and a router bug that hands one sequence's blocks to another,
//! shares a block that holds other tokens, or forgets to re-prefill after a preemption, changes
//! the output or fails the step. A constrained row (structured output) waits for its mask and
//! answers the hash's token if allowed, else the next allowed one ([`step::TokenMask::first_allowed_from`]).
//! Prompt tokens are scored by a hash of the tokens before them ([`FakeNode::prompt_score`]).

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Duration;

use step::{
    AttentionNode, InvalidStep, KvCapacity, PromptLogprobs, SampleRequest, SampledToken,
    ScoredToken, SeqId, StepBatch, StepError, StepOutput,
};

/// Pauses a [`FakeNode`] between steps, so tests can hold requests in place deterministically.
#[derive(Debug, Default)]
pub struct StepGate {
    paused: Mutex<bool>,
    changed: Condvar,
}

impl StepGate {
    /// A gate that is open.
    pub fn new() -> Arc<Self> {
        Arc::new(StepGate::default())
    }

    /// Steps that start from now on wait until [`StepGate::resume`].
    pub fn pause(&self) {
        *self.paused.lock().unwrap_or_else(PoisonError::into_inner) = true;
    }

    /// Lets steps run again.
    pub fn resume(&self) {
        *self.paused.lock().unwrap_or_else(PoisonError::into_inner) = false;
        self.changed.notify_all();
    }

    fn wait(&self) {
        let mut paused = self.paused.lock().unwrap_or_else(PoisonError::into_inner);
        while *paused {
            paused = self
                .changed
                .wait(paused)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }
}

/// How a [`FakeNode`] behaves.
#[derive(Debug, Clone)]
pub struct FakeNodeConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks.
    pub num_blocks: usize,
    /// The ids it generates from (hash mode).
    pub vocab: Range<u32>,
    /// When set, the i-th generated token of every sequence is `script[i % len]` instead of a
    /// hash (for tests of stop strings and detokenization).
    pub script: Option<Vec<u32>>,
    /// Sleep this long in every step (to make requests overlap in tests).
    pub step_delay: Duration,
    /// A gate every step waits at.
    pub gate: Option<Arc<StepGate>>,
    /// Every sample request seen, in order (to check what reached the node).
    pub observed: Option<Arc<Mutex<Vec<SampleRequest>>>>,
    /// Let the router share full blocks between sequences (prefix caching).
    pub shares_kv_blocks: bool,
}

impl Default for FakeNodeConfig {
    fn default() -> Self {
        FakeNodeConfig {
            block_size: 16,
            num_blocks: 1024,
            vocab: 32..127,
            script: None,
            step_delay: Duration::ZERO,
            gate: None,
            observed: None,
            shares_kv_blocks: true,
        }
    }
}

/// A deterministic fake attention node (see the module doc).
#[derive(Debug)]
pub struct FakeNode {
    config: FakeNodeConfig,
    /// Token stored in each cache slot (`block * block_size + offset`).
    slots: Vec<u32>,
    /// The live sequences that hold each block.
    holders: Vec<Vec<SeqId>>,
    /// Per live sequence: tokens in the cache, and its blocks.
    seqs: HashMap<SeqId, (usize, Vec<u32>)>,
    steps: u64,
}

fn mix(h: u64, x: u64) -> u64 {
    let mut z = (h ^ x).wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl FakeNode {
    /// A node with `config`.
    pub fn new(config: FakeNodeConfig) -> Self {
        let slots = vec![0; config.block_size * config.num_blocks];
        FakeNode {
            holders: vec![Vec::new(); config.num_blocks],
            slots,
            seqs: HashMap::new(),
            steps: 0,
            config,
        }
    }

    /// The token a sequence of `tokens` (prompt then outputs; `prompt_len` of them prompt)
    /// produces next under `sample`: what this node returns, for tests to compare against.
    pub fn next_token(
        config: &FakeNodeConfig,
        tokens: &[u32],
        prompt_len: usize,
        sample: &SampleRequest,
    ) -> u32 {
        if let Some(script) = config.script.as_ref().filter(|s| !s.is_empty()) {
            return script[(tokens.len() - prompt_len) % script.len()];
        }
        let mut h = tokens
            .iter()
            .fold(0xcbf2_9ce4_8422_2325u64, |h, &t| mix(h, t as u64));
        if !sample.params.is_greedy() {
            h = mix(mix(h, sample.params.seed), tokens.len() as u64);
        }
        let span = (config.vocab.end - config.vocab.start).max(1) as u64;
        config.vocab.start + (h % span) as u32
    }

    /// The score of prompt token `target` after `before` (read back through the block table, so
    /// a router that scores the wrong position or skips tokens changes it): a logprob hashed
    /// from both, and `top_logprobs` alternatives led by the target itself.
    pub fn prompt_score(before: &[u32], target: u32, top_logprobs: usize) -> ScoredToken {
        let h = before.iter().fold(0x8422_2325u64, |h, &t| mix(h, t as u64));
        let logprob = -((mix(h, target as u64) % 97) as f32) / 10.0 - 0.05;
        ScoredToken {
            token: target,
            logprob,
            top_logprobs: (0..top_logprobs as u32)
                .map(|k| (target + k, logprob - k as f32))
                .collect(),
        }
    }

    /// Steps run so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// A cached prefix must be whole blocks that already hold exactly its tokens.
    fn check_cached_prefix(&self, e: &step::StepEntry) -> Result<(), StepError> {
        let n = e.cached_prefix.len();
        if n == 0 {
            return Ok(());
        }
        if !self.config.shares_kv_blocks {
            return Err(InvalidStep::BlocksNotShared { seq: e.seq }.into());
        }
        if !n.is_multiple_of(self.config.block_size)
            || e.block_table.len() * self.config.block_size < n
        {
            return Err(InvalidStep::CachedPrefixNotWholeBlocks {
                seq: e.seq,
                tokens: n,
                start: e.start,
                block_size: self.config.block_size,
            }
            .into());
        }
        for (p, &t) in e.cached_prefix.iter().enumerate() {
            let held = self.slots[self.slot(&e.block_table, p)];
            if held != t {
                return Err(InvalidStep::CachedTokenMismatch {
                    seq: e.seq,
                    position: p,
                    held,
                    token: t,
                }
                .into());
            }
        }
        Ok(())
    }

    fn slot(&self, table: &[u32], position: usize) -> usize {
        let bs = self.config.block_size;
        table[position / bs] as usize * bs + position % bs
    }
}

impl AttentionNode for FakeNode {
    fn kv_capacity(&self) -> KvCapacity {
        KvCapacity {
            block_size: self.config.block_size,
            num_blocks: self.config.num_blocks,
        }
    }

    fn step(&mut self, batch: &StepBatch) -> Result<StepOutput, StepError> {
        if let Some(gate) = &self.config.gate {
            gate.wait();
        }
        if !self.config.step_delay.is_zero() {
            std::thread::sleep(self.config.step_delay);
        }
        self.steps += 1;
        let mut out = StepOutput::default();
        for e in &batch.entries {
            if e.starts_sequence() {
                self.free(&[e.seq])?;
            }
            let known = self
                .seqs
                .get(&e.seq)
                .map_or(e.cached_prefix.len(), |(len, _)| *len);
            if e.start != known {
                return Err(InvalidStep::StartMismatch {
                    seq: e.seq,
                    start: e.start,
                    cached: known,
                }
                .into());
            }
            let end = e.start + e.tokens.len();
            if e.block_table.len() * self.config.block_size < end {
                return Err(InvalidStep::TooFewBlocks {
                    seq: e.seq,
                    needed: end.div_ceil(self.config.block_size),
                    tokens: end,
                    got: e.block_table.len(),
                }
                .into());
            }
            self.check_cached_prefix(e)?;
            let bs = self.config.block_size;
            let written = e.start / bs..end.div_ceil(bs);
            for (i, &b) in e.block_table.iter().enumerate() {
                let Some(holders) = self.holders.get(b as usize) else {
                    return Err(InvalidStep::UnknownBlock {
                        seq: e.seq,
                        block: b,
                        num_blocks: self.holders.len(),
                    }
                    .into());
                };
                let other = holders.iter().find(|&&s| s != e.seq);
                if let (true, Some(other)) = (written.contains(&i), other) {
                    return Err(InvalidStep::BlockOfAnother {
                        seq: e.seq,
                        block: b,
                        holder: *other,
                    }
                    .into());
                }
            }
            for &b in &e.block_table {
                let holders = &mut self.holders[b as usize];
                if !holders.contains(&e.seq) {
                    holders.push(e.seq);
                }
            }
            for (i, &t) in e.tokens.iter().enumerate() {
                let s = self.slot(&e.block_table, e.start + i);
                self.slots[s] = t;
            }
            self.seqs.insert(e.seq, (end, e.block_table.clone()));
            if let Some(scoring) = &e.prompt_logprobs {
                scoring.check(e.seq, e.tokens.len())?;
                let history: Vec<u32> = (0..end)
                    .map(|p| self.slots[self.slot(&e.block_table, p)])
                    .collect();
                let tokens = scoring
                    .next
                    .iter()
                    .enumerate()
                    .map(|(i, &target)| {
                        Self::prompt_score(
                            &history[..e.start + i + 1],
                            target,
                            scoring.top_logprobs,
                        )
                    })
                    .collect();
                out.prompt_logprobs
                    .push(PromptLogprobs { seq: e.seq, tokens });
            }
            let Some(sample) = &e.sample else {
                continue;
            };
            if let Some(observed) = &self.config.observed {
                observed
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(sample.clone());
            }
            let history: Vec<u32> = (0..end)
                .map(|p| self.slots[self.slot(&e.block_table, p)])
                .collect();
            let mut token = Self::next_token(&self.config, &history, e.prompt_len, sample);
            if let Some(mask) = sample.allowed_mask(e.seq)? {
                token = mask.first_allowed_from(token);
            }
            let logprob = -(((token as u64 * 7919) % 97) as f32) / 10.0 - 0.05;
            let mut top_logprobs = Vec::new();
            for k in 0..sample.top_logprobs {
                let alt = if k == 0 {
                    token
                } else {
                    // A constrained token may lie below the vocabulary range.
                    self.config.vocab.start
                        + (token.saturating_sub(self.config.vocab.start) + k as u32)
                            % (self.config.vocab.end - self.config.vocab.start).max(1)
                };
                top_logprobs.push((alt, logprob - k as f32));
            }
            out.sampled.push(SampledToken {
                seq: e.seq,
                token,
                logprob,
                top_logprobs,
            });
        }
        Ok(out)
    }

    fn free(&mut self, seqs: &[SeqId]) -> Result<(), StepError> {
        for s in seqs {
            if let Some((_, blocks)) = self.seqs.remove(s) {
                for b in blocks {
                    self.holders[b as usize].retain(|h| h != s);
                }
            }
        }
        Ok(())
    }

    fn shares_kv_blocks(&self) -> bool {
        self.config.shares_kv_blocks
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use step::ModelFailure;
    use step::{AllowedTokens, StepEntry, TokenMask};

    fn entry(seq: SeqId, allowed: Option<AllowedTokens>) -> StepEntry {
        StepEntry {
            seq,
            tokens: vec![40 + seq as u32, 50, 60],
            start: 0,
            prompt_len: 3,
            block_table: vec![seq as u32],
            sample: Some(SampleRequest {
                params: Default::default(),
                penalties: Default::default(),
                logprobs: true,
                top_logprobs: 2,
                allowed,
            }),
            cached_prefix: Vec::new(),
            prompt_logprobs: None,
        }
    }

    /// A constrained row answers an allowed token: the free choice when allowed, else the next
    /// allowed one, wrapping; a mask that failed fails the step.
    #[test]
    fn constrained_rows_answer_an_allowed_token() {
        let config = FakeNodeConfig::default();
        let greedy = SampleRequest {
            params: Default::default(),
            penalties: Default::default(),
            logprobs: false,
            top_logprobs: 0,
            allowed: None,
        };
        let free: Vec<u32> = (0..3)
            .map(|s| FakeNode::next_token(&config, &[40 + s, 50, 60], 3, &greedy))
            .collect();
        let ready =
            |tokens: Vec<u32>| Some(AllowedTokens::ready(TokenMask::from_tokens(200, tokens)));
        let batch = StepBatch {
            entries: vec![
                // Its own choice and one more: the choice.
                entry(0, ready(vec![free[0], 3])),
                // Only tokens below the choice: the lowest, after wrapping.
                entry(1, ready(vec![free[1] - 7, free[1] - 3])),
                // One above and one below: the one above.
                entry(2, ready(vec![free[2] - 1, free[2] + 2])),
            ],
        };
        let mut node = FakeNode::new(config.clone());
        let out = node.step(&batch).unwrap();
        let tokens: Vec<u32> = out.sampled.iter().map(|s| s.token).collect();
        assert_eq!(tokens, vec![free[0], free[1] - 7, free[2] + 2]);
        assert!(out.sampled.iter().all(|s| s.top_logprobs.len() == 2));

        let failed = AllowedTokens::pending();
        failed.fill(Err("the grammar broke".into()));
        let err = node
            .step(&StepBatch {
                entries: vec![entry(5, Some(failed))],
            })
            .unwrap_err();
        assert!(
            matches!(&err, StepError::Model(ModelFailure::Mask { reason, .. }) if reason.contains("the grammar broke")),
            "{err}"
        );
    }
}
