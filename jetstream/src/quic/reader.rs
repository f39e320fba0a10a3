//! Reads frames and write payloads from a stream of byte chunks. Payload bytes are handed out
//! as slices of the chunks the transport delivered (no extra copy before they land); only a
//! frame header split across chunks is assembled in a small buffer.

use std::future::Future;

use bytes::{Buf, Bytes, BytesMut};

use crate::codec::{Frame, FrameError, MAX_FRAME_LEN, decode};

/// Where chunks come from: a QUIC receive stream, or memory in tests.
pub(crate) trait ChunkSource: Send {
    /// The next chunk of at most `max` bytes, `None` at the clean end of the stream.
    fn next_chunk(
        &mut self,
        max: usize,
    ) -> impl Future<Output = Result<Option<Bytes>, String>> + Send;
}

impl ChunkSource for quinn::RecvStream {
    async fn next_chunk(&mut self, max: usize) -> Result<Option<Bytes>, String> {
        match self.read_chunk(max, true).await {
            Ok(chunk) => Ok(chunk.map(|chunk| chunk.bytes)),
            Err(error) => Err(error.to_string()),
        }
    }
}

/// Why reading stopped.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum ReadError {
    /// The stream failed.
    Source(String),
    /// The peer sent bytes that are not a valid frame.
    Frame(FrameError),
    /// The stream ended inside a frame or payload.
    UnexpectedEnd,
}

impl std::fmt::Display for ReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadError::Source(reason) => write!(f, "stream failed: {reason}"),
            ReadError::Frame(error) => write!(f, "{error}"),
            ReadError::UnexpectedEnd => write!(f, "the stream ended in the middle of a frame"),
        }
    }
}

pub(crate) struct FrameReader<S> {
    source: S,
    /// Bytes received but not consumed yet.
    pending: Bytes,
    /// The start of a frame split across chunks, kept here so that reading is cancel-safe.
    partial: BytesMut,
    max_write_bytes: u64,
}

impl<S: ChunkSource> FrameReader<S> {
    pub(crate) fn new(source: S, max_write_bytes: u64) -> Self {
        Self {
            source,
            pending: Bytes::new(),
            partial: BytesMut::with_capacity(MAX_FRAME_LEN),
            max_write_bytes,
        }
    }

    pub(crate) fn source_mut(&mut self) -> &mut S {
        &mut self.source
    }

    async fn next_bytes(&mut self, max: usize) -> Result<Option<Bytes>, ReadError> {
        if !self.pending.is_empty() {
            let take = max.min(self.pending.len());
            return Ok(Some(self.pending.split_to(take)));
        }
        self.source.next_chunk(max).await.map_err(ReadError::Source)
    }

    /// The next frame, or `None` when the stream ended cleanly between frames.
    ///
    /// Cancel-safe: if the future is dropped before it completes, the bytes it already took
    /// stay in the reader and the next call continues the same frame.
    pub(crate) async fn next_frame(&mut self) -> Result<Option<Frame>, ReadError> {
        if self.partial.is_empty() {
            // Fast path: the whole frame is in the current chunk.
            match decode(&self.pending, self.max_write_bytes) {
                Ok((frame, used)) => {
                    self.pending.advance(used);
                    return Ok(Some(frame));
                }
                Err(FrameError::Truncated { .. }) => {}
                Err(error) => return Err(ReadError::Frame(error)),
            }
        }
        loop {
            match decode(&self.partial, self.max_write_bytes) {
                Ok((frame, used)) => {
                    // Assembly stops at `needed`, the frame's exact length, so this is rare.
                    let rest = self.partial.split_off(used);
                    self.partial.clear();
                    if !rest.is_empty() {
                        let mut joined = rest;
                        joined.extend_from_slice(&self.pending);
                        self.pending = joined.freeze();
                    }
                    return Ok(Some(frame));
                }
                Err(FrameError::Truncated { needed }) => {
                    while self.partial.len() < needed {
                        let Some(chunk) = self.next_bytes(needed - self.partial.len()).await?
                        else {
                            return if self.partial.is_empty() {
                                Ok(None)
                            } else {
                                Err(ReadError::UnexpectedEnd)
                            };
                        };
                        self.partial.extend_from_slice(&chunk);
                    }
                }
                Err(error) => return Err(ReadError::Frame(error)),
            }
        }
    }

    /// Passes the next `len` payload bytes to `sink`, chunk by chunk, without copying them.
    pub(crate) async fn read_payload(
        &mut self,
        len: usize,
        mut sink: impl FnMut(&[u8]) + Send,
    ) -> Result<(), ReadError> {
        let mut remaining = len;
        while remaining > 0 {
            let chunk = self
                .next_bytes(remaining)
                .await?
                .ok_or(ReadError::UnexpectedEnd)?;
            let take = chunk.len().min(remaining);
            sink(&chunk[..take]);
            if take < chunk.len() {
                // A source that ignored `max`: keep the rest for the next frame.
                self.pending = chunk.slice(take..);
            }
            remaining -= take;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use proptest::prelude::*;

    use super::*;
    use crate::codec::WriteHeader;

    /// Serves a byte string in chunks of chosen sizes.
    struct Chunks(VecDeque<Bytes>);

    impl ChunkSource for Chunks {
        async fn next_chunk(&mut self, max: usize) -> Result<Option<Bytes>, String> {
            let Some(mut chunk) = self.0.pop_front() else {
                return Ok(None);
            };
            if chunk.len() > max {
                let rest = chunk.split_off(max);
                self.0.push_front(rest);
            }
            Ok(Some(chunk))
        }
    }

    fn split(bytes: &[u8], cuts: &[usize]) -> Chunks {
        let mut cuts: Vec<usize> = cuts.iter().map(|cut| cut % (bytes.len() + 1)).collect();
        cuts.sort_unstable();
        cuts.dedup();
        let mut chunks = VecDeque::new();
        let mut start = 0;
        for cut in cuts.into_iter().chain([bytes.len()]) {
            if cut > start {
                chunks.push_back(Bytes::copy_from_slice(&bytes[start..cut]));
                start = cut;
            }
        }
        Chunks(chunks)
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
    }

    proptest! {
        /// However the stream is cut into chunks, the reader yields the same frames and
        /// payloads that were written.
        #[test]
        fn frames_and_payloads_survive_any_chunking(
            payloads in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..300), 0..6),
            cuts in proptest::collection::vec(any::<usize>(), 0..20),
        ) {
            let mut wire = Frame::Hello { node: "card-7".into() }.to_vec();
            for (seq, payload) in payloads.iter().enumerate() {
                let header = WriteHeader { seq: seq as u64, region: 1, key: 2, offset: 3, len: payload.len() as u32, immediate: 4 };
                wire.extend_from_slice(&Frame::Write(header).to_vec());
                wire.extend_from_slice(payload);
                wire.extend_from_slice(&Frame::Ack { through: seq as u64 }.to_vec());
            }
            let mut reader = FrameReader::new(split(&wire, &cuts), 1 << 20);
            runtime().block_on(async {
                assert_eq!(reader.next_frame().await.unwrap(), Some(Frame::Hello { node: "card-7".into() }));
                for (seq, payload) in payloads.iter().enumerate() {
                    let Some(Frame::Write(header)) = reader.next_frame().await.unwrap() else { panic!("expected a write") };
                    assert_eq!(header.seq, seq as u64);
                    let mut landed = Vec::new();
                    reader.read_payload(header.len as usize, |chunk| landed.extend_from_slice(chunk)).await.unwrap();
                    assert_eq!(&landed, payload);
                    assert_eq!(reader.next_frame().await.unwrap(), Some(Frame::Ack { through: seq as u64 }));
                }
                assert_eq!(reader.next_frame().await.unwrap(), None);
            });
        }

        /// A stream cut short inside a frame or payload is an error, never a frame.
        #[test]
        fn truncated_streams_are_errors(cut in 1usize..60, split_at in any::<usize>()) {
            let header = WriteHeader { seq: 0, region: 1, key: 2, offset: 0, len: 16, immediate: 0 };
            let mut wire = Frame::Write(header).to_vec();
            wire.extend_from_slice(&[9; 16]);
            let cut = cut.min(wire.len() - 1);
            let mut reader = FrameReader::new(split(&wire[..cut], &[split_at]), 1 << 20);
            let outcome = runtime().block_on(async {
                match reader.next_frame().await? {
                    Some(Frame::Write(header)) => reader.read_payload(header.len as usize, |_| {}).await,
                    other => panic!("unexpected {other:?}"),
                }
            });
            prop_assert_eq!(outcome, Err(ReadError::UnexpectedEnd));
        }
    }

    /// Yields one byte per ready call and is not ready every other poll.
    struct Dribble {
        bytes: VecDeque<u8>,
        ready: bool,
    }

    impl ChunkSource for Dribble {
        fn next_chunk(
            &mut self,
            _max: usize,
        ) -> impl Future<Output = Result<Option<Bytes>, String>> + Send {
            self.ready = !self.ready;
            // Like a real stream, a byte is taken only when the read completes.
            let outcome = if self.ready {
                Some(
                    self.bytes
                        .pop_front()
                        .map(|byte| Bytes::copy_from_slice(&[byte])),
                )
            } else {
                None
            };
            let mut outcome = outcome;
            std::future::poll_fn(move |_| match outcome.take() {
                Some(chunk) => std::task::Poll::Ready(Ok(chunk)),
                None => std::task::Poll::Pending,
            })
        }
    }

    #[test]
    fn dropping_a_pending_read_loses_nothing() {
        let frames = [
            Frame::Hello {
                node: "attn".into(),
            },
            Frame::Ack { through: 9 },
            Frame::OpenChannel { channel: 2 },
        ];
        let wire: Vec<u8> = frames.iter().flat_map(Frame::to_vec).collect();
        let mut reader = FrameReader::new(
            Dribble {
                bytes: wire.into_iter().collect(),
                ready: false,
            },
            1 << 20,
        );
        let waker = std::task::Waker::noop();
        let mut context = std::task::Context::from_waker(waker);
        let mut seen = Vec::new();
        for _ in 0..10_000 {
            // Poll once, then drop the future whether or not it finished.
            let mut read = std::pin::pin!(reader.next_frame());
            match read.as_mut().poll(&mut context) {
                std::task::Poll::Ready(Ok(Some(frame))) => seen.push(frame),
                std::task::Poll::Ready(Ok(None)) => break,
                std::task::Poll::Ready(Err(error)) => panic!("{error}"),
                std::task::Poll::Pending => {}
            }
        }
        assert_eq!(seen, frames);
    }

    #[test]
    fn garbage_is_a_frame_error() {
        let mut reader = FrameReader::new(split(b"HTTP/1.1 200 OK", &[3]), 1 << 20);
        let outcome = runtime().block_on(reader.next_frame());
        assert!(matches!(
            outcome,
            Err(ReadError::Frame(FrameError::BadMagic(_)))
        ));
    }

    #[test]
    fn oversized_writes_are_refused_before_the_payload() {
        let header = WriteHeader {
            seq: 0,
            region: 1,
            key: 2,
            offset: 0,
            len: 1000,
            immediate: 0,
        };
        let mut reader = FrameReader::new(split(&Frame::Write(header).to_vec(), &[]), 999);
        let outcome = runtime().block_on(reader.next_frame());
        assert_eq!(
            outcome,
            Err(ReadError::Frame(FrameError::Oversized {
                len: 1000,
                max: 999
            }))
        );
    }
}
