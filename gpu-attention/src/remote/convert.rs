//! Step batches, outputs and node health to and from their wire form.

use model::sampling::SamplingParams;
use proto::control as pb;
use step::{
    CardHealth, CardState, NodeHealth, Penalties, SampleRequest, SampledToken, StepBatch,
    StepEntry, StepOutput,
};

/// Wire form of a batch.
pub fn batch_to_pb(batch: &StepBatch) -> pb::StepRequest {
    pb::StepRequest {
        entries: batch
            .entries
            .iter()
            .map(|e| pb::StepEntry {
                seq: e.seq,
                tokens: e.tokens.clone(),
                start: e.start as u32,
                prompt_len: e.prompt_len as u32,
                block_table: e.block_table.clone(),
                sample: e.sample.map(|s| pb::SamplingParams {
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
                }),
                cached_prefix: e.cached_prefix.clone(),
            })
            .collect(),
    }
}

/// A batch from its wire form.
pub fn batch_from_pb(request: pb::StepRequest) -> StepBatch {
    StepBatch {
        entries: request
            .entries
            .into_iter()
            .map(|e| StepEntry {
                seq: e.seq,
                tokens: e.tokens,
                start: e.start as usize,
                prompt_len: e.prompt_len as usize,
                block_table: e.block_table,
                sample: e.sample.map(|s| SampleRequest {
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
                }),
                cached_prefix: e.cached_prefix,
            })
            .collect(),
    }
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
                top_logprobs: t
                    .top_logprobs
                    .into_iter()
                    .map(|(token, logprob)| pb::TokenLogprob { token, logprob })
                    .collect(),
            })
            .collect(),
    }
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
                top_logprobs: t
                    .top_logprobs
                    .into_iter()
                    .map(|l| (l.token, l.logprob))
                    .collect(),
            })
            .collect(),
    }
}
