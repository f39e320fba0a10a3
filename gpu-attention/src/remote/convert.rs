//! Step batches, outputs and node health to and from their wire form.

use model::sampling::SamplingParams;
use proto::control as pb;
use step::{
    AllowedTokens, CardHealth, CardState, InvalidStep, NodeHealth, Penalties, PromptLogprobs,
    PromptScoring, SampleRequest, SampledToken, ScoredToken, SeqId, StepBatch, StepEntry,
    StepError, StepOutput, TokenMask,
};

/// Wire form of a batch. A constrained row's mask is waited for here (up to
/// [`step::constraint::MASK_WAIT`]), since the remote node cannot wait on this process's
/// handle: the mask then crosses the wire with the row, and a mask that never came fails the
/// step before it is sent.
pub fn batch_to_pb(batch: &StepBatch) -> Result<pb::StepRequest, StepError> {
    let mut entries = Vec::with_capacity(batch.entries.len());
    for e in &batch.entries {
        let sample = match &e.sample {
            None => None,
            Some(s) => Some(sample_to_pb(e.seq, s)?),
        };
        entries.push(pb::StepEntry {
            seq: e.seq,
            tokens: e.tokens.clone(),
            start: e.start as u32,
            prompt_len: e.prompt_len as u32,
            block_table: e.block_table.clone(),
            sample,
            cached_prefix: e.cached_prefix.clone(),
            prompt_logprobs: e.prompt_logprobs.as_ref().map(|p| pb::PromptScoring {
                next: p.next.clone(),
                top_logprobs: p.top_logprobs as u32,
            }),
        });
    }
    Ok(pb::StepRequest { entries })
}

fn sample_to_pb(seq: SeqId, s: &SampleRequest) -> Result<pb::SamplingParams, StepError> {
    let mask = s.allowed_mask(seq)?;
    Ok(pb::SamplingParams {
        temperature: s.params.temperature,
        top_p: s.params.top_p,
        top_k: s.params.top_k as u32,
        min_p: s.params.min_p,
        seed: s.params.seed,
        presence_penalty: s.penalties.presence,
        frequency_penalty: s.penalties.frequency,
        repetition_penalty: s.penalties.repetition,
        top_logprobs: s.top_logprobs as u32,
        logprobs: s.logprobs,
        allowed_mask: mask
            .as_ref()
            .map(|m| m.words().iter().flat_map(|w| w.to_le_bytes()).collect()),
        allowed_len: mask.as_ref().map_or(0, |m| m.len() as u32),
    })
}

/// A batch from its wire form; a malformed mask (not `ceil(allowed_len / 64)` 64-bit words) is
/// refused as an invalid step.
pub fn batch_from_pb(request: pb::StepRequest) -> Result<StepBatch, StepError> {
    let mut entries = Vec::with_capacity(request.entries.len());
    for e in request.entries {
        let sample = match e.sample {
            None => None,
            Some(s) => Some(sample_from_pb(e.seq, s)?),
        };
        entries.push(StepEntry {
            seq: e.seq,
            tokens: e.tokens,
            start: e.start as usize,
            prompt_len: e.prompt_len as usize,
            block_table: e.block_table,
            sample,
            cached_prefix: e.cached_prefix,
            prompt_logprobs: e.prompt_logprobs.map(|p| PromptScoring {
                next: p.next,
                top_logprobs: p.top_logprobs as usize,
            }),
        });
    }
    Ok(StepBatch { entries })
}

fn sample_from_pb(seq: SeqId, s: pb::SamplingParams) -> Result<SampleRequest, StepError> {
    let allowed = match s.allowed_mask {
        None => None,
        Some(bytes) => {
            let len = s.allowed_len as usize;
            let expected = len.div_ceil(64) * 8;
            if bytes.len() != expected {
                return Err(InvalidStep::MalformedMask {
                    seq,
                    tokens: len,
                    expected,
                    bytes: bytes.len(),
                }
                .into());
            }
            let words: Vec<u64> = bytes
                .chunks_exact(8)
                .map(|c| {
                    let mut w = [0u8; 8];
                    w.copy_from_slice(c);
                    u64::from_le_bytes(w)
                })
                .collect();
            Some(AllowedTokens::ready(TokenMask::from_words(len, &words)))
        }
    };
    Ok(SampleRequest {
        params: SamplingParams {
            temperature: s.temperature,
            top_p: s.top_p,
            top_k: s.top_k as usize,
            min_p: s.min_p,
            seed: s.seed,
        },
        penalties: Penalties {
            presence: s.presence_penalty,
            frequency: s.frequency_penalty,
            repetition: s.repetition_penalty,
        },
        logprobs: s.logprobs,
        top_logprobs: s.top_logprobs as usize,
        allowed,
    })
}

/// Wire form of an output.
pub fn output_to_pb(out: StepOutput) -> pb::StepReply {
    pb::StepReply {
        sampled: out
            .sampled
            .into_iter()
            .map(|t| pb::SampledToken {
                seq: t.seq,
                token: t.token,
                logprob: t.logprob,
                top_logprobs: alternatives_to_pb(t.top_logprobs),
            })
            .collect(),
        prompt_logprobs: out
            .prompt_logprobs
            .into_iter()
            .map(|p| pb::PromptLogprobs {
                seq: p.seq,
                tokens: p
                    .tokens
                    .into_iter()
                    .map(|t| pb::ScoredToken {
                        token: t.token,
                        logprob: t.logprob,
                        top_logprobs: alternatives_to_pb(t.top_logprobs),
                    })
                    .collect(),
            })
            .collect(),
    }
}

/// Wire form of a token's most likely alternatives.
fn alternatives_to_pb(alternatives: Vec<(u32, f32)>) -> Vec<pb::TokenLogprob> {
    alternatives
        .into_iter()
        .map(|(token, logprob)| pb::TokenLogprob { token, logprob })
        .collect()
}

/// A token's most likely alternatives from their wire form.
fn alternatives_from_pb(alternatives: Vec<pb::TokenLogprob>) -> Vec<(u32, f32)> {
    alternatives
        .into_iter()
        .map(|l| (l.token, l.logprob))
        .collect()
}

/// Wire form of a node's view of its cards.
pub fn health_to_pb(health: &NodeHealth) -> pb::HealthReply {
    pb::HealthReply {
        ready: health.unserved.is_none(),
        status: match &health.unserved {
            Some(why) => why.clone(),
            None if health.not_up().next().is_some() => {
                "serving, with cards down that replicas cover".into()
            }
            None => "serving".into(),
        },
        cards: health
            .cards
            .iter()
            .map(|c| pb::CardHealth {
                card: c.card as u32,
                state: c.state.as_str().into(),
                reason: c.reason.clone(),
                for_seconds: c.for_seconds,
                failures: c.failures,
                rejoins: c.rejoins,
            })
            .collect(),
        unserved: health.unserved.clone().unwrap_or_default(),
        ..pb::HealthReply::default()
    }
}

/// A node's view of its cards from its wire form.
pub fn health_from_pb(reply: &pb::HealthReply) -> NodeHealth {
    NodeHealth {
        cards: reply
            .cards
            .iter()
            .map(|c| CardHealth {
                card: c.card as usize,
                state: c.state.parse().unwrap_or(CardState::Down),
                reason: c.reason.clone(),
                for_seconds: c.for_seconds,
                failures: c.failures,
                rejoins: c.rejoins,
            })
            .collect(),
        unserved: (!reply.ready).then(|| {
            if reply.unserved.is_empty() {
                reply.status.clone()
            } else {
                reply.unserved.clone()
            }
        }),
    }
}

/// An output from its wire form.
pub fn output_from_pb(reply: pb::StepReply) -> StepOutput {
    StepOutput {
        sampled: reply
            .sampled
            .into_iter()
            .map(|t| SampledToken {
                seq: t.seq,
                token: t.token,
                logprob: t.logprob,
                top_logprobs: alternatives_from_pb(t.top_logprobs),
            })
            .collect(),
        prompt_logprobs: reply
            .prompt_logprobs
            .into_iter()
            .map(|p| PromptLogprobs {
                seq: p.seq,
                tokens: p
                    .tokens
                    .into_iter()
                    .map(|t| ScoredToken {
                        token: t.token,
                        logprob: t.logprob,
                        top_logprobs: alternatives_from_pb(t.top_logprobs),
                    })
                    .collect(),
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use step::ModelFailure;

    fn entry(seq: SeqId, sample: Option<SampleRequest>) -> StepEntry {
        StepEntry {
            seq,
            tokens: vec![1, 2, 3],
            start: 4,
            prompt_len: 6,
            block_table: vec![0, 1],
            sample,
            cached_prefix: Vec::new(),
            prompt_logprobs: None,
        }
    }

    fn sample(allowed: Option<AllowedTokens>) -> SampleRequest {
        SampleRequest {
            params: SamplingParams {
                temperature: 0.7,
                top_p: 0.9,
                top_k: 5,
                min_p: 0.1,
                seed: 42,
            },
            penalties: Penalties {
                presence: 0.1,
                frequency: 0.2,
                repetition: 1.1,
            },
            logprobs: true,
            top_logprobs: 3,
            allowed,
        }
    }

    /// A batch crosses the wire whole: every field, and a constrained row's mask (as
    /// `ceil(len / 64)` little-endian words) arrives filled, the same tokens over the same
    /// ids; rows without a mask arrive without one.
    #[test]
    fn a_batch_with_masks_round_trips() {
        let mask = TokenMask::from_tokens(130, [0, 63, 64, 100, 129]);
        let batch = StepBatch {
            entries: vec![
                entry(1, Some(sample(None))),
                entry(2, Some(sample(Some(AllowedTokens::ready(mask.clone()))))),
                entry(3, None),
            ],
        };
        let wire = batch_to_pb(&batch).unwrap();
        let constrained = wire.entries[1].sample.as_ref().unwrap();
        assert_eq!(constrained.allowed_len, 130);
        assert_eq!(constrained.allowed_mask.as_ref().map(Vec::len), Some(24));
        assert_eq!(wire.entries[0].sample.as_ref().unwrap().allowed_mask, None);
        let back = batch_from_pb(wire).unwrap();
        assert_eq!(back.entries.len(), 3);
        for (a, b) in batch.entries.iter().zip(&back.entries) {
            assert_eq!(
                (a.seq, &a.tokens, a.start, a.prompt_len, &a.block_table),
                (b.seq, &b.tokens, b.start, b.prompt_len, &b.block_table)
            );
            assert_eq!(a.sample.is_some(), b.sample.is_some());
            if let (Some(x), Some(y)) = (&a.sample, &b.sample) {
                assert_eq!(
                    (x.params, x.penalties, x.logprobs, x.top_logprobs),
                    (y.params, y.penalties, y.logprobs, y.top_logprobs)
                );
                assert_eq!(x.allowed.is_some(), y.allowed.is_some());
            }
        }
        let arrived = back.entries[1]
            .sample
            .as_ref()
            .unwrap()
            .allowed
            .as_ref()
            .unwrap();
        assert_eq!(*arrived.wait(Duration::ZERO).unwrap(), mask);
    }

    /// A mask of the wrong byte length is refused as an invalid step, naming the sequence; a
    /// mask that never came fails the step on the sending side.
    #[test]
    fn malformed_and_failed_masks_are_refused() {
        let batch = StepBatch {
            entries: vec![entry(
                7,
                Some(sample(Some(AllowedTokens::ready(TokenMask::all(70))))),
            )],
        };
        let mut wire = batch_to_pb(&batch).unwrap();
        if let Some(s) = wire.entries[0].sample.as_mut() {
            s.allowed_mask.as_mut().unwrap().pop();
        }
        let err = batch_from_pb(wire).unwrap_err();
        assert!(
            matches!(
                &err,
                StepError::Invalid(InvalidStep::MalformedMask {
                    seq: 7,
                    expected: 16,
                    ..
                })
            ),
            "{err}"
        );
        let failed = AllowedTokens::pending();
        failed.fill(Err("no grammar".into()));
        let batch = StepBatch {
            entries: vec![entry(8, Some(sample(Some(failed))))],
        };
        let err = batch_to_pb(&batch).unwrap_err();
        assert!(
            matches!(&err, StepError::Model(ModelFailure::Mask { reason, .. }) if reason.contains("no grammar")),
            "{err}"
        );
    }

    /// Prompt scoring crosses the wire with its entry, and prompt logprobs with the output,
    /// every field in order; entries and outputs without them arrive without.
    #[test]
    fn prompt_scoring_and_prompt_logprobs_round_trip() {
        let mut scored = entry(4, None);
        scored.prompt_logprobs = Some(PromptScoring {
            next: vec![2, 3],
            top_logprobs: 5,
        });
        let batch = StepBatch {
            entries: vec![scored, entry(5, Some(sample(None)))],
        };
        let back = batch_from_pb(batch_to_pb(&batch).unwrap()).unwrap();
        assert_eq!(
            back.entries[0].prompt_logprobs,
            batch.entries[0].prompt_logprobs
        );
        assert_eq!(back.entries[1].prompt_logprobs, None);
        let out = StepOutput {
            sampled: vec![SampledToken {
                seq: 5,
                token: 9,
                logprob: -0.5,
                top_logprobs: vec![(9, -0.5)],
            }],
            prompt_logprobs: vec![PromptLogprobs {
                seq: 4,
                tokens: vec![
                    ScoredToken {
                        token: 2,
                        logprob: -1.25,
                        top_logprobs: vec![(7, -0.1), (2, -1.25)],
                    },
                    ScoredToken {
                        token: 3,
                        logprob: -7.0,
                        top_logprobs: vec![],
                    },
                ],
            }],
        };
        assert_eq!(output_from_pb(output_to_pb(out.clone())), out);
    }
}
