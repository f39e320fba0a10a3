use proptest::prelude::*;

use super::*;

fn meta(step: u64, layer: u16, micro_batch: u8, bf16: bool) -> MessageMeta {
    MessageMeta {
        step,
        layer,
        micro_batch,
        dtype: if bf16 {
            WireDtype::Bf16
        } else {
            WireDtype::F32
        },
        shard: 7,
    }
}

fn f32s() -> impl Strategy<Value = f32> {
    prop_oneof![
        -1e6f32..1e6f32,
        Just(0.0),
        Just(-0.0),
        Just(f32::MIN_POSITIVE)
    ]
}

proptest! {
    #[test]
    fn moe_dispatch_round_trips(
        tokens in 0usize..6, hidden in 1usize..40, slots in 0usize..5,
        step in any::<u64>(), layer in any::<u16>(), mb in any::<u8>(), seed in any::<u64>(),
        shard in any::<u32>(),
    ) {
        let rows: Vec<f32> = (0..tokens * hidden).map(|i| ((i as u64 ^ seed) % 1000) as f32 * 0.25 - 100.0).collect();
        let ids: Vec<u32> = (0..tokens * slots).map(|i| if i % 3 == 2 { NO_EXPERT } else { (i as u32) * 7 % 32 }).collect();
        let weights: Vec<f32> = (0..tokens * slots).map(|i| i as f32 / 10.0).collect();
        let mut buf = Vec::new();
        let m = MessageMeta { shard, ..meta(step, layer, mb, false) };
        encode_moe_dispatch(m, hidden, &rows, slots, &ids, &weights, &mut buf);
        prop_assert_eq!(buf.len(), message_len(&decode_header(&buf).unwrap()));
        let d = decode_moe_dispatch(&buf).unwrap();
        prop_assert_eq!((d.header.step, d.header.layer, d.header.micro_batch), (step, layer, mb));
        prop_assert_eq!(d.header.shard, shard);
        prop_assert_eq!(d.rows.to_f32(), rows);
        for t in 0..tokens {
            for s in 0..slots {
                prop_assert_eq!(d.expert(t, s), ids[t * slots + s]);
                prop_assert_eq!(d.weight(t, s), weights[t * slots + s]);
            }
        }
    }

    #[test]
    fn bf16_rows_round_to_nearest_bf16(rows in prop::collection::vec(f32s(), 0..64)) {
        let mut buf = Vec::new();
        encode_rows(Kind::PartialSums, meta(1, 2, 0, true), 1, &rows, &mut buf);
        let (_, r) = decode_rows(&buf, Kind::PartialSums).unwrap();
        let expect: Vec<f32> = rows.iter().map(|v| half::bf16::from_f32(*v).to_f32()).collect();
        prop_assert_eq!(r.to_f32(), expect);
    }

    #[test]
    fn proposals_round_trip(n in 0usize..5, slots in 0usize..6, seed in any::<u64>()) {
        let proposals: Vec<Proposal> = (0..n).map(|i| Proposal {
            log_sum_exp: (i % 3 != 2).then_some((seed % 97) as f64 + i as f64),
            scaled_log_sum_exp: (i % 2 == 0).then_some((seed % 89) as f64 * 0.25 - i as f64),
            winner: (i % 3 != 1).then_some(Winner {
                token: (seed as u32).wrapping_add(i as u32) % 1000,
                logit: i as f32 * 0.5,
                score: -(i as f64),
            }),
            shard_rows: (seed >> 8) as u32,
            target_logit: (i % 2 == 1).then_some((seed % 13) as f32 * -0.75),
            candidates: (0..slots.saturating_sub(i % 2)).map(|c| Candidate { logit: c as f32, token: c as u32 * 3 }).collect(),
        }).collect();
        let mut buf = Vec::new();
        encode_proposals(meta(9, LM_HEAD_LAYER, 1, false), slots, &proposals, &mut buf);
        prop_assert_eq!(buf.len(), HEADER_LEN + n * proposal_len(slots));
        let (h, back) = decode_proposals(&buf).unwrap();
        prop_assert_eq!(h.layer, LM_HEAD_LAYER);
        prop_assert_eq!(back, proposals);
    }

    /// The log-sum-exps and winner a row does not use travel as NaN (and id `u32::MAX`) and
    /// come back absent; a proposal cut to fewer slots keeps its best candidates.
    #[test]
    fn unused_log_sum_exps_and_cut_candidates_round_trip(
        lse in prop::option::of(-1e3f64..1e3),
        scaled in prop::option::of(-1e3f64..1e3),
        kept in 0usize..4, extra in 0usize..4,
    ) {
        let p = Proposal {
            log_sum_exp: lse,
            scaled_log_sum_exp: scaled,
            winner: None,
            shard_rows: 7,
            target_logit: None,
            candidates: (0..kept + extra).map(|c| Candidate { logit: -(c as f32), token: c as u32 }).collect(),
        };
        let mut buf = Vec::new();
        encode_proposals(meta(1, LM_HEAD_LAYER, 0, false), kept, std::slice::from_ref(&p), &mut buf);
        let (_, back) = decode_proposals(&buf).unwrap();
        prop_assert_eq!(back.len(), 1);
        prop_assert_eq!(back[0].log_sum_exp.map(f64::to_bits), lse.map(f64::to_bits));
        prop_assert_eq!(back[0].scaled_log_sum_exp.map(f64::to_bits), scaled.map(f64::to_bits));
        prop_assert_eq!(back[0].shard_rows, 7);
        prop_assert_eq!(back[0].winner, None);
        prop_assert_eq!(&back[0].candidates[..], &p.candidates[..kept]);
    }

    /// Every row's sampling settings come back, each flag alone and both together.
    #[test]
    fn lm_head_dispatch_round_trips(
        flags in prop::collection::vec((any::<bool>(), any::<bool>(), any::<u64>(), 0f32..4.0, prop::option::of(any::<u32>())), 0..8),
        hidden in 1usize..20,
        k in 0usize..100,
    ) {
        let n = flags.len();
        let rows: Vec<f32> = (0..n * hidden).map(|i| i as f32).collect();
        let sampling: Vec<RowSampling> = flags
            .iter()
            .enumerate()
            .map(|(i, &(logprobs, filtered, seed, temperature, target))| RowSampling {
                temperature,
                seed,
                position: 1000 + i as u64,
                logprobs,
                filtered,
                target,
            })
            .collect();
        let mut buf = Vec::new();
        encode_lm_head_dispatch(meta(3, LM_HEAD_LAYER, 0, false), hidden, &rows, &sampling, k, &mut buf);
        let d = decode_lm_head_dispatch(&buf).unwrap();
        prop_assert_eq!(d.header.slots as usize, k);
        prop_assert_eq!(d.rows.to_f32(), rows);
        for (i, s) in sampling.iter().enumerate() {
            prop_assert_eq!(d.sampling(i), *s);
        }
    }

    /// Any prefix, any corruption of any byte: decoding returns an error or a message whose
    /// every accessor stays in bounds, and never panics.
    #[test]
    fn truncated_or_mangled_messages_are_rejected_cleanly(cut in 0usize..200, pos in 0usize..200, byte in any::<u8>()) {
        let rows: Vec<f32> = (0..3 * 8).map(|i| i as f32).collect();
        let mut buf = Vec::new();
        encode_moe_dispatch(meta(1, 1, 0, false), 8, &rows, 2, &[1, 2, 3, NO_EXPERT, 5, 6], &[0.5; 6], &mut buf);
        let full = buf.len();
        let truncated = &buf[..cut.min(full)];
        if cut < full {
            prop_assert!(decode_moe_dispatch(truncated).is_err());
        }
        let mut mangled = buf.clone();
        let p = pos % full;
        mangled[p] = byte;
        if let Ok(d) = decode_moe_dispatch(&mangled) {
            let _ = d.rows.to_f32();
            for t in 0..d.header.tokens as usize {
                for s in 0..d.header.slots as usize {
                    let _ = (d.expert(t, s), d.weight(t, s));
                }
            }
        }
        let _ = decode_proposals(&mangled);
        let _ = decode_lm_head_dispatch(&mangled);
        let _ = decode_error(&mangled);
    }

    #[test]
    fn immediates_round_trip(step in 0u64..(1 << 40), layer in any::<u16>(), mb in any::<u8>()) {
        let i = Immediate { step, layer, micro_batch: mb };
        prop_assert_eq!(Immediate::unpack(i.pack()), i);
    }

    /// A step counter past the kept bits comes back as its low bits, the other fields intact.
    #[test]
    fn immediates_keep_the_low_step_bits(step in any::<u64>(), layer in any::<u16>(), mb in any::<u8>()) {
        let back = Immediate::unpack(Immediate { step, layer, micro_batch: mb }.pack());
        prop_assert_eq!(back.step, Immediate::wire_step(step));
        prop_assert_eq!(back.step, step % (1 << 40));
        prop_assert_eq!((back.layer, back.micro_batch), (layer, mb));
    }
}

#[test]
fn headers_that_lie_about_sizes_fail() {
    let mut buf = Vec::new();
    encode_rows(
        Kind::PartialSums,
        meta(1, 1, 0, false),
        4,
        &[1.0; 8],
        &mut buf,
    );
    // Claim 2^32-1 tokens: the implied size saturates instead of overflowing.
    buf[16..20].copy_from_slice(&u32::MAX.to_le_bytes());
    let err = decode_rows(&buf, Kind::PartialSums).unwrap_err();
    assert!(matches!(err, DecodeError::Length { .. }), "{err}");
    // Wrong kind, version, magic.
    let mut buf = Vec::new();
    encode_error(meta(1, 1, 0, false), "card 2 is out of memory", &mut buf);
    assert_eq!(decode_error(&buf).unwrap().1, "card 2 is out of memory");
    assert!(matches!(
        decode_rows(&buf, Kind::PartialSums),
        Err(DecodeError::UnexpectedKind { .. })
    ));
    buf[2] = 9;
    assert!(
        decode_error(&buf)
            .unwrap_err()
            .to_string()
            .contains("same afd version")
    );
    buf[0] = b'X';
    assert!(matches!(decode_error(&buf), Err(DecodeError::Magic(_))));
    assert!(matches!(
        decode_header(&buf[..10]),
        Err(DecodeError::Short(10))
    ));
}

#[test]
fn every_kind_round_trips_through_its_byte_and_no_other_byte_is_a_kind() {
    let kinds = [
        Kind::MoeDispatch,
        Kind::DenseDispatch,
        Kind::PartialSums,
        Kind::LmHeadDispatch,
        Kind::LmHeadProposals,
        Kind::Error,
    ];
    for k in kinds {
        assert_eq!(Kind::from_byte(k.to_byte()), Some(k), "{k:?}");
    }
    let bytes: std::collections::HashSet<u8> = kinds.iter().map(|k| k.to_byte()).collect();
    assert_eq!(bytes.len(), kinds.len(), "two kinds share a byte");
    for b in (0..=u8::MAX).filter(|b| !bytes.contains(b)) {
        assert_eq!(Kind::from_byte(b), None, "byte {b}");
    }
}

#[test]
fn wire_dtypes_parse_by_name_and_an_unknown_one_says_what_is_expected() {
    assert_eq!("f32".parse::<WireDtype>(), Ok(WireDtype::F32));
    assert_eq!("bf16".parse::<WireDtype>(), Ok(WireDtype::Bf16));
    let err = "fp8".parse::<WireDtype>().unwrap_err();
    assert!(
        err.contains("`fp8`") && err.contains("expected f32 or bf16"),
        "{err}"
    );
    for d in [WireDtype::F32, WireDtype::Bf16] {
        assert_eq!(WireDtype::from_byte(d.to_byte()), Some(d));
    }
    assert_eq!(WireDtype::from_byte(2), None);
}

#[test]
fn received_rows_say_how_many_rows_of_what_width_in_either_dtype() {
    for bf16 in [false, true] {
        for (hidden, rows) in [(3usize, 5usize), (1, 1), (7, 0)] {
            let values: Vec<f32> = (0..hidden * rows).map(|v| v as f32).collect();
            let mut buf = Vec::new();
            encode_rows(
                Kind::PartialSums,
                meta(1, 2, 0, bf16),
                hidden,
                &values,
                &mut buf,
            );
            let (_, r) = decode_rows(&buf, Kind::PartialSums).unwrap();
            assert_eq!((r.count(), r.hidden()), (rows, hidden), "bf16 {bf16}");
        }
    }
    // Rows of no width: none, whatever the payload.
    let mut buf = Vec::new();
    encode_rows(Kind::PartialSums, meta(1, 2, 0, false), 0, &[], &mut buf);
    let (_, r) = decode_rows(&buf, Kind::PartialSums).unwrap();
    assert_eq!((r.count(), r.hidden()), (0, 0));
}

/// A winner's id `u32::MAX` means "no winner" on the wire, whatever its score says: a card
/// that sent a score beside it sent no token.
#[test]
fn a_winner_with_the_absent_id_decodes_as_no_winner() {
    let proposal = |token| Proposal {
        log_sum_exp: Some(1.0),
        scaled_log_sum_exp: None,
        winner: Some(Winner {
            token,
            logit: 2.0,
            score: 3.0,
        }),
        shard_rows: 4,
        target_logit: None,
        candidates: vec![],
    };
    let decode = |p: Proposal| {
        let mut buf = Vec::new();
        encode_proposals(meta(9, LM_HEAD_LAYER, 1, false), 0, &[p], &mut buf);
        decode_proposals(&buf).unwrap().1.remove(0).winner
    };
    assert_eq!(decode(proposal(u32::MAX)), None);
    assert_eq!(
        decode(proposal(u32::MAX - 1)),
        proposal(u32::MAX - 1).winner
    );
}
