//! Asking one process whether it is ready: the card's and the attention node's gRPC `Health`,
//! the frontend's `GET /health`.

use std::time::Duration;

use proto::control::HealthRequest;
use proto::control::attention_client::AttentionClient;
use proto::control::card_client::CardClient;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::plan::HealthCheck;
use crate::cluster::{FRONTEND_NAME, attention_name, card_name};
use crate::control_plane;
use crate::remote::grpc_url;

/// How long one probe may take before it counts as "not yet".
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// Why a process is not ready (yet). Only logged while the launcher waits, and quoted in the
/// error when it waited too long.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// Nothing answered within [`PROBE_TIMEOUT`].
    #[error("no answer within {} s", PROBE_TIMEOUT.as_secs_f64())]
    Timeout,
    /// The node's certificate or key could not be read.
    #[error("reading this node's certificate: {0}")]
    Identity(#[source] jetstream::Error),
    /// The control-plane connection failed.
    #[error("connecting: {0}")]
    Connect(#[source] Box<crate::error::Error>),
    /// The gRPC health call failed.
    #[error("health call: {0}")]
    Rpc(#[source] Box<tonic::Status>),
    /// The process answered that it is not ready, and why.
    #[error("{0}")]
    NotReady(String),
    /// The HTTP exchange failed.
    #[error("GET {path}: {source}")]
    Http {
        /// The path asked for.
        path: String,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
    /// The answer was not HTTP.
    #[error("not an HTTP answer: {0:?}")]
    NotHttp(String),
    /// The HTTP answer was not 200.
    #[error("GET {path} answered {status}")]
    Status {
        /// The path asked for.
        path: String,
        /// The status it answered.
        status: u16,
    },
}

/// Whether the process answers its health check now; the reason when it does not.
pub async fn probe(check: &HealthCheck) -> Result<(), ProbeError> {
    match tokio::time::timeout(PROBE_TIMEOUT, probe_once(check)).await {
        Ok(result) => result,
        Err(_) => Err(ProbeError::Timeout),
    }
}

async fn probe_once(check: &HealthCheck) -> Result<(), ProbeError> {
    match check {
        HealthCheck::Card {
            address,
            index,
            certs,
        } => {
            let channel = connect(address, &card_name(*index), certs, &attention_name(0)).await?;
            CardClient::new(channel)
                .health(HealthRequest {})
                .await
                .map(|_| ())
                .map_err(|s| ProbeError::Rpc(Box::new(s)))
        }
        HealthCheck::Attention {
            address,
            index,
            certs,
        } => {
            let channel = connect(address, &attention_name(*index), certs, FRONTEND_NAME).await?;
            let reply = AttentionClient::new(channel)
                .health(HealthRequest {})
                .await
                .map_err(|s| ProbeError::Rpc(Box::new(s)))?
                .into_inner();
            if reply.ready {
                Ok(())
            } else {
                Err(ProbeError::NotReady(reply.status))
            }
        }
        HealthCheck::Http { address, path } => match http_status(address, path).await? {
            200 => Ok(()),
            status => Err(ProbeError::Status {
                path: path.clone(),
                status,
            }),
        },
    }
}

/// A control-plane channel to node `server` at `address`, as node `me` of `certs`.
async fn connect(
    address: &str,
    server: &str,
    certs: &std::path::Path,
    me: &str,
) -> Result<tonic::transport::Channel, ProbeError> {
    let identity = jetstream::NodeIdentity::read_pem(certs, me).map_err(ProbeError::Identity)?;
    control_plane::connect(&grpc_url(address), server, &identity)
        .await
        .map_err(|e| ProbeError::Connect(Box::new(e)))
}

/// The status code of `GET path` on `address` (HTTP/1.1, `Connection: close`).
async fn http_status(address: &str, path: &str) -> Result<u16, ProbeError> {
    let io = |source| ProbeError::Http {
        path: path.to_string(),
        source,
    };
    let mut stream = tokio::net::TcpStream::connect(address).await.map_err(io)?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.map_err(io)?;
    let mut head = Vec::new();
    let mut buf = [0u8; 256];
    // The status line is all we need.
    while !head.contains(&b'\n') {
        let n = stream.read(&mut buf).await.map_err(io)?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
    }
    parse_status_line(&head).ok_or_else(|| {
        ProbeError::NotHttp(String::from_utf8_lossy(&head[..head.len().min(80)]).into_owned())
    })
}

/// `HTTP/1.1 200 OK` -> 200.
fn parse_status_line(head: &[u8]) -> Option<u16> {
    let line = std::str::from_utf8(head).ok()?.lines().next()?;
    let mut parts = line.split_whitespace();
    parts.next().filter(|v| v.starts_with("HTTP/"))?;
    parts.next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_lines() {
        assert_eq!(parse_status_line(b"HTTP/1.1 200 OK\r\n"), Some(200));
        assert_eq!(
            parse_status_line(b"HTTP/1.1 503 Service Unavailable\r\nx"),
            Some(503)
        );
        assert_eq!(parse_status_line(b"SSH-2.0-OpenSSH\r\n"), None);
        assert_eq!(parse_status_line(b""), None);
    }

    #[tokio::test]
    async fn nothing_listening_is_not_healthy() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let address = format!("127.0.0.1:{port}");
        let certs = tempfile::tempdir().unwrap();
        jetstream::write_cluster(certs.path(), &["attn-0".into(), "frontend".into()]).unwrap();
        let certs = certs.path().to_path_buf();
        for check in [
            HealthCheck::Card {
                address: address.clone(),
                index: 0,
                certs: certs.clone(),
            },
            HealthCheck::Attention {
                address: address.clone(),
                index: 0,
                certs,
            },
            HealthCheck::Http {
                address: address.clone(),
                path: "/health".into(),
            },
        ] {
            let err = probe(&check).await.unwrap_err();
            assert!(
                matches!(
                    err,
                    ProbeError::Rpc(_) | ProbeError::Connect(_) | ProbeError::Http { .. }
                ),
                "{check:?}: {err:?}"
            );
        }
    }
}
