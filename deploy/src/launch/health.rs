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

/// Whether the process answers its health check now; the reason when it does not.
pub async fn probe(check: &HealthCheck) -> Result<(), String> {
    match tokio::time::timeout(PROBE_TIMEOUT, probe_once(check)).await {
        Ok(result) => result,
        Err(_) => Err(format!(
            "no answer within {} s",
            PROBE_TIMEOUT.as_secs_f64()
        )),
    }
}

async fn probe_once(check: &HealthCheck) -> Result<(), String> {
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
                .map_err(|s| s.message().to_owned())
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
                .map_err(|s| s.message().to_owned())?
                .into_inner();
            if reply.ready {
                Ok(())
            } else {
                Err(reply.status)
            }
        }
        HealthCheck::Http { address, path } => match http_status(address, path).await? {
            200 => Ok(()),
            status => Err(format!("GET {path} answered {status}")),
        },
    }
}

/// A control-plane channel to node `server` at `address`, as node `me` of `certs`.
async fn connect(
    address: &str,
    server: &str,
    certs: &std::path::Path,
    me: &str,
) -> Result<tonic::transport::Channel, String> {
    let identity = jetstream::NodeIdentity::read_pem(certs, me).map_err(|e| e.to_string())?;
    // A probe's outcome is only logged while waiting: text is all it needs.
    control_plane::connect(&grpc_url(address), server, &identity)
        .await
        .map_err(|e| e.to_string())
}

/// The status code of `GET path` on `address` (HTTP/1.1, `Connection: close`).
async fn http_status(address: &str, path: &str) -> Result<u16, String> {
    let mut stream = tokio::net::TcpStream::connect(address)
        .await
        .map_err(|e| e.to_string())?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n");
    stream
        .write_all(request.as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    let mut head = Vec::new();
    let mut buf = [0u8; 256];
    // The status line is all we need.
    while !head.contains(&b'\n') {
        let n = stream.read(&mut buf).await.map_err(|e| e.to_string())?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
    }
    parse_status_line(&head).ok_or_else(|| {
        format!(
            "not an HTTP answer: {:?}",
            String::from_utf8_lossy(&head[..head.len().min(80)])
        )
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
            assert!(probe(&check).await.is_err(), "{check:?}");
        }
    }
}
