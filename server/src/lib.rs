//! The OpenAI-compatible HTTP API.
//!
//! Owns the axum routes, request validation, tokenization and streaming detokenization, chat
//! templates, server-sent events and the metrics endpoint.
//!
//! Must not: schedule or compute; it hands validated requests to `router`.
//!
//! Entry point: [`Server::bind`] (or [`serve`]) with a [`ServerConfig`] and a running
//! [`router::Router`]. Routes, as vLLM serves them: `POST /v1/completions`,
//! `POST /v1/chat/completions`, `GET /v1/models`, `POST /tokenize`, `POST /detokenize`,
//! `GET /health` (`/ping`), `GET /metrics`, `GET /version`.
//!
//! Layout: I/O-free pieces ([`detokenize`], [`stop`], [`validation`], [`chat_template`],
//! [`protocol`]) under a thin async layer: [`generation`] turns router token streams into
//! per-choice text deltas; one module per endpoint formats them as JSON or SSE ([`sse`]);
//! [`error::ApiError`] is the single mapping to HTTP statuses and error bodies.

pub mod chat;
pub mod chat_template;
pub mod completions;
pub mod detokenize;
pub mod error;
pub mod generation;
pub mod health;
pub mod metrics;
pub mod models;
pub mod protocol;
pub mod sse;
pub mod state;
pub mod stop;
pub mod tokenize;
pub mod validation;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::routing::{get, post};
use axum::serve::ListenerExt;
use router::{AfdStatsSource, Router};

pub use error::{ApiError, Error};
pub use state::{ApiKey, AppState, ServerConfig};

/// The axum application over `state`.
pub fn app(state: Arc<AppState>) -> axum::Router {
    let api = axum::Router::new()
        .route("/v1/completions", post(completions::completions))
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/models", get(models::list_models))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
        ));
    axum::Router::new()
        .merge(api)
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route("/health", get(health::health))
        .route("/ping", get(health::health))
        .route("/metrics", get(health::metrics))
        .route("/version", get(health::version))
        .fallback(health::not_found)
        .with_state(state)
}

/// Refuses `/v1/*` requests without the configured API key (401, OpenAI error envelope).
async fn require_api_key(
    axum::extract::State(state): axum::extract::State<Arc<AppState>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    if let Some(key) = &state.config.api_key {
        let header = request
            .headers()
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        if !key.admits(header) {
            return ApiError::Unauthorized(
                "missing or wrong API key: send the header `Authorization: Bearer <key>` with \
                 the key the server was started with (--api-key)"
                    .into(),
            )
            .into_response();
        }
    }
    next.run(request).await
}

/// A bound, not yet running, HTTP server.
#[derive(Debug)]
pub struct Server {
    listener: tokio::net::TcpListener,
    addr: SocketAddr,
    state: Arc<AppState>,
}

impl Server {
    /// Loads the model's tokenizer and template and binds `config.host:config.port`.
    pub async fn bind(
        config: ServerConfig,
        router: Router,
        afd_stats: Option<Arc<dyn AfdStatsSource>>,
    ) -> Result<Self, Error> {
        let addr = format!("{}:{}", config.host, config.port);
        let state = Arc::new(AppState::new(config, router, afd_stats)?);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .map_err(|source| Error::Bind {
                addr: addr.clone(),
                source,
            })?;
        let addr = listener
            .local_addr()
            .map_err(|source| Error::Bind { addr, source })?;
        Ok(Server {
            listener,
            addr,
            state,
        })
    }

    /// The address it listens on (with the real port when 0 was asked).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The shared state (router, tokenizer, metrics).
    pub fn state(&self) -> &Arc<AppState> {
        &self.state
    }

    /// Serves until `shutdown` completes.
    pub async fn run_until(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), Error> {
        let state = Arc::clone(&self.state);
        let upkeep = tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(5));
            loop {
                tick.tick().await;
                state.metrics.upkeep();
            }
        });
        let listener = self.listener.tap_io(|tcp| {
            // Tokens are small writes; do not let Nagle hold them back.
            if let Err(e) = tcp.set_nodelay(true) {
                tracing::debug!(error = %e, "TCP_NODELAY");
            }
        });
        let result = axum::serve(listener, app(self.state))
            .with_graceful_shutdown(shutdown)
            .await
            .map_err(Error::Serve);
        upkeep.abort();
        result
    }

    /// Serves until Ctrl-C.
    pub async fn run(self) -> Result<(), Error> {
        self.run_until(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await
    }
}

/// Binds and serves until Ctrl-C.
pub async fn serve(
    config: ServerConfig,
    router: Router,
    afd_stats: Option<Arc<dyn AfdStatsSource>>,
) -> Result<(), Error> {
    let server = Server::bind(config, router, afd_stats).await?;
    tracing::info!(addr = %server.local_addr(), "serving");
    server.run().await
}
