//! Server-sent events: `data: {json}` per chunk, an error as a data event, `data: [DONE]` last.

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

/// The streaming response: every delta through `writer`, then usage, then `[DONE]`.
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
                    p.queue.push_back(error_event(&e));
                    p.queue.push_back(Event::default().data("[DONE]"));
                }
                None => {
                    p.choices = None;
                    if let Some(u) = p.writer.usage() {
                        p.queue.push_back(u);
                    }
                    p.queue.push_back(Event::default().data("[DONE]"));
                }
            }
        }
    });
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}
