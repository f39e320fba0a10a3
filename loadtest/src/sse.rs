//! Server-sent events, decoded incrementally from whatever byte pieces the network delivers.
//!
//! Lines end with `\n` (a trailing `\r` is dropped); a blank line ends an event; lines starting
//! with `:` are comments (keep-alives) and are skipped; `data:` is taken with or without the
//! one space after the colon; other fields (`event:`, `id:`, `retry:`) are ignored, since the
//! OpenAI stream carries everything in `data`. `data: [DONE]` ends the stream.

/// One decoded event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SseEvent {
    /// The event's data (several `data:` lines joined with `\n`).
    Data(String),
    /// `data: [DONE]`: the server finished the stream.
    Done,
}

/// Incremental decoder: push byte pieces as they arrive, get the events they complete.
#[derive(Debug, Default)]
pub struct SseDecoder {
    /// Bytes of an unfinished line.
    partial_line: Vec<u8>,
    /// Data lines of the event being read.
    data: Vec<String>,
}

impl SseDecoder {
    /// A decoder at the start of a stream.
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds `bytes` and returns the events completed by them, in order.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<SseEvent> {
        let mut events = Vec::new();
        let mut rest = bytes;
        while let Some(pos) = rest.iter().position(|&b| b == b'\n') {
            self.partial_line.extend_from_slice(&rest[..pos]);
            rest = &rest[pos + 1..];
            let line = std::mem::take(&mut self.partial_line);
            if let Some(event) = self.take_line(&line) {
                events.push(event);
            }
        }
        self.partial_line.extend_from_slice(rest);
        events
    }

    /// Ends the stream: an event left without its closing blank line is still delivered
    /// (some servers omit the last one).
    pub fn finish(&mut self) -> Option<SseEvent> {
        let line = std::mem::take(&mut self.partial_line);
        if !line.is_empty() {
            // A line without `\n` cannot have ended an event; feed it, then close.
            let _ = self.take_line(&line);
        }
        self.dispatch()
    }

    fn take_line(&mut self, raw: &[u8]) -> Option<SseEvent> {
        let raw = raw.strip_suffix(b"\r").unwrap_or(raw);
        if raw.is_empty() {
            return self.dispatch();
        }
        if raw.starts_with(b":") {
            return None;
        }
        let line = String::from_utf8_lossy(raw);
        if let Some(value) = line.strip_prefix("data:") {
            let value = value.strip_prefix(' ').unwrap_or(value);
            self.data.push(value.to_string());
        }
        None
    }

    fn dispatch(&mut self) -> Option<SseEvent> {
        if self.data.is_empty() {
            return None;
        }
        let data = std::mem::take(&mut self.data).join("\n");
        if data.trim() == "[DONE]" {
            Some(SseEvent::Done)
        } else {
            Some(SseEvent::Data(data))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn decode_all(pieces: &[&[u8]]) -> Vec<SseEvent> {
        let mut d = SseDecoder::new();
        let mut out = Vec::new();
        for p in pieces {
            out.extend(d.push(p));
        }
        out.extend(d.finish());
        out
    }

    #[test]
    fn decodes_openai_stream_with_comments_and_crlf() {
        let stream =
            b": keep-alive\n\ndata: {\"a\":1}\r\n\r\ndata:{\"b\":2}\n\nevent: x\ndata: [DONE]\n\n";
        assert_eq!(
            decode_all(&[stream]),
            vec![
                SseEvent::Data("{\"a\":1}".into()),
                SseEvent::Data("{\"b\":2}".into()),
                SseEvent::Done
            ]
        );
    }

    #[test]
    fn multi_line_data_is_joined_and_missing_final_blank_line_is_tolerated() {
        assert_eq!(
            decode_all(&[b"data: one\ndata: two\n\ndata: three"]),
            vec![
                SseEvent::Data("one\ntwo".into()),
                SseEvent::Data("three".into())
            ]
        );
    }

    #[test]
    fn events_complete_only_at_the_blank_line() {
        let mut d = SseDecoder::new();
        assert!(d.push(b"data: {\"x\":").is_empty());
        assert!(d.push(b"1}\n").is_empty());
        assert_eq!(d.push(b"\n"), vec![SseEvent::Data("{\"x\":1}".into())]);
    }

    proptest! {
        /// However the network splits the bytes, the same events come out.
        #[test]
        fn any_split_gives_the_same_events(cuts in proptest::collection::vec(0usize..200, 0..12)) {
            let stream: &[u8] = ": ping\n\ndata: {\"t\":\"h\u{e9}llo\"}\r\n\r\ndata:{\"u\":2}\n\ndata: [DONE]\n\n".as_bytes();
            let whole = decode_all(&[stream]);
            let mut points: Vec<usize> = cuts.into_iter().map(|c| c % (stream.len() + 1)).collect();
            points.sort_unstable();
            let mut pieces = Vec::new();
            let mut last = 0;
            for p in points {
                pieces.push(&stream[last..p]);
                last = p;
            }
            pieces.push(&stream[last..]);
            prop_assert_eq!(decode_all(&pieces), whole);
        }
    }
}
