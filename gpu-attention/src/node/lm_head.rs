//! The sharded LM head: normed rows out to every card holding vocabulary rows, proposals back,
//! merged exactly ([`crate::merge`]); rows the proposals cannot decide get a second round
//! that gathers every logit. Scored rows (prompt logprobs) ride the same messages: the card
//! holding each one's prompt token returns its logit ([`crate::merge::score_row`]). A
//! constrained row (structured output) waits for its mask only at the merge, so the router
//! computes it while the step runs.

use std::collections::HashMap;

use proto::data::{self, Immediate, LM_HEAD_LAYER, Proposal, RowSampling};

use super::DisaggregatedNode;
use super::pipeline::MicroBatch;
use crate::merge::{
    MergeOutcome, candidates_needed, merge_constrained_row, merge_row, score_candidates_needed,
    score_full_row, score_row,
};
use crate::sampler::sample_row;
use step::{
    InvalidStep, ModelFailure, PromptLogprobs, SampleRequest, SampledToken, ScoredToken, StepBatch,
    StepEntry, StepError, StepOutput,
};

/// Immediate layer code of the full-logits round (distinct from the proposals round).
const FULL_LOGITS_LAYER: u16 = LM_HEAD_LAYER - 1;

/// A row through the LM head.
struct Row {
    /// Entry index in the batch.
    entry: usize,
    kind: RowKind,
    position: u64,
}

/// What a row asks of the LM head.
enum RowKind {
    /// Sample the entry's next token.
    Sample(SampleRequest),
    /// Score a prompt token (prompt logprobs).
    Score { target: u32, top_logprobs: usize },
}

/// Rows an entry sends through the LM head: its scored prompt tokens, then its sample.
pub(super) fn lm_rows(e: &StepEntry) -> usize {
    e.prompt_logprobs.as_ref().map_or(0, |p| p.next.len()) + usize::from(e.sample.is_some())
}

/// One micro-batch's rows on their way through the LM head.
pub(super) struct LmHeadRows {
    rows: Vec<Row>,
    /// Their normed hidden states, `[rows, hidden]`.
    normed: Vec<f32>,
    /// Candidates per card asked for.
    candidates: usize,
}

impl DisaggregatedNode {
    /// The cards holding vocabulary rows that are up (the node covers the others' rows).
    fn lm_cards(&self) -> Vec<usize> {
        (0..self.layout.lm_head.len())
            .filter(|&c| !self.layout.lm_head[c].is_empty() && !self.active.down.contains(&c))
            .collect()
    }

    /// Sends the sampled rows of the micro-batches `mbs` to the LM-head cards, as message
    /// `m`.
    pub(super) fn lm_head_send(
        &mut self,
        batch: &StepBatch,
        mbs: &[MicroBatch],
        m: u8,
    ) -> Result<LmHeadRows, StepError> {
        let lm_cards = self.lm_cards();
        let cap = self.node.lm_head_candidates;
        let span = self.trace.begin();
        let mut rows = Vec::new();
        let mut normed = Vec::new();
        for mb in mbs {
            let mut last_rows = Vec::new();
            for (span_idx, &i) in mb.entries.iter().enumerate() {
                let e = &batch.entries[i];
                let s = &mb.spans[span_idx];
                if let Some(p) = &e.prompt_logprobs {
                    for (j, &target) in p.next.iter().enumerate() {
                        last_rows.push(s.start + j);
                        rows.push(Row {
                            entry: i,
                            kind: RowKind::Score {
                                target,
                                top_logprobs: p.top_logprobs,
                            },
                            position: (e.start + j + 1) as u64,
                        });
                    }
                }
                if let Some(request) = &e.sample {
                    last_rows.push(s.start + s.len - 1);
                    rows.push(Row {
                        entry: i,
                        kind: RowKind::Sample(request.clone()),
                        position: (e.start + e.tokens.len()) as u64,
                    });
                }
            }
            if !last_rows.is_empty() {
                normed.extend(self.compute.final_rows(mb, &last_rows)?);
            }
        }
        if rows.is_empty() {
            return Ok(LmHeadRows {
                rows,
                normed: Vec::new(),
                candidates: 0,
            });
        }
        // As few as the rows need: a greedy row without logprobs needs one, not `cap`.
        let k = rows
            .iter()
            .map(|r| match &r.kind {
                RowKind::Sample(request) => candidates_needed(request, cap),
                RowKind::Score { top_logprobs, .. } => score_candidates_needed(*top_logprobs, cap),
            })
            .max()
            .unwrap_or(1);
        let sampling: Vec<RowSampling> = rows.iter().map(row_sampling).collect();
        // With an LM-head card down, every row takes the full-logits round (its rows come
        // from the node), so no proposals are asked for.
        if self.lm_cards_down().is_empty() {
            self.send_lm_head(&lm_cards, m, LM_HEAD_LAYER, &normed, &sampling, k)?;
        }
        self.trace
            .end(span, "lm-head send", usize::from(LM_HEAD_LAYER), m);
        Ok(LmHeadRows {
            rows,
            normed,
            candidates: k,
        })
    }

    /// Merges the proposals for the rows of every message sent by [`Self::lm_head_send`]
    /// (`per_mb[m]` went as message `m`), with the full-logits round for rows they cannot
    /// decide.
    pub(super) fn lm_head_merge(
        &mut self,
        batch: &StepBatch,
        per_mb: &[LmHeadRows],
        stash: &mut HashMap<(usize, u8, usize), Vec<u8>>,
    ) -> Result<StepOutput, StepError> {
        let lm_cards = self.lm_cards();
        let hidden = self.config.hidden_size;
        let mut sampled: HashMap<usize, SampledToken> = HashMap::new();
        let mut scored: HashMap<usize, ScoredRows> = HashMap::new();
        for (m, sent) in per_mb.iter().enumerate() {
            let (rows, normed, k) = (&sent.rows, &sent.normed, sent.candidates);
            if rows.is_empty() {
                continue;
            }
            let span = self.trace.begin();
            let degraded = !self.lm_cards_down().is_empty();
            let proposals = if degraded {
                Vec::new()
            } else {
                self.proposals(&lm_cards, m as u8, LM_HEAD_LAYER, rows.len(), stash)?
            };
            let mut fallback = Vec::new();
            for (r, row) in rows.iter().enumerate() {
                let props: Vec<Proposal> = proposals.iter().map(|p| p[r].clone()).collect();
                let seq = batch.entries[row.entry].seq;
                if self.collect_logits || degraded {
                    fallback.push(r);
                    continue;
                }
                let request = match &row.kind {
                    RowKind::Sample(request) => request,
                    &RowKind::Score {
                        target,
                        top_logprobs,
                    } => {
                        match score_row(&props, target, top_logprobs, k) {
                            Some(t) => scored.entry(row.entry).or_default().put(r, t),
                            None => fallback.push(r),
                        }
                        continue;
                    }
                };
                // A constrained row's mask is waited for only now, after the forward pass and
                // the cards' proposals: the router computed it meanwhile.
                let outcome = match request.allowed_mask(seq)? {
                    Some(mask) => merge_constrained_row(&props, request, &mask, k),
                    None => merge_row(&props, request, row.position, k),
                };
                match outcome {
                    MergeOutcome::Done(t) => {
                        sampled.insert(
                            row.entry,
                            SampledToken {
                                seq,
                                token: t.token,
                                logprob: t.logprob,
                                top_logprobs: t.top_logprobs,
                            },
                        );
                    }
                    MergeOutcome::NeedFullLogits => fallback.push(r),
                }
            }
            self.trace
                .end(span, "lm-head merge", usize::from(LM_HEAD_LAYER), m as u8);
            if !fallback.is_empty() {
                let span = self.trace.begin();
                self.full_logits(
                    batch,
                    rows,
                    normed,
                    &fallback,
                    &lm_cards,
                    hidden,
                    &mut Answers {
                        sampled: &mut sampled,
                        scored: &mut scored,
                    },
                    stash,
                )?;
                self.trace.end(
                    span,
                    "lm-head full logits",
                    usize::from(LM_HEAD_LAYER),
                    m as u8,
                );
            }
        }
        let mut out = StepOutput::default();
        for (i, e) in batch.entries.iter().enumerate() {
            if e.sample.is_some() {
                let t = sampled
                    .remove(&i)
                    .ok_or_else(|| StepError::from(ModelFailure::NoToken { seq: e.seq }))?;
                out.sampled.push(t);
            }
            if let Some(p) = &e.prompt_logprobs {
                let tokens = scored.remove(&i).map(ScoredRows::into_tokens);
                match tokens {
                    Some(tokens) if tokens.len() == p.next.len() => {
                        out.prompt_logprobs
                            .push(PromptLogprobs { seq: e.seq, tokens });
                    }
                    _ => {
                        return Err(ModelFailure::Unscored { seq: e.seq }.into());
                    }
                }
            }
        }
        Ok(out)
    }

    fn send_lm_head(
        &mut self,
        cards: &[usize],
        m: u8,
        layer: u16,
        normed: &[f32],
        sampling: &[RowSampling],
        candidates: usize,
    ) -> Result<(), StepError> {
        let meta = data::MessageMeta {
            step: self.step_counter,
            layer,
            micro_batch: m,
            dtype: self.node.wire_dtype,
            shard: self.shard_version,
        };
        let mut msg = Vec::new();
        data::encode_lm_head_dispatch(
            meta,
            self.config.hidden_size,
            normed,
            sampling,
            candidates,
            &mut msg,
        );
        let immediate = Immediate {
            step: self.step_counter,
            layer,
            micro_batch: m,
        };
        for &c in cards {
            self.send_to(c, m, msg.clone(), immediate)?;
        }
        Ok(())
    }

    /// Every LM card's proposals for (layer code, micro-batch), `[card][row]`.
    fn proposals(
        &mut self,
        cards: &[usize],
        m: u8,
        layer: u16,
        rows: usize,
        stash: &mut HashMap<(usize, u8, usize), Vec<u8>>,
    ) -> Result<Vec<Vec<Proposal>>, StepError> {
        let replies = self.collect(layer, m, cards, stash)?;
        cards
            .iter()
            .zip(replies)
            .map(|(&card, bytes)| {
                let (_, p) = data::decode_proposals(&bytes).map_err(|e| StepError::Card {
                    card,
                    message: format!("bad LM-head proposals: {e}"),
                })?;
                if p.len() != rows {
                    return Err(StepError::Card {
                        card,
                        message: format!("{} proposals for {rows} rows", p.len()),
                    });
                }
                Ok(p)
            })
            .collect()
    }

    /// Gathers every logit of the given rows and samples them as the reference does.
    #[allow(clippy::too_many_arguments)]
    fn full_logits(
        &mut self,
        batch: &StepBatch,
        rows: &[Row],
        normed: &[f32],
        which: &[usize],
        cards: &[usize],
        hidden: usize,
        answers: &mut Answers<'_>,
        stash: &mut HashMap<(usize, u8, usize), Vec<u8>>,
    ) -> Result<(), StepError> {
        let vocab = self.config.vocab_size;
        let shard = self.layout.largest_shard();
        let reply_room = super::slot_sizes(&self.config, &self.node, &self.layout).reply
            - proto::data::HEADER_LEN;
        let per_message = (reply_room / proto::data::proposal_len(shard)).max(1);
        for group in which.chunks(per_message) {
            let mut sel = Vec::with_capacity(group.len() * hidden);
            let mut sampling = Vec::with_capacity(group.len());
            for &r in group {
                sel.extend_from_slice(&normed[r * hidden..(r + 1) * hidden]);
                sampling.push(row_sampling(&rows[r]));
            }
            self.send_lm_head(
                cards,
                0,
                super::lm_head::FULL_LOGITS_LAYER,
                &sel,
                &sampling,
                shard,
            )?;
            let proposals = self.proposals(cards, 0, FULL_LOGITS_LAYER, group.len(), stash)?;
            let mut group_logits = vec![vec![f32::NEG_INFINITY; vocab]; group.len()];
            self.node_lm_rows(&sel, group.len(), &mut group_logits);
            let from_node: usize = self
                .lm_cards_down()
                .iter()
                .map(|&c| self.layout.lm_head[c].len())
                .sum();
            for (g, &r) in group.iter().enumerate() {
                let mut logits = std::mem::take(&mut group_logits[g]);
                let mut filled = from_node;
                for p in &proposals {
                    for c in &p[g].candidates {
                        if let Some(slot) = logits.get_mut(c.token as usize) {
                            *slot = c.logit;
                            filled += 1;
                        }
                    }
                }
                if filled != vocab {
                    return Err(ModelFailure::PartialLogits { filled, vocab }.into());
                }
                let row = &rows[r];
                let entry = &batch.entries[row.entry];
                self.stats.full_logits_rows += 1;
                let request = match &row.kind {
                    RowKind::Sample(request) => request,
                    &RowKind::Score {
                        target,
                        top_logprobs,
                    } => {
                        let t = score_full_row(&logits, target, top_logprobs).ok_or(
                            InvalidStep::TokenOutOfRange {
                                token: target,
                                vocab,
                            },
                        )?;
                        answers.scored.entry(row.entry).or_default().put(r, t);
                        continue;
                    }
                };
                if self.collect_logits {
                    self.logits.push((entry.seq, logits.clone()));
                }
                let history = self.histories.entry(entry.seq).or_default();
                answers.sampled.insert(
                    row.entry,
                    sample_row(entry.seq, &logits, request, history, row.position)?,
                );
            }
        }
        Ok(())
    }
}

/// Where the full-logits round puts what it decides.
struct Answers<'a> {
    sampled: &'a mut HashMap<usize, SampledToken>,
    scored: &'a mut HashMap<usize, ScoredRows>,
}

/// One entry's scored rows as they are decided (from proposals or gathered), by row index.
#[derive(Default)]
struct ScoredRows(Vec<(usize, ScoredToken)>);

impl ScoredRows {
    fn put(&mut self, row: usize, t: ScoredToken) {
        self.0.push((row, t));
    }

    /// The scores in row order, which is the order of the entry's prompt tokens.
    fn into_tokens(mut self) -> Vec<ScoredToken> {
        self.0.sort_by_key(|&(r, _)| r);
        self.0.into_iter().map(|(_, t)| t).collect()
    }
}

fn row_sampling(row: &Row) -> RowSampling {
    match &row.kind {
        RowKind::Sample(request) => {
            let p = &request.params;
            RowSampling {
                temperature: if p.is_greedy() { 0.0 } else { p.temperature },
                seed: p.seed,
                position: row.position,
                logprobs: request.wants_logprobs(),
                filtered: !p.is_greedy() && p.has_filters(),
                target: None,
            }
        }
        // Greedy (no draw), with the shard's log-sum-exp and the target's logit.
        &RowKind::Score { target, .. } => RowSampling {
            temperature: 0.0,
            seed: 0,
            position: row.position,
            logprobs: true,
            filtered: false,
            target: Some(target),
        },
    }
}
