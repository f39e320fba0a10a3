//! `GET /health` (and `/ping`), `GET /metrics`, `GET /version`, and the JSON 404 and 405.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::error::ApiError;
use crate::state::AppState;

/// 200 while every attention node can serve (empty, or naming the cards that are down and
/// covered by replicas), else 503 with the error envelope and the cards that are down.
pub async fn health(State(state): State<Arc<AppState>>) -> Response {
    if state.router.is_healthy() {
        match crate::cards::degraded_body(&state.router) {
            None => StatusCode::OK.into_response(),
            Some(body) => (StatusCode::OK, Json(body)).into_response(),
        }
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(crate::cards::unhealthy_body(&state.router)),
        )
            .into_response()
    }
}

/// Prometheus text.
pub async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let stats = state.router.stats();
    let afd = state.afd_stats.as_ref().map(|s| s.snapshot());
    crate::cards::record(&state.metrics, &state.router);
    let clock = state.router.clock_snapshot();
    let text = state
        .metrics
        .render(&stats, afd.as_ref(), &clock, state.block_size);
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

/// The server's version.
pub async fn version() -> Json<serde_json::Value> {
    Json(json!({ "version": env!("CARGO_PKG_VERSION") }))
}

/// Unknown routes, in the OpenAI error shape.
pub async fn not_found(uri: axum::http::Uri) -> Response {
    ApiError::NotFound {
        message: format!("no route {uri}: see /v1/models, /v1/completions, /v1/chat/completions, /tokenize, /detokenize, /tokenizer_info, /health, /metrics"),
        param: None,
    }
    .into_response()
}

/// A known route asked with a method it does not take, in the OpenAI error shape (axum adds
/// the `Allow` header listing the route's methods).
pub async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    ApiError::MethodNotAllowed(format!(
        "{method} is not allowed on {}: the Allow header of this response lists the methods it \
         takes",
        uri.path()
    ))
    .into_response()
}
