//! The OpenAI error envelope on the answers hyper writes by itself.
//!
//! hyper answers a request it cannot parse before any handler sees it: 400 for a malformed
//! request line or header, 414 for a request target over 64 KiB, 431 for too many or too
//! large headers. It writes a bare head (`content-length: 0`) and closes the connection, with
//! no hook to change the body. [`EnvelopeIo`] sits between hyper and the socket and swaps such
//! a head for the same status carrying the envelope. No handler of ours writes one: every
//! error response the API makes has a JSON body, so an empty 400/414/431 can only be hyper's.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::error::ApiError;

/// Header fields hyper accepts in one request head (its default, set explicitly).
pub const MAX_HEADERS: usize = 100;

/// What the client is told for each automatic answer.
fn automatic_error(status: u16) -> Option<ApiError> {
    Some(match status {
        400 => ApiError::bad_request(
            "malformed HTTP request: the request line or a header could not be parsed; send \
             an HTTP/1.1 request (method, path, version, then `Name: value` headers)",
        ),
        414 => ApiError::UriTooLong(
            "the request target is too long (at most 64 KiB); send large inputs in the JSON \
             body instead"
                .into(),
        ),
        431 => ApiError::HeadersTooLarge(format!(
            "the request headers are too large: at most {MAX_HEADERS} header fields and about \
             400 KiB of request head; send fewer or shorter headers"
        )),
        _ => return None,
    })
}

/// The status of `buf` when it is exactly one of hyper's automatic answers: a complete
/// response head for 400, 414 or 431 with `content-length: 0` and nothing after it.
fn automatic_status(buf: &[u8]) -> Option<u16> {
    let head = buf.strip_suffix(b"\r\n\r\n")?;
    if head.windows(4).any(|w| w == b"\r\n\r\n") {
        return None;
    }
    let head = std::str::from_utf8(head).ok()?;
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()?
        .strip_prefix("HTTP/1.1 ")?
        .get(..3)?
        .parse()
        .ok()?;
    automatic_error(status)?;
    lines
        .any(|line| line.eq_ignore_ascii_case("content-length: 0"))
        .then_some(status)
}

/// A complete HTTP/1.1 response carrying `error`'s envelope, closing the connection.
pub fn envelope_response(error: &ApiError) -> Vec<u8> {
    let status = error.status();
    let body = error.json();
    format!(
        "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         connection: close\r\n\r\n{body}",
        status.as_u16(),
        status.canonical_reason().unwrap_or(""),
        body.len()
    )
    .into_bytes()
}

/// A socket whose automatic hyper answers gain the error envelope (see the module doc).
#[derive(Debug)]
pub struct EnvelopeIo<T> {
    inner: T,
    /// A replacement answer not yet fully written, and how much of it is.
    pending: Option<(Vec<u8>, usize)>,
}

impl<T> EnvelopeIo<T> {
    /// Wraps `inner`.
    pub fn new(inner: T) -> Self {
        EnvelopeIo {
            inner,
            pending: None,
        }
    }

    /// The socket.
    pub fn get_mut(&mut self) -> &mut T {
        &mut self.inner
    }
}

impl<T: AsyncWrite + Unpin> EnvelopeIo<T> {
    /// Writes what is left of a replacement answer.
    fn poll_pending(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while let Some((bytes, written)) = &mut self.pending {
            if *written == bytes.len() {
                self.pending = None;
                break;
            }
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &bytes[*written..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            *written += n;
        }
        Poll::Ready(Ok(()))
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for EnvelopeIo<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for EnvelopeIo<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        ready!(self.poll_pending(cx))?;
        if let Some(error) = automatic_status(buf).and_then(automatic_error) {
            // hyper's whole answer is taken as written (so it is never offered again); ours
            // goes out in its place, the rest of it on the next write, flush or shutdown.
            self.pending = Some((envelope_response(&error), 0));
            if let Poll::Ready(Err(e)) = self.poll_pending(cx) {
                return Poll::Ready(Err(e));
            }
            return Poll::Ready(Ok(buf.len()));
        }
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_pending(cx))?;
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_pending(cx))?;
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn only_bare_automatic_heads_are_recognized() {
        let date = "date: Tue, 01 Dec 2026 09:00:02 GMT";
        for status in [
            "400 Bad Request",
            "414 URI Too Long",
            "431 Request Header Fields Too Large",
        ] {
            let head = format!(
                "HTTP/1.1 {status}\r\nconnection: close\r\ncontent-length: 0\r\n{date}\r\n\r\n"
            );
            assert!(automatic_status(head.as_bytes()).is_some(), "{head}");
        }
        for other in [
            // Ours: a body follows, or the length is not 0.
            format!("HTTP/1.1 400 Bad Request\r\ncontent-length: 2\r\n{date}\r\n\r\n{{}}"),
            format!("HTTP/1.1 400 Bad Request\r\ncontent-length: 20\r\n{date}\r\n\r\n"),
            // Another status, or only part of a head.
            format!("HTTP/1.1 200 OK\r\ncontent-length: 0\r\n{date}\r\n\r\n"),
            format!("HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n{date}\r\n\r\n"),
            "HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n".to_string(),
            "HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\nHTTP/1.1 400 x\r\n\r\n"
                .to_string(),
        ] {
            assert_eq!(automatic_status(other.as_bytes()), None, "{other}");
        }
    }

    #[tokio::test]
    async fn an_automatic_answer_is_replaced_and_everything_else_passes_through() {
        let (client, server) = tokio::io::duplex(64);
        let mut io = EnvelopeIo::new(server);
        let writer = tokio::spawn(async move {
            io.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                .await
                .unwrap();
            let bare = b"HTTP/1.1 431 Request Header Fields Too Large\r\nconnection: close\r\ncontent-length: 0\r\n\r\n";
            // Accepted whole, though the replacement is longer than the pipe.
            assert_eq!(io.write(bare).await.unwrap(), bare.len());
            io.shutdown().await.unwrap();
        });
        let mut out = String::new();
        let mut client = client;
        client.read_to_string(&mut out).await.unwrap();
        writer.await.unwrap();
        let (first, second) = out.split_at(out.find("HTTP/1.1 431").unwrap());
        assert_eq!(first, "HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n");
        let (head, body) = second.split_once("\r\n\r\n").unwrap();
        assert!(head.contains("content-type: application/json"), "{head}");
        assert!(
            head.contains(&format!("content-length: {}", body.len())),
            "{head}"
        );
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["code"], 431);
        assert_eq!(v["error"]["type"], "RequestHeaderFieldsTooLargeError");
    }
}
