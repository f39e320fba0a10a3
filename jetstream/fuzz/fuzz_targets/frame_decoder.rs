//! Feeds arbitrary bytes to the frame decoder: it must never panic, never claim more bytes than
//! it was given, and whatever it accepts must encode back to exactly the bytes it consumed.

#![no_main]

use jetstream::codec::{Frame, decode};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The first byte picks the receiver's write-size limit, so the oversize check is covered.
    let Some((&limit_byte, bytes)) = data.split_first() else {
        return;
    };
    let max_write_bytes = 1u64 << (limit_byte % 40);
    if let Ok((frame, used)) = decode(bytes, max_write_bytes) {
        assert!(used <= bytes.len());
        assert_eq!(frame.to_vec(), bytes[..used]);
        if let Frame::Write(header) = frame {
            assert!(u64::from(header.len) <= max_write_bytes);
        }
    }
});
