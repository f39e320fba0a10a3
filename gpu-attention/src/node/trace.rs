//! Per-layer spans of the attention node, so micro-batch overlap can be seen: a list a user can
//! print as a timeline or write as a Chrome trace (open in chrome://tracing or Perfetto).

use std::time::Instant;

/// One recorded interval.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Span {
    /// What ran: `attention`, `dispatch`, `wait+combine`, `lm-head ...`.
    pub name: &'static str,
    /// Layer (65535 for the LM head).
    pub layer: usize,
    /// Micro-batch.
    pub micro_batch: u8,
    /// Microseconds since the trace started.
    pub start_us: f64,
    /// Duration in microseconds.
    pub duration_us: f64,
}

/// A span recorder that costs nothing when off.
#[derive(Debug)]
pub struct Trace {
    enabled: bool,
    origin: Instant,
    spans: Vec<Span>,
}

impl Trace {
    /// A recorder; `enabled = false` records nothing.
    pub fn new(enabled: bool) -> Self {
        Trace {
            enabled,
            origin: Instant::now(),
            spans: Vec::new(),
        }
    }

    /// Marks the start of a span.
    pub fn begin(&self) -> Option<Instant> {
        self.enabled.then(Instant::now)
    }

    /// Records the span started at `start`.
    pub fn end(
        &mut self,
        start: Option<Instant>,
        name: &'static str,
        layer: usize,
        micro_batch: u8,
    ) {
        if let Some(start) = start {
            self.spans.push(Span {
                name,
                layer,
                micro_batch,
                start_us: start.duration_since(self.origin).as_secs_f64() * 1e6,
                duration_us: start.elapsed().as_secs_f64() * 1e6,
            });
        }
    }

    /// The instant spans' `start_us` count from.
    pub fn origin(&self) -> Instant {
        self.origin
    }

    /// The spans recorded so far, leaving the recorder empty.
    pub fn take(&mut self) -> Vec<Span> {
        std::mem::take(&mut self.spans)
    }
}

/// Chrome trace-event JSON for `spans` (one track per micro-batch).
pub fn chrome_trace(spans: &[Span]) -> serde_json::Value {
    let events: Vec<serde_json::Value> = spans
        .iter()
        .map(|s| {
            serde_json::json!({
                "name": format!("{} L{}", s.name, s.layer),
                "cat": s.name, "ph": "X", "ts": s.start_us, "dur": s.duration_us,
                "pid": 1, "tid": s.micro_batch,
            })
        })
        .collect();
    serde_json::json!({ "traceEvents": events })
}
