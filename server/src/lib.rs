//! The OpenAI-compatible HTTP API.
//!
//! Owns the axum routes, request validation, tokenization and streaming detokenization, chat
//! templates, server-sent events and the metrics endpoint.
//!
//! Must not: schedule or compute, or depend on the attention node or the cards (it uses `router`,
//! `step` and `model`'s light part only); it hands validated requests to `router`.
//!
//! Entry point: [`Server::bind`] (or [`serve`]) with a [`ServerConfig`] and a running
//! [`router::Router`], then [`Server::run_until`] a stop signal, which drains (see
//! [`lifecycle`]). Routes, as vLLM serves them: `POST /v1/completions`,
//! `POST /v1/chat/completions`, `POST /v1/responses` (stateless: [`responses`]),
//! `GET /v1/models`, `POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`,
//! `GET /health` (`/ping`), `GET /metrics`, `GET /version`.
//!
//! Layout: I/O-free pieces ([`detokenize`], [`stop`], [`validation`], [`chat_template`],
//! [`tool_parsing`] (reasoning and tool calls out of chat outputs), [`tools`] (the request
//! side of tool calling), [`protocol`]) under a thin async layer: [`generation`] turns router token streams into
//! per-choice text deltas; one module per endpoint formats them as JSON or SSE ([`sse`]);
//! [`error::ApiError`] is the single mapping to HTTP statuses and error bodies, which every
//! error the server answers carries, hyper's own included ([`http`]: the accept loop,
//! connection bounds, header and body timeouts).

pub mod cards;
pub mod chat;
pub mod chat_template;
pub mod completions;
pub mod detokenize;
pub mod error;
pub mod generation;
pub mod health;
pub mod http;
pub mod lifecycle;
pub mod metrics;
pub mod models;
pub mod prompt_logprobs;
pub mod protocol;
pub mod responses;
pub mod sse;
pub mod state;
pub mod stop;
pub mod structured;
pub mod tokenize;
pub mod tool_parsing;
pub mod tools;
pub mod validation;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::routing::{get, post};
use router::{AfdStatsSource, Router};

pub use error::{ApiError, Error};
use http::{Connections, HttpSettings};
pub use lifecycle::Lifecycle;
pub use state::{ApiKey, AppState, ServerConfig};

/// After the drain deadline, how long the errors that end what was still running, and then
/// the closing of the connections, may take.
const CUT_OFF_GRACE: Duration = Duration::from_secs(5);

/// The axum application over `state`.
pub fn app(state: Arc<AppState>) -> axum::Router {
    let api = axum::Router::new()
        .route("/v1/completions", post(completions::completions))
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/responses", post(responses::responses))
        .route("/v1/responses/{id}", get(responses::retrieve))
        .route("/v1/models", get(models::list_models))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
        ));
    axum::Router::new()
        .merge(api)
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route("/tokenizer_info", get(tokenize::tokenizer_info))
        .route("/health", get(health::health))
        .route("/ping", get(health::health))
        .route("/metrics", get(health::metrics))
        .route("/version", get(health::version))
        .fallback(health::not_found)
        .method_not_allowed_fallback(health::method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            refuse_while_draining,
        ))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            say_time_dilation,
        ))
        .with_state(state)
}

/// The response header in which a server on a dilated modeled clock says its dilation:
/// afd-loadtest reads it and divides the times it measured.
pub const TIME_DILATION_HEADER: &str = "x-afd-time-dilation";
/// Beside it: `false` while `--time-dilation auto` is still measuring.
pub const TIME_DILATION_SETTLED_HEADER: &str = "x-afd-time-dilation-settled";

/// On a modeled clock (`afd serve --clock modeled`), every answer says the dilation, so any
/// client can turn the wall times it measures back into modeled ones.
async fn say_time_dilation(
    axum::extract::State(state): axum::extract::State<Arc<AppState>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let mut response = next.run(request).await;
    let clock = state.router.clock();
    if clock.is_modeled()
        && let Ok(value) = axum::http::HeaderValue::from_str(&clock.dilation().to_string())
    {
        let settled = state.router.clock_snapshot().settled;
        let headers = response.headers_mut();
        headers.insert(TIME_DILATION_HEADER, value);
        headers.insert(
            TIME_DILATION_SETTLED_HEADER,
            axum::http::HeaderValue::from_static(if settled { "true" } else { "false" }),
        );
    }
    response
}

/// While the server drains, every route but `/metrics` and `/version` answers 503 (the
/// OpenAI error envelope; `/health` thereby tells load balancers to stop sending), and every
/// answer closes its connection.
async fn refuse_while_draining(
    axum::extract::State(state): axum::extract::State<Arc<AppState>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    if !state.lifecycle.is_draining() {
        return next.run(request).await;
    }
    let path = request.uri().path();
    let mut response = if path == "/metrics" || path == "/version" {
        next.run(request).await
    } else {
        Lifecycle::refusal().into_response()
    };
    // Clients go elsewhere for their next request instead of reusing this connection.
    response.headers_mut().insert(
        axum::http::header::CONNECTION,
        axum::http::HeaderValue::from_static("close"),
    );
    response
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

/// How a drain went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DrainReport {
    /// HTTP exchanges in flight when the stop came.
    pub in_flight: usize,
    /// Exchanges still in flight at the deadline (or at a second stop), ended with an error.
    pub cut_off: usize,
    /// From the stop to the last connection closed.
    pub took: Duration,
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

    /// Serves until `stop` completes, then drains: new requests get 503 while those in flight
    /// finish, for at most `shutdown_timeout` (or until [`Lifecycle::cut_off`], say on a
    /// second signal); whatever is still running then ends with an error event or error
    /// JSON, and every connection is closed.
    pub async fn run_until(
        self,
        stop: impl Future<Output = ()> + Send + 'static,
    ) -> Result<DrainReport, Error> {
        let state = self.state;
        let config = &state.config;
        let lifecycle = Arc::clone(&state.lifecycle);
        let connections = Arc::new(Connections::new(
            config
                .max_connections
                .unwrap_or_else(http::connection_limit),
        ));
        // Weak: the metrics upkeep must not keep the state (and what it holds) alive.
        let upkeep_state = Arc::downgrade(&state);
        let upkeep = tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(5));
            loop {
                tick.tick().await;
                match upkeep_state.upgrade() {
                    Some(state) => state.metrics.upkeep(),
                    None => break,
                }
            }
        });
        let settings = HttpSettings {
            header_timeout: config.header_timeout,
        };
        let accept = tokio::spawn(http::accept_loop(
            self.listener,
            app(Arc::clone(&state)),
            Arc::clone(&lifecycle),
            Arc::clone(&connections),
            settings,
        ));
        stop.await;
        let started = Instant::now();
        let in_flight = lifecycle.in_flight();
        lifecycle.start_draining();
        let deadline = started + config.shutdown_timeout;
        let mut cut_off = 0;
        tokio::select! {
            () = lifecycle.idle() => {}
            () = tokio::time::sleep_until(deadline.into()) => {
                cut_off = lifecycle.in_flight();
                lifecycle.cut_off();
            }
            () = lifecycle.cut_signal() => cut_off = lifecycle.in_flight(),
        }
        // What was cut off ends with an error; give those answers a moment to go out.
        let _ = tokio::time::timeout(CUT_OFF_GRACE, lifecycle.idle()).await;
        accept.abort();
        upkeep.abort();
        connections.close_all();
        let _ = tokio::time::timeout(CUT_OFF_GRACE, connections.empty()).await;
        Ok(DrainReport {
            in_flight,
            cut_off,
            took: started.elapsed(),
        })
    }

    /// Serves until Ctrl-C, then drains.
    pub async fn run(self) -> Result<DrainReport, Error> {
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
    server.run().await.map(|_| ())
}
