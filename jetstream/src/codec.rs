//! The wire format: a pure, versioned, length-checked frame codec (no I/O).
//!
//! Every frame starts with a 4-byte prefix: the magic `JS`, the version byte and the frame kind.
//! Integers are little-endian. A `Write` frame is followed by exactly `len` payload bytes, which
//! are not part of the frame itself, so the receiver can land them straight into region memory.
//!
//! | kind | frame         | body after the prefix                                        |
//! |------|---------------|--------------------------------------------------------------|
//! | 1    | `Hello`       | name length `u8`, name (UTF-8, a DNS label)                  |
//! | 2    | `HelloAck`    | nothing                                                      |
//! | 3    | `OpenChannel` | channel `u32`                                                |
//! | 4    | `Write`       | seq `u64`, region `u32`, key `u64`, offset `u64`, len `u32`, immediate `u64` |
//! | 5    | `Ack`         | through-seq `u64` (every write up to it on this channel landed) |
//! | 6    | `Nack`        | seq `u64`, reason `u8`                                       |

use bytes::BufMut;

/// First two bytes of every frame.
pub const MAGIC: [u8; 2] = *b"JS";
/// The protocol version this crate speaks.
pub const VERSION: u8 = 1;
/// Bytes before each frame's body: magic, version, kind.
pub const PREFIX_LEN: usize = 4;
/// Length of an encoded `Write` frame (prefix and fixed body, without payload).
pub const WRITE_FRAME_LEN: usize = PREFIX_LEN + 8 + 4 + 8 + 8 + 4 + 8;
/// Longest node name a `Hello` can carry (a DNS label).
pub const MAX_NAME_LEN: usize = 63;
/// The largest encoded frame (a `Hello` with the longest name).
pub const MAX_FRAME_LEN: usize = PREFIX_LEN + 1 + MAX_NAME_LEN;

const KIND_HELLO: u8 = 1;
const KIND_HELLO_ACK: u8 = 2;
const KIND_OPEN_CHANNEL: u8 = 3;
const KIND_WRITE: u8 = 4;
const KIND_ACK: u8 = 5;
const KIND_NACK: u8 = 6;

/// The fixed part of a one-sided write; `len` payload bytes follow it on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteHeader {
    /// Per-channel sequence number, starting at 0, used by acknowledgments.
    pub seq: u64,
    /// Target region id.
    pub region: u32,
    /// The target region's key.
    pub key: u64,
    /// Byte offset in the target region.
    pub offset: u64,
    /// Payload length in bytes.
    pub len: u32,
    /// Opaque value delivered with the receive completion.
    pub immediate: u64,
}

/// Why a receiver refused a write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NackReason {
    /// No region with that id.
    UnknownRegion,
    /// The key does not match.
    WrongKey,
    /// The region is not granted to the writer.
    NotGranted,
    /// Offset plus length exceed the region.
    OutOfBounds,
}

impl NackReason {
    fn to_byte(self) -> u8 {
        match self {
            NackReason::UnknownRegion => 1,
            NackReason::WrongKey => 2,
            NackReason::NotGranted => 3,
            NackReason::OutOfBounds => 4,
        }
    }

    fn from_byte(byte: u8) -> Option<Self> {
        Some(match byte {
            1 => NackReason::UnknownRegion,
            2 => NackReason::WrongKey,
            3 => NackReason::NotGranted,
            4 => NackReason::OutOfBounds,
            _ => return None,
        })
    }
}

/// One decoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// First frame of a connection's control stream: the dialling node's name, which the
    /// acceptor checks against the client certificate.
    Hello {
        /// The claimed node name.
        node: String,
    },
    /// The acceptor's answer once the claimed name matched the certificate.
    HelloAck,
    /// First frame of a data stream: which channel the stream carries.
    OpenChannel {
        /// The channel number chosen by the writer.
        channel: u32,
    },
    /// A one-sided write; its payload follows.
    Write(WriteHeader),
    /// Every write on this channel with a sequence number up to `through` has landed, except
    /// those refused with a `Nack` earlier on the stream.
    Ack {
        /// Highest acknowledged sequence number.
        through: u64,
    },
    /// The write `seq` was refused and nothing of it landed.
    Nack {
        /// The refused write.
        seq: u64,
        /// Why.
        reason: NackReason,
    },
}

/// Why bytes are not a valid frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// More bytes are needed; `needed` is the smallest total length worth retrying with.
    #[error("truncated frame: at least {needed} bytes are needed")]
    Truncated {
        /// Total bytes needed before decoding can make progress.
        needed: usize,
    },
    /// The first two bytes are not the magic.
    #[error("bad magic {0:02x?}: the peer does not speak JetStream")]
    BadMagic([u8; 2]),
    /// A version this build does not speak.
    #[error("unsupported protocol version {0} (this build speaks {VERSION}): upgrade both sides")]
    UnsupportedVersion(u8),
    /// An unknown frame kind.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// A write payload larger than the receiver accepts.
    #[error("write payload of {len} bytes exceeds the receiver's limit of {max} bytes")]
    Oversized {
        /// Announced payload length.
        len: u64,
        /// The receiver's limit.
        max: u64,
    },
    /// A `Hello` whose name is empty, too long or not UTF-8.
    #[error("malformed node name in hello")]
    BadName,
    /// A `Nack` with an unknown reason code.
    #[error("unknown nack reason {0}")]
    BadNackReason(u8),
}

impl Frame {
    /// Encoded length of this frame (without any write payload).
    pub fn encoded_len(&self) -> usize {
        PREFIX_LEN
            + match self {
                Frame::Hello { node } => 1 + node.len(),
                Frame::HelloAck => 0,
                Frame::OpenChannel { .. } => 4,
                Frame::Write(_) => WRITE_FRAME_LEN - PREFIX_LEN,
                Frame::Ack { .. } => 8,
                Frame::Nack { .. } => 9,
            }
    }

    /// Appends the encoding of this frame to `out`.
    ///
    /// A `Hello` name longer than [`MAX_NAME_LEN`] is a caller bug; names are validated when
    /// an endpoint is built, and the name is cut to the limit here rather than panicking.
    pub fn encode(&self, out: &mut impl BufMut) {
        out.put_slice(&MAGIC);
        out.put_u8(VERSION);
        match self {
            Frame::Hello { node } => {
                let name = &node.as_bytes()[..node.len().min(MAX_NAME_LEN)];
                out.put_u8(KIND_HELLO);
                out.put_u8(name.len() as u8);
                out.put_slice(name);
            }
            Frame::HelloAck => out.put_u8(KIND_HELLO_ACK),
            Frame::OpenChannel { channel } => {
                out.put_u8(KIND_OPEN_CHANNEL);
                out.put_u32_le(*channel);
            }
            Frame::Write(header) => {
                out.put_u8(KIND_WRITE);
                out.put_u64_le(header.seq);
                out.put_u32_le(header.region);
                out.put_u64_le(header.key);
                out.put_u64_le(header.offset);
                out.put_u32_le(header.len);
                out.put_u64_le(header.immediate);
            }
            Frame::Ack { through } => {
                out.put_u8(KIND_ACK);
                out.put_u64_le(*through);
            }
            Frame::Nack { seq, reason } => {
                out.put_u8(KIND_NACK);
                out.put_u64_le(*seq);
                out.put_u8(reason.to_byte());
            }
        }
    }

    /// The encoding as a fresh vector.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.encoded_len());
        self.encode(&mut out);
        out
    }
}

/// Encodes a write header into a fixed array (the hot path, no allocation).
pub fn encode_write_header(header: &WriteHeader) -> [u8; WRITE_FRAME_LEN] {
    let mut out = [0u8; WRITE_FRAME_LEN];
    let mut cursor = &mut out[..];
    Frame::Write(*header).encode(&mut cursor);
    out
}

/// Decodes one frame from the front of `buf`.
///
/// Returns the frame and how many bytes it used. A `Write` whose `len` exceeds
/// `max_write_bytes` is rejected as [`FrameError::Oversized`] before any payload is read.
/// Never panics, whatever `buf` holds.
pub fn decode(buf: &[u8], max_write_bytes: u64) -> Result<(Frame, usize), FrameError> {
    if buf.len() < PREFIX_LEN {
        // Reject a wrong magic or version as early as the bytes allow.
        check_prefix_start(buf)?;
        return Err(FrameError::Truncated { needed: PREFIX_LEN });
    }
    check_prefix_start(buf)?;
    let kind = buf[3];
    let body = &buf[PREFIX_LEN..];
    let fixed = |len: usize| -> Result<Reader<'_>, FrameError> {
        if body.len() < len {
            Err(FrameError::Truncated {
                needed: PREFIX_LEN + len,
            })
        } else {
            Ok(Reader {
                bytes: &body[..len],
            })
        }
    };
    let frame = match kind {
        KIND_HELLO => {
            let name_len = usize::from(*body.first().ok_or(FrameError::Truncated {
                needed: PREFIX_LEN + 1,
            })?);
            if name_len == 0 || name_len > MAX_NAME_LEN {
                return Err(FrameError::BadName);
            }
            let mut reader = fixed(1 + name_len)?;
            reader.skip(1);
            let name =
                std::str::from_utf8(reader.take(name_len)).map_err(|_| FrameError::BadName)?;
            Frame::Hello {
                node: name.to_owned(),
            }
        }
        KIND_HELLO_ACK => Frame::HelloAck,
        KIND_OPEN_CHANNEL => Frame::OpenChannel {
            channel: fixed(4)?.u32(),
        },
        KIND_WRITE => {
            let mut reader = fixed(WRITE_FRAME_LEN - PREFIX_LEN)?;
            let header = WriteHeader {
                seq: reader.u64(),
                region: reader.u32(),
                key: reader.u64(),
                offset: reader.u64(),
                len: reader.u32(),
                immediate: reader.u64(),
            };
            if u64::from(header.len) > max_write_bytes {
                return Err(FrameError::Oversized {
                    len: u64::from(header.len),
                    max: max_write_bytes,
                });
            }
            Frame::Write(header)
        }
        KIND_ACK => Frame::Ack {
            through: fixed(8)?.u64(),
        },
        KIND_NACK => {
            let mut reader = fixed(9)?;
            let seq = reader.u64();
            let code = reader.u8();
            let reason = NackReason::from_byte(code).ok_or(FrameError::BadNackReason(code))?;
            Frame::Nack { seq, reason }
        }
        other => return Err(FrameError::UnknownKind(other)),
    };
    let used = frame.encoded_len();
    Ok((frame, used))
}

fn check_prefix_start(buf: &[u8]) -> Result<(), FrameError> {
    for (index, &byte) in buf.iter().take(2).enumerate() {
        if byte != MAGIC[index] {
            let mut seen = [0u8; 2];
            seen[..buf.len().min(2)].copy_from_slice(&buf[..buf.len().min(2)]);
            return Err(FrameError::BadMagic(seen));
        }
    }
    match buf.get(2) {
        Some(&version) if version != VERSION => Err(FrameError::UnsupportedVersion(version)),
        _ => Ok(()),
    }
}

/// Little-endian reads from a slice whose length was checked beforehand.
struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, len: usize) -> &'a [u8] {
        let (head, tail) = self.bytes.split_at(len.min(self.bytes.len()));
        self.bytes = tail;
        head
    }

    fn skip(&mut self, len: usize) {
        self.take(len);
    }

    fn array<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        let head = self.take(N);
        out[..head.len()].copy_from_slice(head);
        out
    }

    fn u8(&mut self) -> u8 {
        self.array::<1>()[0]
    }

    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.array())
    }

    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.array())
    }
}

#[cfg(test)]
mod tests;
