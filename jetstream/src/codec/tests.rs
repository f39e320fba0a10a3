use proptest::prelude::*;

use super::*;

const LIMIT: u64 = 1 << 26;

fn nack_reason() -> impl Strategy<Value = NackReason> {
    prop_oneof![
        Just(NackReason::UnknownRegion),
        Just(NackReason::WrongKey),
        Just(NackReason::NotGranted),
        Just(NackReason::OutOfBounds),
    ]
}

fn write_header(max_len: u32) -> impl Strategy<Value = WriteHeader> {
    (
        any::<u64>(),
        any::<u32>(),
        any::<u64>(),
        any::<u64>(),
        0..=max_len,
        any::<u64>(),
    )
        .prop_map(|(seq, region, key, offset, len, immediate)| WriteHeader {
            seq,
            region,
            key,
            offset,
            len,
            immediate,
        })
}

fn frame() -> impl Strategy<Value = Frame> {
    prop_oneof![
        "[a-z][a-z0-9-]{0,62}".prop_map(|node| Frame::Hello { node }),
        Just(Frame::HelloAck),
        any::<u32>().prop_map(|channel| Frame::OpenChannel { channel }),
        write_header(LIMIT as u32).prop_map(Frame::Write),
        any::<u64>().prop_map(|through| Frame::Ack { through }),
        (any::<u64>(), nack_reason()).prop_map(|(seq, reason)| Frame::Nack { seq, reason }),
    ]
}

proptest! {
    #[test]
    fn round_trip(frame in frame(), trailing in proptest::collection::vec(any::<u8>(), 0..16)) {
        let mut bytes = frame.to_vec();
        prop_assert_eq!(bytes.len(), frame.encoded_len());
        bytes.extend_from_slice(&trailing);
        let (decoded, used) = decode(&bytes, LIMIT).unwrap();
        prop_assert_eq!(decoded, frame.clone());
        prop_assert_eq!(used, frame.encoded_len());
    }

    #[test]
    fn write_header_fast_path_matches_encode(header in write_header(u32::MAX)) {
        prop_assert_eq!(encode_write_header(&header).to_vec(), Frame::Write(header).to_vec());
    }

    #[test]
    fn every_strict_prefix_is_truncated(frame in frame()) {
        let bytes = frame.to_vec();
        for cut in 0..bytes.len() {
            match decode(&bytes[..cut], LIMIT) {
                Err(FrameError::Truncated { needed }) => {
                    prop_assert!(needed > cut, "needed {} with {} bytes", needed, cut);
                    prop_assert!(needed <= bytes.len());
                }
                other => prop_assert!(false, "prefix of {} bytes decoded as {:?}", cut, other),
            }
        }
    }

    #[test]
    fn oversized_writes_are_rejected(header in write_header(u32::MAX), limit in 0u64..u64::from(u32::MAX)) {
        let bytes = Frame::Write(header).to_vec();
        let result = decode(&bytes, limit);
        if u64::from(header.len) > limit {
            prop_assert_eq!(result, Err(FrameError::Oversized { len: u64::from(header.len), max: limit }));
        } else {
            prop_assert!(result.is_ok());
        }
    }

    #[test]
    fn a_write_of_exactly_the_limit_is_accepted(header in write_header(u32::MAX)) {
        let bytes = Frame::Write(header).to_vec();
        let limit = u64::from(header.len);
        prop_assert!(decode(&bytes, limit).is_ok());
        if let Some(below) = limit.checked_sub(1) {
            prop_assert_eq!(
                decode(&bytes, below),
                Err(FrameError::Oversized { len: limit, max: below })
            );
        }
    }

    #[test]
    fn corrupted_prefix_is_rejected(frame in frame(), position in 0usize..4, byte in any::<u8>()) {
        let mut bytes = frame.to_vec();
        let original = bytes[position];
        prop_assume!(byte != original);
        bytes[position] = byte;
        let result = decode(&bytes, LIMIT);
        match position {
            0 | 1 => prop_assert!(matches!(result, Err(FrameError::BadMagic(_)))),
            2 => prop_assert_eq!(result, Err(FrameError::UnsupportedVersion(byte))),
            _ => {
                // Another valid kind may decode (or want more bytes); an unknown one must fail.
                if !(1..=6).contains(&byte) {
                    prop_assert_eq!(result, Err(FrameError::UnknownKind(byte)));
                }
            }
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..128), limit in any::<u64>()) {
        if let Ok((frame, used)) = decode(&bytes, limit) {
            prop_assert!(used <= bytes.len());
            prop_assert_eq!(&frame.to_vec()[..], &bytes[..used]);
        }
    }

    #[test]
    fn bad_nack_reasons_are_rejected(seq in any::<u64>(), code in 5u8..=255) {
        let mut bytes = Frame::Nack { seq, reason: NackReason::WrongKey }.to_vec();
        let last = bytes.len() - 1;
        bytes[last] = code;
        prop_assert_eq!(decode(&bytes, LIMIT), Err(FrameError::BadNackReason(code)));
    }
}

#[test]
fn malformed_hello_names_are_rejected() {
    let mut empty = Frame::Hello { node: "a".into() }.to_vec();
    empty[4] = 0;
    assert_eq!(decode(&empty, LIMIT), Err(FrameError::BadName));

    let mut too_long = vec![b'J', b'S', VERSION, 1, (MAX_NAME_LEN + 1) as u8];
    too_long.extend(std::iter::repeat_n(b'a', MAX_NAME_LEN + 1));
    assert_eq!(decode(&too_long, LIMIT), Err(FrameError::BadName));

    let not_utf8 = [b'J', b'S', VERSION, 1, 2, 0xff, 0xfe];
    assert_eq!(decode(&not_utf8, LIMIT), Err(FrameError::BadName));
}

#[test]
fn longest_hello_fits_the_frame_bound() {
    let frame = Frame::Hello {
        node: "n".repeat(MAX_NAME_LEN),
    };
    assert_eq!(frame.encoded_len(), MAX_FRAME_LEN);
    const { assert!(WRITE_FRAME_LEN <= MAX_FRAME_LEN) };
}

#[test]
fn wrong_magic_is_reported_from_the_first_byte() {
    assert_eq!(decode(b"X", LIMIT), Err(FrameError::BadMagic([b'X', 0])));
    assert_eq!(
        decode(b"JSx", LIMIT),
        Err(FrameError::UnsupportedVersion(b'x'))
    );
}
