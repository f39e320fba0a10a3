//! HTTP/1.1 connections to one server, kept alive between requests: hyper's connection API
//! under a small pool of idle connections. The pool is afd-loadtest's own, not a pooling
//! client's, because its retry rule needs what such a client hides: whether a request went out
//! on a reused connection, and whether any byte came back on it before the request failed.
//!
//! The rule: a server may close a kept-alive connection at any moment (llama.cpp's
//! llama-server does, between requests and without `Connection: close`), and a request written
//! into a connection the server is closing fails with no answer at all. So a request that fails
//! on a reused connection before one byte arrived on it is sent once more on a fresh
//! connection, and counted as retried. One that fails after bytes arrived, or on a fresh
//! connection, or by timing out, is never sent again: the server did answer it, or a new
//! connection would meet the same fate.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::client::conn::http1::{self, SendRequest};
use hyper::{Method, Request, Response, Uri, body::Incoming, header};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::{Instant, timeout_at};

use crate::error::Error;

/// The longest wait for a TCP connection (a server that takes longer is not listening).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// A request that failed to get an answer's head, in words that say what to check.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TransportError {
    /// No TCP connection could be made.
    #[error("could not connect to {url} ({reason}); is the server running there?")]
    Connect {
        /// The request URL.
        url: String,
        /// The operating system's or the timeout's reason.
        reason: String,
    },
    /// The request's time limit ran out.
    #[error(
        "timed out talking to {url} (no complete answer within {seconds} s); raise \
         --request-timeout if the server is just slow"
    )]
    Timeout {
        /// The request URL.
        url: String,
        /// The limit.
        seconds: f64,
    },
    /// The connection failed while sending the request or reading the answer.
    #[error("request to {url} failed ({reason})")]
    Exchange {
        /// The request URL.
        url: String,
        /// hyper's reason and its causes.
        reason: String,
    },
}

/// Why [`ConnectionPool::send`] got no answer, and whether it had tried a second connection.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{error}{}", if *.retried { "; it was the second try, on a fresh connection, after a kept-alive one failed before answering" } else { "" })]
pub struct SendError {
    /// The (last) attempt's failure.
    pub error: TransportError,
    /// The request was sent again on a fresh connection.
    pub retried: bool,
}

/// One request to send.
#[derive(Debug, Clone)]
pub struct HttpRequest {
    /// `GET` or `POST`.
    pub method: Method,
    /// Path and query, e.g. `/v1/completions`.
    pub path: String,
    /// Sent as `Authorization: Bearer ...`.
    pub bearer: Option<String>,
    /// A JSON body (sent with `Content-Type: application/json`).
    pub json: Option<Bytes>,
}

/// An answer whose head has arrived; read its body, then hand `connection` back with
/// [`ConnectionPool::keep`] if the body ended cleanly.
#[derive(Debug)]
pub struct Answer {
    /// Status, headers and the body still to be read.
    pub response: Response<Incoming>,
    /// The connection the answer is coming on.
    pub connection: Connection,
    /// The request went out a second time, on a fresh connection.
    pub retried: bool,
}

/// One HTTP/1.1 connection and the count of bytes the server has sent on it.
#[derive(Debug)]
pub struct Connection {
    sender: SendRequest<Full<Bytes>>,
    received: Arc<AtomicU64>,
    reused: bool,
}

impl Connection {
    fn received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }
}

/// Idle kept-alive connections to one server (cheap to clone: clones share the pool).
#[derive(Clone)]
pub struct ConnectionPool {
    inner: Arc<PoolInner>,
}

struct PoolInner {
    host: String,
    port: u16,
    /// `host[:port]` as written in the URL, for the `Host` header.
    authority: String,
    /// `http://authority`, for messages.
    origin: String,
    /// The base URL's path without a trailing `/` (empty for the server root).
    base_path: String,
    connect_timeout: Duration,
    request_timeout: Duration,
    idle: Mutex<Vec<Connection>>,
}

impl std::fmt::Debug for ConnectionPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectionPool")
            .field("origin", &self.inner.origin)
            .finish_non_exhaustive()
    }
}

impl ConnectionPool {
    /// A pool for the server at `base_url` (`http://host[:port][/prefix]`; the prefix is the
    /// caller's to put in request paths) whose requests must be answered within
    /// `request_timeout` (connecting within 30 s of it).
    pub fn new(base_url: &str, request_timeout: Duration) -> Result<Self, Error> {
        let bad = |reason: String| {
            Error::HttpClient(format!(
                "--base-url '{base_url}' is not a usable http:// URL ({reason})"
            ))
        };
        let uri: Uri = base_url.parse().map_err(|e| bad(format!("{e}")))?;
        if uri.scheme_str() != Some("http") {
            return Err(bad("it must start with http://".into()));
        }
        let authority = uri
            .authority()
            .ok_or_else(|| bad("it names no host".into()))?
            .clone();
        let host = authority.host().trim_matches(['[', ']']).to_string();
        Ok(ConnectionPool {
            inner: Arc::new(PoolInner {
                host,
                port: authority.port_u16().unwrap_or(80),
                origin: format!("http://{authority}"),
                base_path: uri.path().trim_end_matches('/').to_string(),
                authority: authority.to_string(),
                connect_timeout: CONNECT_TIMEOUT.min(request_timeout),
                request_timeout,
                idle: Mutex::new(Vec::new()),
            }),
        })
    }

    /// When a request started now must have its whole answer.
    pub fn deadline(&self) -> Instant {
        Instant::now() + self.inner.request_timeout
    }

    /// The error of a request to `path` that ran past its deadline.
    pub fn timed_out(&self, path: &str) -> TransportError {
        TransportError::Timeout {
            url: self.url(path),
            seconds: self.inner.request_timeout.as_secs_f64(),
        }
    }

    /// The base URL's path, to put before request paths (empty for the server root).
    pub fn base_path(&self) -> &str {
        &self.inner.base_path
    }

    /// The full URL of `path`, for messages.
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.inner.origin)
    }

    /// Sends `request` on an idle connection (or a new one) and waits for the answer's head,
    /// at most until `deadline`; retried once on a fresh connection by the rule in the module
    /// doc.
    pub async fn send(
        &self,
        request: &HttpRequest,
        deadline: Instant,
    ) -> Result<Answer, SendError> {
        let failed = |retried| move |error| SendError { error, retried };
        let connection = self
            .checkout(&request.path, deadline)
            .await
            .map_err(failed(false))?;
        match self.exchange(connection, request, deadline).await {
            Ok((response, connection)) => Ok(Answer {
                response,
                connection,
                retried: false,
            }),
            Err(failure) if !failure.repeatable => Err(failed(false)(failure.error)),
            Err(_) => {
                let connection = self
                    .connect(&request.path, deadline)
                    .await
                    .map_err(failed(true))?;
                let (response, connection) = self
                    .exchange(connection, request, deadline)
                    .await
                    .map_err(|f| failed(true)(f.error))?;
                Ok(Answer {
                    response,
                    connection,
                    retried: true,
                })
            }
        }
    }

    /// Puts a connection whose answer was read to its end back for the next request.
    pub fn keep(&self, mut connection: Connection) {
        if connection.sender.is_closed() {
            return;
        }
        connection.reused = true;
        self.inner
            .idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(connection);
    }

    /// The most recently used idle connection that is still open, else a new one.
    async fn checkout(&self, path: &str, deadline: Instant) -> Result<Connection, TransportError> {
        loop {
            let idle = self
                .inner
                .idle
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .pop();
            match idle {
                Some(connection) if !connection.sender.is_closed() => return Ok(connection),
                Some(_closed) => continue,
                None => break,
            }
        }
        self.connect(path, deadline).await
    }

    async fn connect(&self, path: &str, deadline: Instant) -> Result<Connection, TransportError> {
        let inner = &self.inner;
        let failed = |reason: String| TransportError::Connect {
            url: self.url(path),
            reason,
        };
        let connect_by = Instant::now() + inner.connect_timeout;
        let connecting = TcpStream::connect((inner.host.as_str(), inner.port));
        let stream = match timeout_at(deadline.min(connect_by), connecting).await {
            Ok(Ok(stream)) => stream,
            Ok(Err(e)) => return Err(failed(e.to_string())),
            Err(_) if connect_by <= deadline => {
                return Err(failed(format!(
                    "no connection within {} s",
                    inner.connect_timeout.as_secs_f64()
                )));
            }
            Err(_) => return Err(self.timed_out(path)),
        };
        // Without Nagle's delay each small request goes out at once; if the option cannot be
        // set the connection still works, only slower.
        let _ = stream.set_nodelay(true);
        let received = Arc::new(AtomicU64::new(0));
        let io = TokioIo::new(CountingStream {
            stream,
            received: Arc::clone(&received),
        });
        let (sender, driver) = http1::handshake(io)
            .await
            .map_err(|e| failed(error_chain(&e)))?;
        // The driver reads and writes the socket; its errors reach the request it was serving.
        tokio::spawn(async move {
            let _ = driver.await;
        });
        Ok(Connection {
            sender,
            received,
            reused: false,
        })
    }

    /// One attempt on `connection`; a failure says whether the rule allows a second one.
    async fn exchange(
        &self,
        mut connection: Connection,
        request: &HttpRequest,
        deadline: Instant,
    ) -> Result<(Response<Incoming>, Connection), AttemptFailure> {
        let url = self.url(&request.path);
        let final_failure = |error| AttemptFailure {
            error,
            repeatable: false,
        };
        let built = self.build(request).map_err(|e| {
            final_failure(TransportError::Exchange {
                url: url.clone(),
                reason: format!("the request could not be built: {e}; check --api-key"),
            })
        })?;
        let received_before = connection.received();
        let answer = timeout_at(deadline, async {
            connection.sender.ready().await?;
            connection.sender.send_request(built).await
        })
        .await;
        match answer {
            Ok(Ok(response)) => Ok((response, connection)),
            Ok(Err(e)) => Err(AttemptFailure {
                repeatable: connection.reused && connection.received() == received_before,
                error: TransportError::Exchange {
                    url,
                    reason: error_chain(&e),
                },
            }),
            Err(_) => Err(final_failure(self.timed_out(&request.path))),
        }
    }

    fn build(&self, request: &HttpRequest) -> Result<Request<Full<Bytes>>, hyper::http::Error> {
        let mut builder = Request::builder()
            .method(request.method.clone())
            .uri(request.path.as_str())
            .header(header::HOST, self.inner.authority.as_str())
            .header(
                header::USER_AGENT,
                concat!("afd-loadtest/", env!("CARGO_PKG_VERSION")),
            );
        if let Some(key) = &request.bearer {
            builder = builder.header(header::AUTHORIZATION, format!("Bearer {key}"));
        }
        let body = match &request.json {
            Some(json) => {
                builder = builder.header(header::CONTENT_TYPE, "application/json");
                Full::new(json.clone())
            }
            None => Full::new(Bytes::new()),
        };
        builder.body(body)
    }
}

/// One failed attempt and whether the retry rule allows another on a fresh connection.
struct AttemptFailure {
    error: TransportError,
    repeatable: bool,
}

/// A TCP stream that counts the bytes read from it (the retry rule's "no byte arrived").
struct CountingStream {
    stream: TcpStream,
    received: Arc<AtomicU64>,
}

impl AsyncRead for CountingStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let poll = Pin::new(&mut self.stream).poll_read(cx, buf);
        let read = buf.filled().len().saturating_sub(before);
        self.received.fetch_add(read as u64, Ordering::Relaxed);
        poll
    }
}

impl AsyncWrite for CountingStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// An error and its sources joined with `: `, skipping repeats.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut parts: Vec<String> = vec![e.to_string()];
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        source = s.source();
    }
    parts.join(": ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(url: &str) -> Result<ConnectionPool, Error> {
        ConnectionPool::new(url, Duration::from_secs(60))
    }

    #[test]
    fn base_urls_give_host_port_and_path_prefix() {
        let p = pool("http://127.0.0.1:8000").unwrap();
        assert_eq!((p.inner.host.as_str(), p.inner.port), ("127.0.0.1", 8000));
        assert_eq!(p.base_path(), "");
        assert_eq!(p.url("/v1/models"), "http://127.0.0.1:8000/v1/models");

        let p = pool("http://example.invalid/prefix/").unwrap();
        assert_eq!(
            (p.inner.host.as_str(), p.inner.port),
            ("example.invalid", 80)
        );
        assert_eq!(p.base_path(), "/prefix");
        assert_eq!(p.inner.authority, "example.invalid");

        let p = pool("http://[::1]:9000").unwrap();
        assert_eq!((p.inner.host.as_str(), p.inner.port), ("::1", 9000));
        assert_eq!(p.inner.authority, "[::1]:9000");
    }

    #[test]
    fn unusable_base_urls_say_why() {
        for (url, why) in [
            ("https://x", "http://"),
            ("127.0.0.1:8000", "http://"),
            ("http://", "not a usable"),
        ] {
            let text = pool(url).unwrap_err().to_string();
            assert!(text.contains(why) && text.contains(url), "{url}: {text}");
        }
    }

    #[test]
    fn the_connect_limit_is_at_most_the_request_limit() {
        let p = ConnectionPool::new("http://x", Duration::from_secs(2)).unwrap();
        assert_eq!(p.inner.connect_timeout, Duration::from_secs(2));
        let p = ConnectionPool::new("http://x", Duration::from_secs(3600)).unwrap();
        assert_eq!(p.inner.connect_timeout, CONNECT_TIMEOUT);
        let text = p.timed_out("/v1/completions").to_string();
        assert!(
            text.contains("3600 s") && text.contains("--request-timeout"),
            "{text}"
        );
    }

    #[test]
    fn a_retried_failure_says_so() {
        let error = TransportError::Exchange {
            url: "http://x/v1/completions".into(),
            reason: "connection reset".into(),
        };
        let once = SendError {
            error: error.clone(),
            retried: false,
        };
        assert_eq!(
            once.to_string(),
            "request to http://x/v1/completions failed (connection reset)"
        );
        let twice = SendError {
            error,
            retried: true,
        };
        assert!(
            twice
                .to_string()
                .contains("second try, on a fresh connection")
        );
    }
}
