//! The data-plane loop of one (card, attention node) pair: wait for a message to land in the
//! inbox, decode it in place, run the card, write the reply into the node's region.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use jetstream::{EndpointRuntime, Region, RegionDescriptor, Transport, WriteRequest};
use proto::data::{self, Candidate, Immediate, Kind, LM_HEAD_LAYER, MessageMeta, Proposal, Winner};

use super::cpu_turns::TurnMember;
use super::shards::{Shard, ShardTable, count_message, timed};
use super::spans::{CardSpan, SpanLog, ThreadUsage};
use crate::executor::Slot;
use crate::lm_head::{LmProposal, RowSampling};

/// Micro-batch slots per inbox and per reply region (as the attention node lays them out).
pub(crate) const SLOTS: usize = 2;

/// How often a worker checks whether it should stop.
const POLL: Duration = Duration::from_millis(200);

/// Whether a message waits for its turn on the shared CPUs. Turns keep the layers' messages of
/// two micro-batches in landing order; the LM head's message is a step's last, with no other
/// micro-batch's behind it, and handing turns round the cards' shards of it only adds wakeups
/// (GPT-OSS-20B on 8 cards: 27.4 against 30.2 ms for the LM head, medians of 8 runs each).
fn takes_turn(immediate: &Immediate) -> bool {
    immediate.layer != LM_HEAD_LAYER
}

pub(crate) struct Worker {
    pub card_index: usize,
    /// The card's shard versions: each message names the one it is for.
    pub shards: Arc<ShardTable>,
    /// Row dtype of replies (every version shares it).
    pub wire_dtype: proto::data::WireDtype,
    pub inbox: Region,
    pub reply: RegionDescriptor,
    pub reply_slot: usize,
    pub transport: Arc<dyn Transport>,
    /// The card endpoint's runtime: this thread drives it while it waits for a message and
    /// while it sends a reply, so packets need no other thread.
    pub runtime: Arc<EndpointRuntime>,
    pub stop: Arc<AtomicBool>,
    /// This worker's place among the cards sharing its CPUs, if any.
    pub turns: Option<TurnMember>,
    /// Where each message's span goes, when tracing is on.
    pub spans: Option<Arc<SpanLog>>,
}

impl Worker {
    pub fn run(self) {
        while !self.stop.load(Ordering::SeqCst) {
            let completion = match self
                .runtime
                .block_on(self.inbox.next_completion_timeout(POLL))
            {
                Ok(c) => c,
                Err(jetstream::Error::Timeout { .. }) => continue,
                Err(e) => {
                    tracing::info!(card = self.card_index, "inbox closed: {e}");
                    return;
                }
            };
            let immediate = Immediate::unpack(completion.immediate);
            // Where cards share CPUs, wait for this message's turn (see `CpuTurns`).
            let turn = match &self.turns {
                Some(member) if takes_turn(&immediate) => {
                    match member.wait(completion.landed, &self.stop) {
                        Some(turn) => Some(turn),
                        None => return,
                    }
                }
                Some(member) => {
                    member.pass();
                    None
                }
                None => None,
            };
            // Only a traced run reads the clock for its spans.
            let started = self
                .spans
                .as_ref()
                .map(|_| (Instant::now(), ThreadUsage::now()));
            // Decode under the view, then release it before computing so the other
            // micro-batch's message can land meanwhile.
            let decoded = match self.inbox.read_blocking(completion.range()) {
                Ok(view) => {
                    count_message(self.shards.counters(), view.len());
                    self.decode(&view)
                }
                Err(e) => Err(format!("cannot read the inbox: {e}")),
            };
            let shard_version = decoded.as_ref().map_or(0, |r| r.meta.shard);
            let reply = decoded.and_then(|r| self.compute(r));
            if let (Some(log), Some(started)) = (&self.spans, started) {
                log.push(CardSpan {
                    card: self.card_index,
                    step: immediate.step,
                    layer: immediate.layer,
                    micro_batch: immediate.micro_batch,
                    landed: completion.landed,
                    started: started.0,
                    ended: Instant::now(),
                    thread: ThreadUsage::now().since(started.1),
                });
            }
            // The reply goes out before the turn is given back: the worker woken for the next
            // turn takes this CPU at once, and would otherwise hold the reply back while it
            // computes.
            self.send_reply(&immediate, completion.immediate, shard_version, reply);
            drop(turn);
        }
    }

    /// Writes a message's reply (or its error) into the node's reply slot.
    fn send_reply(
        &self,
        immediate: &Immediate,
        raw: u64,
        shard: u32,
        reply: Result<Vec<u8>, String>,
    ) {
        let meta = MessageMeta {
            step: immediate.step,
            layer: immediate.layer,
            micro_batch: immediate.micro_batch,
            dtype: self.wire_dtype,
            shard,
        };
        if let Err(message) = &reply {
            tracing::warn!(card = self.card_index, "{message}");
        }
        let bytes = reply_for_slot(meta, self.card_index, reply, self.reply_slot);
        let offset = ((self.card_index * SLOTS + immediate.micro_batch as usize % SLOTS)
            * self.reply_slot) as u64;
        self.shards
            .counters()
            .bytes_out
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        let request = WriteRequest::new(&self.reply, offset, Bytes::from(bytes)).immediate(raw);
        // Flushed, so the reply leaves before the turn is handed on.
        if let Err(e) = self
            .runtime
            .block_on_then_flush(self.transport.post_write(request))
        {
            tracing::warn!(
                card = self.card_index,
                "cannot reply to {}: {e}",
                self.reply.node
            );
        }
    }

    /// Decodes a message into an owned request (so the inbox view can be released before the
    /// card computes).
    fn decode(&self, message: &[u8]) -> Result<Request, String> {
        let h = data::decode_header(message).map_err(|e| e.to_string())?;
        let meta = MessageMeta {
            step: h.step,
            layer: h.layer,
            micro_batch: h.micro_batch,
            dtype: self.wire_dtype,
            shard: h.shard,
        };
        let op = match h.kind {
            Kind::MoeDispatch => {
                let d = data::decode_moe_dispatch(message).map_err(|e| e.to_string())?;
                let (n, k) = (h.tokens as usize, h.slots as usize);
                let mut slots = Vec::with_capacity(n * k);
                for t in 0..n {
                    for s in 0..k {
                        slots.push(Slot {
                            expert: d.expert(t, s),
                            weight: d.weight(t, s),
                        });
                    }
                }
                Op::Moe {
                    rows: d.rows.to_f32(),
                    slots,
                    k,
                }
            }
            Kind::DenseDispatch => {
                let (_, r) =
                    data::decode_rows(message, Kind::DenseDispatch).map_err(|e| e.to_string())?;
                Op::Dense { rows: r.to_f32() }
            }
            Kind::LmHeadDispatch => {
                let d = data::decode_lm_head_dispatch(message).map_err(|e| e.to_string())?;
                let sampling = (0..h.tokens as usize)
                    .map(|t| {
                        let s = d.sampling(t);
                        RowSampling {
                            params: model::sampling::SamplingParams {
                                temperature: s.temperature,
                                seed: s.seed,
                                ..Default::default()
                            },
                            position: s.position,
                            logprobs: s.logprobs,
                            filtered: s.filtered,
                            target: s.target,
                        }
                    })
                    .collect();
                Op::LmHead {
                    rows: d.rows.to_f32(),
                    sampling,
                    wanted: h.slots as usize,
                }
            }
            other => return Err(format!("a card does not accept {other:?} messages")),
        };
        Ok(Request {
            meta,
            layer: h.layer as usize,
            hidden: h.hidden as usize,
            op,
        })
    }

    /// Runs a request on the card and encodes the reply.
    fn compute(&self, request: Request) -> Result<Vec<u8>, String> {
        let version = request.meta.shard;
        let shard = self.shards.get(version).ok_or_else(|| {
            format!(
                "holds no shard version {version} (it holds {:?}): the node and the card \
                 disagree on the expert placement",
                self.shards.versions()
            )
        })?;
        self.compute_on(&shard, request)
    }

    fn compute_on(&self, shard: &Shard, request: Request) -> Result<Vec<u8>, String> {
        let mut card = shard.card.lock().unwrap_or_else(|p| p.into_inner());
        let hidden = card.program().hidden;
        if request.hidden != hidden {
            return Err(format!(
                "rows of width {} for a model of width {hidden}",
                request.hidden
            ));
        }
        let (meta, layer) = (request.meta, request.layer);
        let mut out = Vec::new();
        match request.op {
            Op::Moe { rows, slots, k } => {
                let top_k = card.program().top_k;
                if k != top_k {
                    return Err(format!("{k} slots per row, the model routes to {top_k}"));
                }
                let partial = timed(shard, || card.moe_layer(layer, &rows, &slots))
                    .map_err(|e| e.to_string())?;
                data::encode_rows(Kind::PartialSums, meta, hidden, &partial, &mut out);
            }
            Op::Dense { rows } => {
                let partial =
                    timed(shard, || card.dense_layer(layer, &rows)).map_err(|e| e.to_string())?;
                data::encode_rows(Kind::PartialSums, meta, hidden, &partial, &mut out);
            }
            Op::LmHead {
                rows,
                sampling,
                wanted,
            } => {
                let shard_rows = card.program().assignment.lm_head_rows;
                let width = shard_rows.len();
                let proposals: Vec<Proposal> = if wanted >= width {
                    // Every logit of the shard, as candidates (the full-logits fallback).
                    let logits =
                        timed(shard, || card.lm_head_logits(&rows)).map_err(|e| e.to_string())?;
                    (0..sampling.len())
                        .map(|t| {
                            full_proposal(
                                &logits[t * width..(t + 1) * width],
                                shard_rows.start as u32,
                            )
                        })
                        .collect()
                } else {
                    let props = timed(shard, || card.lm_head_candidates(&rows, &sampling, wanted))
                        .map_err(|e| e.to_string())?;
                    props.into_iter().map(to_wire).collect()
                };
                data::encode_proposals(meta, wanted.min(width), &proposals, &mut out);
            }
        }
        Ok(out)
    }
}

/// A decoded message, owned.
struct Request {
    meta: MessageMeta,
    layer: usize,
    hidden: usize,
    op: Op,
}

/// The bytes to write for a message's reply: the reply when it fits the node's slot, otherwise
/// an error report naming both sizes (cut to the slot), which the node turns into a failed step
/// at once. Dropping it instead left the node waiting its whole reply timeout for bytes that
/// would never come.
fn reply_for_slot(
    meta: MessageMeta,
    card: usize,
    reply: Result<Vec<u8>, String>,
    slot: usize,
) -> Vec<u8> {
    let message = match reply {
        Ok(bytes) if bytes.len() <= slot => return bytes,
        Ok(bytes) => {
            let message = format!(
                "a {}-byte reply exceeds the node's {slot}-byte reply slot (the node and the \
                 card disagree on the step's shapes: run both from the same afd release)",
                bytes.len()
            );
            tracing::error!(card, "{message}");
            message
        }
        Err(message) => message,
    };
    let mut text = format!("card {card}: {message}");
    let room = slot.saturating_sub(data::HEADER_LEN);
    if text.len() > room {
        let mut cut = room;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
    }
    let mut out = Vec::new();
    data::encode_error(meta, &text, &mut out);
    out
}

enum Op {
    Moe {
        rows: Vec<f32>,
        slots: Vec<Slot>,
        k: usize,
    },
    Dense {
        rows: Vec<f32>,
    },
    LmHead {
        rows: Vec<f32>,
        sampling: Vec<RowSampling>,
        wanted: usize,
    },
}

/// A proposal carrying every logit of the shard, best first.
fn full_proposal(logits: &[f32], first: u32) -> Proposal {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    Proposal {
        log_sum_exp: Some(model::sampling::log_sum_exp(logits)),
        scaled_log_sum_exp: None,
        winner: None,
        shard_rows: logits.len() as u32,
        target_logit: None,
        candidates: order
            .into_iter()
            .map(|i| Candidate {
                logit: logits[i],
                token: first + i as u32,
            })
            .collect(),
    }
}

fn to_wire(p: LmProposal) -> Proposal {
    Proposal {
        log_sum_exp: p.log_sum_exp,
        scaled_log_sum_exp: p.scaled_log_sum_exp,
        winner: p.gumbel.map(|g| Winner {
            token: g.token,
            logit: g.logit,
            score: g.score,
        }),
        shard_rows: p.shard_rows,
        target_logit: p.target_logit,
        candidates: p
            .candidates
            .into_iter()
            .map(|c| Candidate {
                logit: c.logit,
                token: c.token,
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_layer_messages_take_turns() {
        let at = |layer| Immediate {
            step: 9,
            layer,
            micro_batch: 1,
        };
        assert!(takes_turn(&at(0)));
        assert!(takes_turn(&at(23)));
        assert!(!takes_turn(&at(LM_HEAD_LAYER)));
    }

    #[test]
    fn a_reply_too_large_for_its_slot_becomes_an_error_the_node_can_read() {
        let meta = MessageMeta {
            step: 4,
            layer: 2,
            micro_batch: 1,
            dtype: data::WireDtype::F32,
            shard: 0,
        };
        // A reply that fits goes out as it is.
        assert_eq!(reply_for_slot(meta, 3, Ok(vec![7; 100]), 100), vec![7; 100]);
        // One byte more: an error report for the same message, cut to the slot.
        for (slot, want) in [
            (100, "card 3: a 101-byte reply exceeds"),
            (data::HEADER_LEN + 5, "card "),
        ] {
            let bytes = reply_for_slot(meta, 3, Ok(vec![7; 101]), slot);
            assert!(
                bytes.len() <= slot,
                "{} bytes in a {slot}-byte slot",
                bytes.len()
            );
            let (h, message) = data::decode_error(&bytes).unwrap();
            assert_eq!((h.step, h.layer, h.micro_batch), (4, 2, 1));
            assert!(message.starts_with(want), "{message}");
        }
        let whole = reply_for_slot(meta, 3, Ok(vec![7; 1000]), 999);
        let (_, message) = data::decode_error(&whole).unwrap();
        assert!(
            message.contains("the node's 999-byte reply slot"),
            "{message}"
        );
        // The card's own error, likewise cut to the slot on a character boundary.
        let bytes = reply_for_slot(meta, 0, Err("é".repeat(100)), data::HEADER_LEN + 12);
        let (_, message) = data::decode_error(&bytes).unwrap();
        assert_eq!(message, "card 0: éé");
    }
}
