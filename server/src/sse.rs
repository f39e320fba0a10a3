//! Server-sent events: `data: {json}` per chunk, an error as a data event, `data: [DONE]` last
//! (the chat and completions convention; `/v1/responses` ends with its own typed events).

use std::collections::VecDeque;
use std::convert::Infallible;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde::Serialize;

use crate::error::ApiError;
use crate::generation::{ChoiceDelta, ChoiceEvent, ChoiceStream};

/// Turns choice deltas into chunks (one endpoint's format).
pub trait ChunkWriter: Send + 'static {
    /// Chunks for a delta (chat sends the role chunk first).
    fn delta(&mut self, delta: ChoiceDelta) -> Vec<Event>;
    /// The final usage chunk, if the client asked for it.
    fn usage(&mut self) -> Option<Event>;
    /// What follows the last delta: the usage chunk, then `data: [DONE]`.
    fn end(&mut self) -> Vec<Event> {
        let mut events: Vec<Event> = self.usage().into_iter().collect();
        events.push(Event::default().data("[DONE]"));
        events
    }
    /// What a failed generation ends with: the error as a data event, then `data: [DONE]`.
    fn failed(&mut self, error: &ApiError) -> Vec<Event> {
        vec![error_event(error), Event::default().data("[DONE]")]
    }
}

/// `data: <json>`.
pub fn json_event<T: Serialize>(value: &T) -> Event {
    match serde_json::to_string(value) {
        Ok(json) => Event::default().data(json),
        Err(e) => error_event(&ApiError::Internal(format!("serializing a chunk: {e}"))),
    }
}

/// An error as a data event.
pub fn error_event(error: &ApiError) -> Event {
    Event::default().data(error.json())
}

struct Pump<W> {
    choices: Option<ChoiceStream>,
    writer: W,
    queue: VecDeque<Event>,
}

/// The streaming response: every delta through `writer`, then its end (or its failure).
pub fn stream_response<W: ChunkWriter>(
    choices: ChoiceStream,
    writer: W,
    on_error: impl Fn(&ApiError) + Send + 'static,
) -> Response {
    let pump = Pump {
        choices: Some(choices),
        writer,
        queue: VecDeque::new(),
    };
    let events = futures::stream::unfold((pump, on_error), |(mut p, on_error)| async move {
        loop {
            if let Some(e) = p.queue.pop_front() {
                return Some((Ok::<_, Infallible>(e), (p, on_error)));
            }
            let choices = p.choices.as_mut()?;
            match choices.next().await {
                Some(ChoiceEvent::Delta(d)) => {
                    let events = p.writer.delta(d);
                    p.queue.extend(events);
                }
                Some(ChoiceEvent::Error(e)) => {
                    on_error(&e);
                    // Dropping the other choices aborts them.
                    p.choices = None;
                    let events = p.writer.failed(&e);
                    p.queue.extend(events);
                }
                None => {
                    p.choices = None;
                    let events = p.writer.end();
                    p.queue.extend(events);
                }
            }
        }
    });
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}
