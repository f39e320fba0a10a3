//! Encoding and checked decoding of the data-plane messages.

use super::{
    Candidate, DecodeError, HEADER_LEN, Header, Kind, MAGIC, PROPOSAL_FIXED_LEN, Proposal,
    ROW_FLAG_FILTERED, ROW_FLAG_LOGPROBS, ROW_FLAG_TARGET, ROW_SAMPLING_LEN, RowSampling, VERSION,
    Winner, WireDtype, proposal_len,
};

/// Step, layer and micro-batch of a message, and its row dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MessageMeta {
    /// Step counter.
    pub step: u64,
    /// Layer or `LM_HEAD_LAYER`.
    pub layer: u16,
    /// Micro-batch.
    pub micro_batch: u8,
    /// Row dtype.
    pub dtype: WireDtype,
    /// Card shard version.
    pub shard: u32,
}

/// Appends the 32-byte header.
pub fn encode_header(h: &Header, out: &mut Vec<u8>) {
    out.extend_from_slice(&MAGIC);
    out.push(VERSION);
    out.push(h.kind.to_byte());
    out.extend_from_slice(&h.step.to_le_bytes());
    out.extend_from_slice(&h.layer.to_le_bytes());
    out.push(h.micro_batch);
    out.push(h.dtype.to_byte());
    out.extend_from_slice(&h.tokens.to_le_bytes());
    out.extend_from_slice(&h.hidden.to_le_bytes());
    out.extend_from_slice(&h.slots.to_le_bytes());
    out.extend_from_slice(&h.shard.to_le_bytes());
}

fn u16_at(b: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([b[i], b[i + 1]])
}

fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

fn u64_at(b: &[u8], i: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[i..i + 8]);
    u64::from_le_bytes(a)
}

/// Parses the header of any message.
pub fn decode_header(bytes: &[u8]) -> Result<Header, DecodeError> {
    if bytes.len() < HEADER_LEN {
        return Err(DecodeError::Short(bytes.len()));
    }
    if bytes[..2] != MAGIC {
        return Err(DecodeError::Magic([bytes[0], bytes[1]]));
    }
    if bytes[2] != VERSION {
        return Err(DecodeError::Version(bytes[2]));
    }
    Ok(Header {
        kind: Kind::from_byte(bytes[3]).ok_or(DecodeError::Kind(bytes[3]))?,
        step: u64_at(bytes, 4),
        layer: u16_at(bytes, 12),
        micro_batch: bytes[14],
        dtype: WireDtype::from_byte(bytes[15]).ok_or(DecodeError::Dtype(bytes[15]))?,
        tokens: u32_at(bytes, 16),
        hidden: u32_at(bytes, 20),
        slots: u32_at(bytes, 24),
        shard: u32_at(bytes, 28),
    })
}

/// Bytes of `[tokens, hidden]` rows, saturating (so absurd headers fail the length check
/// instead of overflowing).
fn rows_len(h: &Header) -> usize {
    (h.tokens as usize)
        .saturating_mul(h.hidden as usize)
        .saturating_mul(h.dtype.size())
}

/// Payload bytes the header implies.
pub fn payload_len(h: &Header) -> usize {
    let tokens = h.tokens as usize;
    let slots = h.slots as usize;
    match h.kind {
        Kind::MoeDispatch => {
            rows_len(h).saturating_add(tokens.saturating_mul(slots).saturating_mul(8))
        }
        Kind::DenseDispatch | Kind::PartialSums => rows_len(h),
        Kind::LmHeadDispatch => rows_len(h).saturating_add(tokens.saturating_mul(ROW_SAMPLING_LEN)),
        Kind::LmHeadProposals => tokens.saturating_mul(proposal_len(slots)),
        Kind::Error => tokens,
    }
}

/// Total message bytes for a header.
pub fn message_len(h: &Header) -> usize {
    HEADER_LEN.saturating_add(payload_len(h))
}

fn checked(bytes: &[u8], expected: Kind) -> Result<(Header, &[u8]), DecodeError> {
    let h = decode_header(bytes)?;
    if h.kind != expected {
        return Err(DecodeError::UnexpectedKind {
            expected,
            actual: h.kind,
        });
    }
    let payload = &bytes[HEADER_LEN..];
    let expected_len = payload_len(&h);
    if payload.len() != expected_len {
        return Err(DecodeError::Length {
            kind: h.kind,
            expected: expected_len,
            actual: payload.len(),
        });
    }
    Ok((h, payload))
}

fn push_rows(rows: &[f32], dtype: WireDtype, out: &mut Vec<u8>) {
    match dtype {
        WireDtype::F32 => {
            for v in rows {
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        WireDtype::Bf16 => {
            for v in rows {
                out.extend_from_slice(&half::bf16::from_f32(*v).to_le_bytes());
            }
        }
    }
}

/// Hidden rows inside a received message, decoded on demand.
#[derive(Debug, Clone, Copy)]
pub struct Rows<'a> {
    bytes: &'a [u8],
    dtype: WireDtype,
    hidden: usize,
}

impl Rows<'_> {
    /// Number of rows.
    pub fn count(&self) -> usize {
        if self.hidden == 0 {
            0
        } else {
            self.bytes.len() / (self.hidden * self.dtype.size())
        }
    }

    /// Width of a row.
    pub fn hidden(&self) -> usize {
        self.hidden
    }

    /// Appends every row, as f32, to `out`.
    pub fn extend_f32(&self, out: &mut Vec<f32>) {
        match self.dtype {
            WireDtype::F32 => out.extend(
                self.bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            ),
            WireDtype::Bf16 => out.extend(
                self.bytes
                    .chunks_exact(2)
                    .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16)),
            ),
        }
    }

    /// Every row as f32.
    pub fn to_f32(&self) -> Vec<f32> {
        let mut v = Vec::with_capacity(self.bytes.len() / self.dtype.size());
        self.extend_f32(&mut v);
        v
    }
}

/// A decoded MoE dispatch: rows with their local (expert, weight) slots.
#[derive(Debug, Clone, Copy)]
pub struct MoeDispatch<'a> {
    /// The header.
    pub header: Header,
    /// `[tokens, hidden]` rows.
    pub rows: Rows<'a>,
    ids: &'a [u8],
    weights: &'a [u8],
}

impl MoeDispatch<'_> {
    /// Expert id of (row, slot); `NO_EXPERT` for an empty slot.
    pub fn expert(&self, row: usize, slot: usize) -> u32 {
        u32_at(self.ids, 4 * (row * self.header.slots as usize + slot))
    }

    /// Routing weight of (row, slot).
    pub fn weight(&self, row: usize, slot: usize) -> f32 {
        f32::from_bits(u32_at(
            self.weights,
            4 * (row * self.header.slots as usize + slot),
        ))
    }
}

/// Encodes an MoE dispatch: `rows` is `[tokens, hidden]`, `ids` and `weights` `[tokens, slots]`.
pub fn encode_moe_dispatch(
    meta: MessageMeta,
    hidden: usize,
    rows: &[f32],
    slots: usize,
    ids: &[u32],
    weights: &[f32],
    out: &mut Vec<u8>,
) {
    let tokens = rows.len().checked_div(hidden).unwrap_or(0);
    debug_assert_eq!(ids.len(), tokens * slots);
    debug_assert_eq!(weights.len(), tokens * slots);
    let h = header(Kind::MoeDispatch, meta, tokens, hidden, slots);
    out.reserve(message_len(&h));
    encode_header(&h, out);
    push_rows(rows, meta.dtype, out);
    for id in ids {
        out.extend_from_slice(&id.to_le_bytes());
    }
    for w in weights {
        out.extend_from_slice(&w.to_le_bytes());
    }
}

fn header(kind: Kind, meta: MessageMeta, tokens: usize, hidden: usize, slots: usize) -> Header {
    Header {
        kind,
        step: meta.step,
        layer: meta.layer,
        micro_batch: meta.micro_batch,
        dtype: meta.dtype,
        tokens: tokens as u32,
        hidden: hidden as u32,
        slots: slots as u32,
        shard: meta.shard,
    }
}

/// Decodes an MoE dispatch.
pub fn decode_moe_dispatch(bytes: &[u8]) -> Result<MoeDispatch<'_>, DecodeError> {
    let (h, payload) = checked(bytes, Kind::MoeDispatch)?;
    let rows_end = rows_len(&h);
    let ids_len = h.tokens as usize * h.slots as usize * 4;
    Ok(MoeDispatch {
        header: h,
        rows: Rows {
            bytes: &payload[..rows_end],
            dtype: h.dtype,
            hidden: h.hidden as usize,
        },
        ids: &payload[rows_end..rows_end + ids_len],
        weights: &payload[rows_end + ids_len..],
    })
}

/// Encodes rows alone: a dense dispatch or a card's partial sums.
pub fn encode_rows(kind: Kind, meta: MessageMeta, hidden: usize, rows: &[f32], out: &mut Vec<u8>) {
    debug_assert!(matches!(kind, Kind::DenseDispatch | Kind::PartialSums));
    let tokens = rows.len().checked_div(hidden).unwrap_or(0);
    let h = header(kind, meta, tokens, hidden, 0);
    out.reserve(message_len(&h));
    encode_header(&h, out);
    push_rows(rows, meta.dtype, out);
}

/// Decodes a rows-only message of the expected kind.
pub fn decode_rows(bytes: &[u8], kind: Kind) -> Result<(Header, Rows<'_>), DecodeError> {
    let (h, payload) = checked(bytes, kind)?;
    Ok((
        h,
        Rows {
            bytes: payload,
            dtype: h.dtype,
            hidden: h.hidden as usize,
        },
    ))
}

/// A decoded LM-head dispatch.
#[derive(Debug, Clone, Copy)]
pub struct LmHeadDispatch<'a> {
    /// The header (`slots` = candidates wanted per row).
    pub header: Header,
    /// Normed `[tokens, hidden]` rows.
    pub rows: Rows<'a>,
    sampling: &'a [u8],
}

impl LmHeadDispatch<'_> {
    /// Sampling settings of a row.
    pub fn sampling(&self, row: usize) -> RowSampling {
        let b = &self.sampling[row * ROW_SAMPLING_LEN..(row + 1) * ROW_SAMPLING_LEN];
        RowSampling {
            temperature: f32::from_bits(u32_at(b, 0)),
            logprobs: u32_at(b, 4) & ROW_FLAG_LOGPROBS != 0,
            filtered: u32_at(b, 4) & ROW_FLAG_FILTERED != 0,
            seed: u64_at(b, 8),
            position: u64_at(b, 16),
            target: (u32_at(b, 4) & ROW_FLAG_TARGET != 0).then(|| u32_at(b, 24)),
        }
    }
}

/// Encodes an LM-head dispatch.
pub fn encode_lm_head_dispatch(
    meta: MessageMeta,
    hidden: usize,
    rows: &[f32],
    sampling: &[RowSampling],
    candidates: usize,
    out: &mut Vec<u8>,
) {
    let h = header(
        Kind::LmHeadDispatch,
        meta,
        sampling.len(),
        hidden,
        candidates,
    );
    out.reserve(message_len(&h));
    encode_header(&h, out);
    push_rows(rows, meta.dtype, out);
    for s in sampling {
        out.extend_from_slice(&s.temperature.to_le_bytes());
        let flags = if s.logprobs { ROW_FLAG_LOGPROBS } else { 0 }
            | if s.filtered { ROW_FLAG_FILTERED } else { 0 }
            | if s.target.is_some() {
                ROW_FLAG_TARGET
            } else {
                0
            };
        out.extend_from_slice(&flags.to_le_bytes());
        out.extend_from_slice(&s.seed.to_le_bytes());
        out.extend_from_slice(&s.position.to_le_bytes());
        out.extend_from_slice(&s.target.unwrap_or(0).to_le_bytes());
        out.extend_from_slice(&[0; 4]);
    }
}

/// Decodes an LM-head dispatch.
pub fn decode_lm_head_dispatch(bytes: &[u8]) -> Result<LmHeadDispatch<'_>, DecodeError> {
    let (h, payload) = checked(bytes, Kind::LmHeadDispatch)?;
    let rows_end = rows_len(&h);
    Ok(LmHeadDispatch {
        header: h,
        rows: Rows {
            bytes: &payload[..rows_end],
            dtype: h.dtype,
            hidden: h.hidden as usize,
        },
        sampling: &payload[rows_end..],
    })
}

/// Encodes proposals; every proposal is padded (token `u32::MAX`, logit -inf) or cut to `slots`
/// candidates.
pub fn encode_proposals(
    meta: MessageMeta,
    slots: usize,
    proposals: &[Proposal],
    out: &mut Vec<u8>,
) {
    let h = header(Kind::LmHeadProposals, meta, proposals.len(), 0, slots);
    out.reserve(message_len(&h));
    encode_header(&h, out);
    for p in proposals {
        let winner = p.winner.unwrap_or(Winner {
            token: u32::MAX,
            logit: 0.0,
            score: f64::NAN,
        });
        out.extend_from_slice(&p.log_sum_exp.unwrap_or(f64::NAN).to_le_bytes());
        out.extend_from_slice(&p.scaled_log_sum_exp.unwrap_or(f64::NAN).to_le_bytes());
        out.extend_from_slice(&winner.score.to_le_bytes());
        out.extend_from_slice(&winner.token.to_le_bytes());
        out.extend_from_slice(&winner.logit.to_le_bytes());
        out.extend_from_slice(&p.shard_rows.to_le_bytes());
        out.extend_from_slice(&p.target_logit.unwrap_or(f32::NAN).to_le_bytes());
        for i in 0..slots {
            let c = p.candidates.get(i).copied().unwrap_or(Candidate {
                logit: f32::NEG_INFINITY,
                token: u32::MAX,
            });
            out.extend_from_slice(&c.logit.to_le_bytes());
            out.extend_from_slice(&c.token.to_le_bytes());
        }
    }
}

/// Decodes proposals; padding candidates (token `u32::MAX`) are dropped.
pub fn decode_proposals(bytes: &[u8]) -> Result<(Header, Vec<Proposal>), DecodeError> {
    let (h, payload) = checked(bytes, Kind::LmHeadProposals)?;
    let slots = h.slots as usize;
    let per = proposal_len(slots);
    let proposals = payload
        .chunks_exact(per)
        .map(|b| Proposal {
            log_sum_exp: present(f64::from_bits(u64_at(b, 0))),
            scaled_log_sum_exp: present(f64::from_bits(u64_at(b, 8))),
            winner: match (present(f64::from_bits(u64_at(b, 16))), u32_at(b, 24)) {
                (Some(score), token) if token != u32::MAX => Some(Winner {
                    token,
                    logit: f32::from_bits(u32_at(b, 28)),
                    score,
                }),
                _ => None,
            },
            shard_rows: u32_at(b, 32),
            target_logit: Some(f32::from_bits(u32_at(b, 36))).filter(|l| !l.is_nan()),
            candidates: b[PROPOSAL_FIXED_LEN..]
                .chunks_exact(8)
                .map(|c| Candidate {
                    logit: f32::from_bits(u32_at(c, 0)),
                    token: u32_at(c, 4),
                })
                .filter(|c| c.token != u32::MAX)
                .collect(),
        })
        .collect();
    Ok((h, proposals))
}

/// A value the wire marks absent with NaN.
fn present(v: f64) -> Option<f64> {
    (!v.is_nan()).then_some(v)
}

/// Encodes an error report.
pub fn encode_error(meta: MessageMeta, message: &str, out: &mut Vec<u8>) {
    let h = header(Kind::Error, meta, message.len(), 0, 0);
    encode_header(&h, out);
    out.extend_from_slice(message.as_bytes());
}

/// Decodes an error report.
pub fn decode_error(bytes: &[u8]) -> Result<(Header, String), DecodeError> {
    let (h, payload) = checked(bytes, Kind::Error)?;
    let text = std::str::from_utf8(payload).map_err(|_| DecodeError::Utf8)?;
    Ok((h, text.to_owned()))
}
