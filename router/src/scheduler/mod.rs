//! The I/O-free scheduling core of one attention node, in the style of vLLM v1.
//!
//! Every step, [`Scheduler::schedule`] picks work within a token budget
//! (`max_num_batched_tokens`) and a sequence limit (`max_num_seqs`): first the running requests,
//! oldest first (a decode is one token, a prompt being prefilled in chunks takes what is left of
//! the budget), then waiting requests in arrival order (first come, first served) while budget,
//! sequence slots and KV blocks last. A running request that needs a new KV block when none is
//! free takes it from the newest running request, which is preempted by recompute: its blocks
//! are freed, the node forgets it, and it goes back to the front of the waiting queue, to be
//! prefilled again later with its prompt and everything it had generated. No new request starts
//! in a step that preempted.
//!
//! With prefix caching (on unless the config or the node says otherwise), a request that starts
//! or restarts first takes the cached blocks holding the longest run of full blocks at the start
//! of its tokens (never its last token, which must be computed for its logits), and its prefill
//! begins after them; the node is told which tokens those blocks hold. Every full block a step
//! computes is registered for later requests (see [`BlockManager`]).
//!
//! [`Scheduler::update_from_output`] takes the node's sampled tokens, appends them, checks the
//! stop conditions and frees finished requests. The caller passes `now`; nothing here reads a
//! clock, sleeps or does I/O, so the whole core is driven by tests with fake model outputs.

mod block_manager;
mod request;
#[cfg(test)]
mod tests;

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

pub use block_manager::{BlockHash, BlockManager};
use request::Sequence;
pub use request::{
    FinishReason, NewRequest, RequestId, RequestStatus, SchedulerOutput, SchedulerStats,
    SequenceFailure, SequenceParams, TokenOutput,
};
use step::{AllowedTokens, MaskJob, PromptScoring, StepEntry, StepOutput};

use crate::config::SchedulerConfig;
use crate::error::Error;

/// The scheduler of one attention node.
#[derive(Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    blocks: BlockManager,
    seqs: HashMap<RequestId, Sequence>,
    /// Waiting and preempted requests; preempted ones go back to the front.
    waiting: VecDeque<RequestId>,
    /// Running requests, oldest first (the newest is preempted first).
    running: Vec<RequestId>,
    /// Sequences the node must forget before the next step.
    to_free: Vec<RequestId>,
    stats: SchedulerStats,
}

impl Scheduler {
    /// A scheduler for a node whose cache has `num_blocks` blocks of `block_size` tokens
    /// (prefix caching as `config` says: the caller turns it off for a node that cannot share
    /// blocks).
    pub fn new(
        config: SchedulerConfig,
        block_size: usize,
        num_blocks: usize,
    ) -> Result<Self, Error> {
        if config.max_num_seqs == 0 || config.max_num_batched_tokens == 0 {
            return Err(Error::Config(
                "max_num_seqs and max_num_batched_tokens must be at least 1".into(),
            ));
        }
        if block_size == 0 {
            return Err(Error::Config("the node reports a block size of 0".into()));
        }
        let capacity = block_size * num_blocks;
        if config.max_model_len == 0 || config.max_model_len > capacity {
            return Err(Error::Config(format!(
                "max_model_len {} does not fit the node's KV cache of {capacity} tokens \
                 ({num_blocks} blocks of {block_size}); lower --max-model-len or give the node \
                 more cache",
                config.max_model_len
            )));
        }
        if !config.enable_chunked_prefill && config.max_num_batched_tokens < config.max_model_len {
            return Err(Error::Config(format!(
                "without chunked prefill max_num_batched_tokens ({}) must be at least \
                 max_model_len ({})",
                config.max_num_batched_tokens, config.max_model_len
            )));
        }
        Ok(Scheduler {
            blocks: BlockManager::new(block_size, num_blocks)
                .with_prefix_caching(config.enable_prefix_caching),
            config,
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            to_free: Vec::new(),
            stats: SchedulerStats::default(),
        })
    }

    /// The settings.
    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// The block accounting (read-only).
    pub fn block_manager(&self) -> &BlockManager {
        &self.blocks
    }

    /// Queues a request (it starts at a later [`Scheduler::schedule`]).
    pub fn add_request(&mut self, request: NewRequest) -> Result<(), Error> {
        let NewRequest {
            id, prompt, params, ..
        } = request;
        if prompt.is_empty() {
            return Err(Error::InvalidRequest("the prompt is empty".into()));
        }
        if params.max_tokens == 0 {
            return Err(Error::InvalidRequest(
                "max_tokens must be at least 1".into(),
            ));
        }
        if prompt.len() + params.max_tokens > self.config.max_model_len {
            return Err(Error::InvalidRequest(format!(
                "{} prompt tokens plus max_tokens {} exceed max_model_len {}",
                prompt.len(),
                params.max_tokens,
                self.config.max_model_len
            )));
        }
        if self.seqs.contains_key(&id) {
            return Err(Error::InvalidRequest(format!(
                "request id {id} is already in use"
            )));
        }
        self.seqs.insert(
            id,
            Sequence {
                prompt_len: prompt.len(),
                tokens: prompt,
                num_computed: 0,
                blocks: Vec::new(),
                block_hashes: Vec::new(),
                status: RequestStatus::Waiting,
                params,
                first_scheduled: None,
                on_node: false,
                num_preemptions: 0,
                prompt_scores: Vec::new(),
            },
        );
        self.waiting.push_back(id);
        Ok(())
    }

    /// Drops a request wherever it is and frees its blocks at once. Returns its status, or
    /// `None` if it is unknown (already finished).
    pub fn abort(&mut self, id: RequestId) -> Option<RequestStatus> {
        let status = self.seqs.get(&id)?.status;
        match status {
            RequestStatus::Running => self.running.retain(|&r| r != id),
            RequestStatus::Waiting | RequestStatus::Preempted => self.waiting.retain(|&r| r != id),
        }
        self.remove(id);
        Some(status)
    }

    /// Whether any request is waiting or running.
    pub fn has_work(&self) -> bool {
        !self.seqs.is_empty()
    }

    /// Requests known to the scheduler.
    pub fn num_requests(&self) -> usize {
        self.seqs.len()
    }

    /// Status of a request, if it is known.
    pub fn status(&self, id: RequestId) -> Option<RequestStatus> {
        self.seqs.get(&id).map(|s| s.status)
    }

    /// Ids of every running request, oldest first.
    pub fn running(&self) -> &[RequestId] {
        &self.running
    }

    /// Ids of every known request.
    pub fn request_ids(&self) -> impl Iterator<Item = RequestId> + '_ {
        self.seqs.keys().copied()
    }

    /// Sequences the node must forget now (taken: the caller frees them on the node).
    pub fn take_freed(&mut self) -> Vec<RequestId> {
        std::mem::take(&mut self.to_free)
    }

    /// Counters and gauges.
    pub fn stats(&self) -> SchedulerStats {
        let mut s = self.stats;
        s.running = self.running.len();
        s.waiting_new = 0;
        s.waiting_preempted = 0;
        for id in &self.waiting {
            match self.seqs.get(id).map(|q| q.status) {
                Some(RequestStatus::Preempted) => s.waiting_preempted += 1,
                _ => s.waiting_new += 1,
            }
        }
        s.kv_blocks_used = self.blocks.num_used();
        s.kv_blocks_total = self.blocks.num_blocks();
        s
    }

    /// Picks the next step.
    pub fn schedule(&mut self, now: Instant) -> SchedulerOutput {
        let mut out = SchedulerOutput::default();
        let mut budget = self.config.max_num_batched_tokens;

        // Running requests first, oldest first; preempt from the newest end when blocks run out.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let Some(seq) = self.seqs.get(&id) else {
                self.running.remove(i);
                continue;
            };
            let n = (seq.tokens.len() - seq.num_computed).min(budget);
            let target = seq.num_computed + n;
            let mut preempted_self = false;
            while let Some(seq) = self.seqs.get_mut(&id) {
                if self.blocks.grow_to(&mut seq.blocks, target) {
                    break;
                }
                // The newest running request gives up its blocks (possibly this one).
                let Some(victim) = self.running.pop() else {
                    break;
                };
                self.preempt(victim);
                out.preempted.push(victim);
                if victim == id {
                    preempted_self = true;
                    break;
                }
            }
            if preempted_self {
                break;
            }
            out.num_scheduled_tokens.push((id, n));
            budget -= n;
            i += 1;
        }

        // Then waiting requests, first come first served, unless this step preempted.
        if out.preempted.is_empty() {
            while let Some(&id) = self.waiting.front() {
                if budget == 0 || self.running.len() >= self.config.max_num_seqs {
                    break;
                }
                let Some(seq) = self.seqs.get_mut(&id) else {
                    self.waiting.pop_front();
                    continue;
                };
                // Waiting requests hold no block (new, or preempted and released).
                // A prompt still to be scored computes every token: none comes from the cache.
                let looked_up = self.blocks.prefix_caching() && !seq.scores_prompt();
                let hit = if looked_up {
                    Self::take_cached_prefix(&mut self.blocks, seq)
                } else {
                    0
                };
                let remaining = seq.tokens.len() - seq.num_computed;
                let n = remaining.min(budget);
                let fits = (self.config.enable_chunked_prefill || remaining <= budget)
                    && self.blocks.grow_to(&mut seq.blocks, seq.num_computed + n);
                if !fits {
                    if hit > 0 {
                        // Give the cached blocks back; the request tries again next step.
                        self.blocks.release(&mut seq.blocks);
                        seq.block_hashes.clear();
                        seq.num_computed = 0;
                    }
                    break;
                }
                if looked_up {
                    self.stats.prefix_cache_queries_total += seq.tokens.len() as u64;
                    self.stats.prefix_cache_hits_total += hit as u64;
                }
                self.waiting.pop_front();
                if seq.first_scheduled.is_none() {
                    seq.first_scheduled = Some(now);
                    out.started.push(id);
                }
                seq.status = RequestStatus::Running;
                self.running.push(id);
                out.num_scheduled_tokens.push((id, n));
                budget -= n;
            }
        }

        // The step itself.
        for &(id, n) in &out.num_scheduled_tokens {
            let Some(seq) = self.seqs.get_mut(&id) else {
                continue;
            };
            let end = seq.num_computed + n;
            let cached_prefix = if seq.on_node {
                Vec::new()
            } else {
                seq.tokens[..seq.num_computed].to_vec()
            };
            seq.on_node = true;
            let sample = (end == seq.tokens.len()).then(|| {
                let mut sample = seq.params.sample.clone();
                if let Some(constraint) = &seq.params.constraint {
                    let allowed = AllowedTokens::pending();
                    out.mask_jobs.push(MaskJob {
                        constraint: constraint.clone(),
                        allowed: allowed.clone(),
                    });
                    sample.allowed = Some(allowed);
                }
                sample
            });
            let prompt_logprobs = match seq.params.prompt_logprobs {
                Some(top) if seq.scores_prompt() => PromptScoring::for_chunk(
                    &seq.tokens[..seq.prompt_len],
                    seq.num_computed,
                    n,
                    top,
                ),
                _ => None,
            };
            out.batch.entries.push(StepEntry {
                seq: id,
                tokens: seq.tokens[seq.num_computed..end].to_vec(),
                start: seq.num_computed,
                prompt_len: seq.prompt_len,
                block_table: seq.blocks.clone(),
                sample,
                cached_prefix,
                prompt_logprobs,
            });
        }
        out.freed = self.take_freed();
        out
    }

    /// Applies a step's results: advances every scheduled request, appends sampled tokens,
    /// finishes requests that hit a stop token, `max_tokens` or `max_model_len`, and frees them.
    ///
    /// A scheduled request that asked for a token and got none, or got one its grammar
    /// refuses, fails; it is returned in the second list with why (and freed) so the caller
    /// can report it.
    pub fn update_from_output(
        &mut self,
        scheduled: &SchedulerOutput,
        output: &StepOutput,
        now: Instant,
    ) -> (Vec<TokenOutput>, Vec<(RequestId, SequenceFailure)>) {
        let sampled: HashMap<u64, &step::SampledToken> =
            output.sampled.iter().map(|s| (s.seq, s)).collect();
        let mut scored: HashMap<u64, &step::PromptLogprobs> =
            output.prompt_logprobs.iter().map(|p| (p.seq, p)).collect();
        let mut tokens = Vec::new();
        let mut failed = Vec::new();
        self.stats.steps_total += 1;
        self.stats.last_step_tokens = scheduled.total_tokens();
        for (entry, &(id, n)) in scheduled
            .batch
            .entries
            .iter()
            .zip(&scheduled.num_scheduled_tokens)
        {
            let Some(seq) = self.seqs.get_mut(&id) else {
                continue; // aborted since it was scheduled
            };
            seq.num_computed += n;
            self.stats.computed_tokens_total += n as u64;
            let answered = sampled.get(&id);
            if entry.sample.is_some() && answered.is_none() {
                failed.push((id, SequenceFailure::NoToken));
                continue;
            }
            if let Some(asked) = &entry.prompt_logprobs {
                let answer = scored.remove(&id);
                let got = answer.map_or(0, |p| p.tokens.len());
                if got != asked.next.len() {
                    failed.push((
                        id,
                        SequenceFailure::PromptLogprobs {
                            asked: asked.next.len(),
                            got,
                        },
                    ));
                    continue;
                }
                if let Some(p) = answer {
                    seq.prompt_scores.extend(p.tokens.iter().cloned());
                }
            }
            self.blocks.cache_full_blocks(
                &seq.blocks,
                &seq.tokens[..seq.num_computed],
                &mut seq.block_hashes,
            );
            let Some(s) = answered else {
                continue;
            };
            if let Some(constraint) = &seq.params.constraint
                && let Err(e) = constraint.0.accept(s.token)
            {
                failed.push((id, SequenceFailure::Constraint(e)));
                continue;
            }
            let prompt_logprobs = seq
                .scores_prompt()
                .then(|| std::mem::take(&mut seq.prompt_scores));
            if seq.num_output() == 0 {
                self.stats.prompt_tokens_total += seq.prompt_len as u64;
            }
            seq.tokens.push(s.token);
            self.stats.generation_tokens_total += 1;
            let finish = if seq.params.stop_token_ids.contains(&s.token) {
                Some(FinishReason::StopToken(s.token))
            } else if seq.num_output() >= seq.params.max_tokens
                || seq.tokens.len() >= self.config.max_model_len
            {
                Some(FinishReason::Length)
            } else {
                None
            };
            tokens.push(TokenOutput {
                id,
                token: s.token,
                logprob: s.logprob,
                top_logprobs: s.top_logprobs.clone(),
                finish,
                first_scheduled: seq.first_scheduled.unwrap_or(now),
                produced_at: now,
                num_preemptions: seq.num_preemptions,
                prompt_logprobs,
            });
            if finish.is_some() {
                self.running.retain(|&r| r != id);
                self.remove(id);
            }
        }
        for (id, _) in &failed {
            self.abort(*id);
        }
        (tokens, failed)
    }

    /// Fails every request in a step (the node returned an error): they are dropped and freed.
    /// The prefix cache is forgotten too: a node that failed a step may have lost its cache
    /// (a restarted remote node), and a wrong hit would be a wrong answer, not an error.
    pub fn fail_step(&mut self, scheduled: &SchedulerOutput) -> Vec<RequestId> {
        self.blocks.reset_prefix_cache();
        let ids: Vec<RequestId> = scheduled
            .num_scheduled_tokens
            .iter()
            .map(|&(id, _)| id)
            .collect();
        for &id in &ids {
            self.abort(id);
        }
        ids
    }

    fn preempt(&mut self, id: RequestId) {
        let Some(seq) = self.seqs.get_mut(&id) else {
            return;
        };
        self.blocks.release(&mut seq.blocks);
        seq.block_hashes.clear();
        seq.num_computed = 0;
        // Its prompt is computed, and scored, again from the start.
        seq.prompt_scores.clear();
        seq.status = RequestStatus::Preempted;
        seq.num_preemptions += 1;
        if std::mem::take(&mut seq.on_node) {
            self.to_free.push(id);
        }
        self.stats.num_preemptions_total += 1;
        self.waiting.push_front(id);
    }

    /// Takes the cached blocks holding the longest run of full blocks at the start of a
    /// sequence that holds no block and has computed nothing, leaving at least its last token to compute. Returns the
    /// tokens they hold (now counted as computed).
    fn take_cached_prefix(blocks: &mut BlockManager, seq: &mut Sequence) -> usize {
        debug_assert!(seq.blocks.is_empty() && seq.num_computed == 0);
        let Some(last) = seq.tokens.len().checked_sub(1) else {
            return 0;
        };
        let hits = blocks.find_cached_prefix(&seq.tokens[..last]);
        blocks.share(&mut seq.blocks, &hits);
        seq.block_hashes = hits.iter().map(|&(_, hash)| hash).collect();
        seq.num_computed = hits.len() * blocks.block_size();
        seq.num_computed
    }

    /// Forgets a request that is in neither queue any more.
    fn remove(&mut self, id: RequestId) {
        if let Some(mut seq) = self.seqs.remove(&id) {
            self.blocks.release(&mut seq.blocks);
            if seq.on_node {
                self.to_free.push(id);
            }
        }
    }
}
