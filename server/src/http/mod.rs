//! The HTTP/1.1 layer under the axum routes: an accept loop over hyper's connection API, for
//! what `axum::serve` does not let a server set.
//!
//! - A request head must arrive within `header_timeout` of the connection opening or of its
//!   previous response (hyper's header read timer, which also bounds idle keep-alive time);
//!   a client that sent part of a head and stalled gets 408, an idle one is closed.
//! - Open connections are bounded ([`Connections`]): at the limit the oldest idle one makes
//!   room, so idle connections cannot use up the process's file descriptors and lock normal
//!   requests out; accept errors for want of descriptors close an idle one too.
//! - hyper's own answers to unparsable requests (400, 414, 431) carry the OpenAI error envelope
//!   ([`envelope_io`]); body limits and timeouts are the handlers' ([`body`]).
//! - Every exchange is counted in the [`Lifecycle`] until its response is sent, so a draining
//!   server knows when it may close.
//!
//! HTTP/1.1 only, as vLLM's uvicorn serves it.

pub mod body;
pub mod connections;
pub mod envelope_io;

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{Request, Response};
use hyper::body::{Frame, Incoming, SizeHint};
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tower::Service;

use crate::error::ApiError;
use crate::lifecycle::{InFlight, Lifecycle};
pub use connections::Connections;
use connections::{BusyGuard, ConnState};
use envelope_io::{EnvelopeIo, MAX_HEADERS, envelope_response};

/// How long an answer written outside hyper (a refusal, a 408) may take before the connection
/// is dropped anyway.
const WRITE_GRACE: Duration = Duration::from_secs(2);

/// Open-file descriptors kept for everything but client connections (listeners, QUIC sockets,
/// checkpoint files, the runtime's own).
const RESERVED_FDS: u64 = 256;

/// The most connections [`connection_limit`] allows by default, whatever the file limit.
const DEFAULT_MAX_CONNECTIONS: u64 = 16_384;

/// Connections the server keeps open by default: the process's open-file limit less
/// [`RESERVED_FDS`], at most [`DEFAULT_MAX_CONNECTIONS`], at least 64.
pub fn connection_limit() -> usize {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes only the struct it is given, which lives on this stack.
    let soft: u64 = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0 {
        limit.rlim_cur
    } else {
        1024
    };
    soft.saturating_sub(RESERVED_FDS)
        .clamp(64, DEFAULT_MAX_CONNECTIONS) as usize
}

/// What the accept loop needs.
#[derive(Clone)]
pub struct HttpSettings {
    /// See [`crate::ServerConfig::header_timeout`].
    pub header_timeout: Duration,
}

/// The axum application served on one connection, with its exchanges counted.
#[derive(Clone)]
struct ConnService {
    app: axum::Router,
    conn: Arc<ConnState>,
    lifecycle: Arc<Lifecycle>,
}

impl hyper::service::Service<Request<Incoming>> for ConnService {
    type Response = Response<CountedBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<CountedBody>, Infallible>> + Send>>;

    fn call(&self, request: Request<Incoming>) -> Self::Future {
        let counted = (self.lifecycle.exchange(), self.conn.request());
        let mut app = self.app.clone();
        Box::pin(async move {
            let response = app.call(request.map(Body::new)).await?;
            Ok(response.map(|body| CountedBody {
                body,
                _counted: counted,
            }))
        })
    }
}

/// A response body that keeps its exchange counted until hyper is done with it.
struct CountedBody {
    body: Body,
    _counted: (InFlight, BusyGuard),
}

impl hyper::body::Body for CountedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// Whether an accept error means the process is out of file descriptors.
fn out_of_descriptors(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE) | Some(libc::ENFILE))
}

/// Accepts connections until the task is dropped, each served on a task of its own.
pub async fn accept_loop(
    listener: TcpListener,
    app: axum::Router,
    lifecycle: Arc<Lifecycle>,
    connections: Arc<Connections>,
    settings: HttpSettings,
) {
    loop {
        let tcp = match listener.accept().await {
            Ok((tcp, _)) => tcp,
            Err(e) => {
                if out_of_descriptors(&e) && connections.evict_idle() {
                    tracing::warn!(error = %e, "out of file descriptors: closed an idle connection");
                } else {
                    tracing::debug!(error = %e, "accept failed");
                }
                // Give the closed connection's task a moment to release its descriptor.
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        // Tokens are small writes; do not let Nagle hold them back.
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "TCP_NODELAY");
        }
        let Some((id, conn)) = connections.admit() else {
            tokio::spawn(refuse(tcp, connections.len()));
            continue;
        };
        let service = ConnService {
            app: app.clone(),
            conn: Arc::clone(&conn),
            lifecycle: Arc::clone(&lifecycle),
        };
        let connections = Arc::clone(&connections);
        let settings = settings.clone();
        tokio::spawn(async move {
            serve_connection(tcp, service, &settings).await;
            connections.leave(id);
        });
    }
}

/// Answers a connection the server has no room for, and closes it.
async fn refuse(mut tcp: TcpStream, open: usize) {
    let error = ApiError::Unavailable(format!(
        "the server has {open} connections open, every one with a request in flight; retry \
         later"
    ));
    answer_and_close(&mut tcp, &error).await;
}

/// Writes `error`'s envelope as a whole response outside hyper, then closes the connection.
async fn answer_and_close(tcp: &mut TcpStream, error: &ApiError) {
    let answer = envelope_response(error);
    let _ = tokio::time::timeout(WRITE_GRACE, async {
        tcp.write_all(&answer).await?;
        tcp.shutdown().await
    })
    .await;
}

/// Serves one connection until it ends, is evicted, or the server closes it.
async fn serve_connection(tcp: TcpStream, service: ConnService, settings: &HttpSettings) {
    let conn_state = Arc::clone(&service.conn);
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(settings.header_timeout)
        .max_headers(MAX_HEADERS);
    let mut conn = builder.serve_connection(TokioIo::new(EnvelopeIo::new(tcp)), service);
    // A draining server is not told here: hyper's graceful shutdown would close a connection
    // whose request has arrived but not yet been read, and that client would get no answer.
    // Its responses say `Connection: close` instead, and the server closes what is left at
    // the end.
    let ended = tokio::select! {
        result = &mut conn => result,
        _ = conn_state.closed() => return,
    };
    if let Err(e) = ended
        && e.is_timeout()
    {
        // The head did not arrive in time. A client that sent part of one is told so; an
        // idle kept-alive connection is just closed, as clients expect.
        let parts = conn.into_parts();
        if !parts.read_buf.is_empty() {
            let error = ApiError::RequestTimeout(format!(
                "the request head did not arrive within {:?}; send the whole request at once",
                settings.header_timeout
            ));
            let mut io = parts.io.into_inner();
            answer_and_close(io.get_mut(), &error).await;
        }
    }
}
