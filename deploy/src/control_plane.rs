//! The gRPC control plane's security. Every tonic service (a card's `Card`, an attention node's
//! `Attention`, and the standard health service beside them) is served over TLS 1.3 with client
//! certificates from the cluster CA, with the identities JetStream uses (`afd certs`, read by
//! [`jetstream::NodeIdentity`], configured by [`jetstream::control_server_config`]); there is
//! no plaintext mode.
//!
//! A node's role is the form of its certificate's only name, which afd gives every node and
//! which the CA signed: `card-K` is a card, `attn-J` an attention node, `frontend` a frontend
//! ([`Role::of`]). A card answers attention nodes only (so `LoadShard` comes only from an
//! attention node of the same cluster); an attention node answers frontends only; the health
//! service answers any node of the cluster. A peer whose certificate another CA signed fails
//! the handshake; one of the wrong role gets `PERMISSION_DENIED` naming its role. Clients check
//! the server's certificate against the node name they expect (`card-K`, `attn-J`), whatever
//! host name they dialled.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use jetstream::NodeIdentity;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::{TlsAcceptor, TlsConnector};
use tonic::transport::server::Connected;
use tonic::{Request, Status};

use crate::error::{Error, Result};

/// What a node is, as its certificate names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// `card-K`.
    Card,
    /// `attn-J`.
    Attention,
    /// `frontend`.
    Frontend,
}

impl Role {
    /// The role of node `name`; `None` for a name afd gives no node.
    pub fn of(name: &str) -> Option<Role> {
        let numbered = |prefix: &str| {
            name.strip_prefix(prefix)
                .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        };
        if numbered("card-") {
            Some(Role::Card)
        } else if numbered("attn-") {
            Some(Role::Attention)
        } else if name == "frontend" {
            Some(Role::Frontend)
        } else {
            None
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Role::Card => "card",
            Role::Attention => "attention node",
            Role::Frontend => "frontend",
        })
    }
}

/// The peer of a control-plane connection: the node its verified certificate names.
#[derive(Debug, Clone)]
pub struct Peer {
    /// Its node name (`card-0`, `attn-1`, `frontend`).
    pub name: String,
    /// Where it connected from.
    pub addr: SocketAddr,
}

/// An accepted connection whose TLS handshake verified the client's certificate.
pub struct TlsConnection {
    io: tokio_rustls::server::TlsStream<TcpStream>,
    peer: Peer,
}

impl Connected for TlsConnection {
    type ConnectInfo = Peer;

    fn connect_info(&self) -> Peer {
        self.peer.clone()
    }
}

impl AsyncRead for TlsConnection {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for TlsConnection {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// How long a client has to complete its TLS handshake (a stalled one holds nothing else up:
/// each handshake runs in its own task).
const HANDSHAKE_WITHIN: Duration = Duration::from_secs(10);

/// The connections tonic serves, in the form `serve_with_incoming_shutdown` takes.
pub type Incoming = tokio_stream::wrappers::ReceiverStream<std::io::Result<TlsConnection>>;

/// Listens on `listen` (call inside the runtime that will serve) and yields the connections
/// whose handshake with `identity`'s mutual TLS succeeded; refused ones are logged and dropped.
/// Stops accepting once the stream is dropped.
pub async fn incoming(listen: SocketAddr, identity: &NodeIdentity) -> Result<Incoming> {
    let config = jetstream::control_server_config(identity)?;
    let acceptor = TlsAcceptor::from(Arc::new(config));
    let listener = TcpListener::bind(listen)
        .await
        .map_err(Error::system(format!("cannot listen on {listen}")))?;
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    tokio::spawn(async move {
        loop {
            let (tcp, addr) = tokio::select! {
                _ = tx.closed() => break,
                accepted = listener.accept() => match accepted {
                    Ok(pair) => pair,
                    Err(e) => {
                        // Out of descriptors and the like: wait rather than spin.
                        tracing::warn!("control plane on {listen}: accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let _ = tcp.set_nodelay(true);
            let (acceptor, tx) = (acceptor.clone(), tx.clone());
            tokio::spawn(async move {
                let refused = |why: String| {
                    tracing::warn!("control plane on {listen}: refused {addr}: {why}");
                };
                let io = match tokio::time::timeout(HANDSHAKE_WITHIN, acceptor.accept(tcp)).await {
                    Ok(Ok(io)) => io,
                    Ok(Err(e)) => return refused(format!("TLS handshake failed: {e}")),
                    Err(_) => {
                        return refused(format!("no TLS handshake within {HANDSHAKE_WITHIN:?}"));
                    }
                };
                let chain = io.get_ref().1.peer_certificates().unwrap_or_default();
                match jetstream::peer_node_name(chain) {
                    Ok(name) => {
                        let peer = Peer { name, addr };
                        let _ = tx.send(Ok(TlsConnection { io, peer })).await;
                    }
                    Err(e) => refused(e.to_string()),
                }
            });
        }
    });
    Ok(tokio_stream::wrappers::ReceiverStream::new(rx))
}

/// A tonic interceptor that lets through calls from nodes of role `allowed` only (any role of
/// the cluster when `None`): wrap a service in it with
/// `tonic::service::interceptor::InterceptedService::new(service, only(...))`.
pub fn only(
    allowed: Option<Role>,
) -> impl Fn(Request<()>) -> std::result::Result<Request<()>, Status> + Clone + Send + Sync {
    move |request: Request<()>| {
        let Some(peer) = request.extensions().get::<Peer>() else {
            return Err(Status::unauthenticated(
                "no verified client certificate: connect over TLS with a certificate of the \
                 cluster CA (`afd certs`)",
            ));
        };
        match (Role::of(&peer.name), allowed) {
            (Some(_), None) => Ok(request),
            (Some(role), Some(want)) if role == want => Ok(request),
            (role, want) => Err(Status::permission_denied(format!(
                "`{}` ({}) may not call this service{}",
                peer.name,
                role.map_or_else(|| "no afd role".to_owned(), |r| format!("a {r}")),
                want.map_or_else(String::new, |w| format!("; it answers {w}s only"))
            ))),
        }
    }
}

/// Serves `service` (whose callers must be of role `callers`) and the standard gRPC health
/// service (any node of the cluster) on the connections of `incoming` until `stop` resolves.
pub async fn serve<S>(
    service: S,
    callers: Role,
    incoming: Incoming,
    stop: impl std::future::Future<Output = ()>,
) -> std::result::Result<(), tonic::transport::Error>
where
    S: tonic::server::NamedService
        + tower::Service<
            tonic::codegen::http::Request<tonic::body::Body>,
            Response = tonic::codegen::http::Response<tonic::body::Body>,
            Error = std::convert::Infallible,
        > + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    use tonic::service::interceptor::InterceptedService;
    tonic::transport::Server::builder()
        .add_service(InterceptedService::new(service, only(Some(callers))))
        .add_service(InterceptedService::new(
            tonic_health::server::health_reporter().1,
            only(None),
        ))
        .serve_with_incoming_shutdown(incoming, stop)
        .await
}

/// A channel to the node `server` (its expected certificate name, e.g. `card-0`) at `url`
/// (`http://host:port`), authenticated as `identity`. Connects now; the channel reconnects by
/// itself after a failure.
pub async fn connect(
    url: &str,
    server: &str,
    identity: &NodeIdentity,
) -> Result<tonic::transport::Channel> {
    let (endpoint, connector) = endpoint_and_connector(url, server, identity)?;
    endpoint
        .connect_with_connector(connector)
        .await
        .map_err(|source| Error::Connect {
            url: url.to_owned(),
            source,
        })
}

type Connector = tower::util::BoxCloneSyncService<
    tonic::codegen::http::Uri,
    hyper_util::rt::TokioIo<tokio_rustls::client::TlsStream<TcpStream>>,
    std::io::Error,
>;

fn endpoint_and_connector(
    url: &str,
    server: &str,
    identity: &NodeIdentity,
) -> Result<(tonic::transport::Endpoint, Connector)> {
    let endpoint = tonic::transport::Endpoint::from_shared(url.to_owned())
        .map_err(|e| Error::Config(format!("bad control-plane address {url}: {e}")))?;
    let config = jetstream::control_client_config(identity)?;
    let tls = TlsConnector::from(Arc::new(config));
    let name = rustls_pki_types::ServerName::try_from(server.to_owned())
        .map_err(|e| Error::Config(format!("`{server}` is no node name: {e}")))?;
    let connector = tower::service_fn(move |uri: tonic::codegen::http::Uri| {
        let (tls, name) = (tls.clone(), name.clone());
        async move {
            let invalid = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidInput, what);
            let host = uri
                .host()
                .ok_or_else(|| invalid("no host in the address"))?;
            let port = uri
                .port_u16()
                .ok_or_else(|| invalid("no port in the address"))?;
            let tcp = TcpStream::connect((host.trim_matches(['[', ']']), port)).await?;
            tcp.set_nodelay(true)?;
            let stream = tls.connect(name, tcp).await?;
            Ok(hyper_util::rt::TokioIo::new(stream))
        }
    });
    Ok((endpoint, tower::util::BoxCloneSyncService::new(connector)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_are_read_from_the_names_afd_gives() {
        assert_eq!(Role::of("card-0"), Some(Role::Card));
        assert_eq!(Role::of("card-17"), Some(Role::Card));
        assert_eq!(Role::of("attn-2"), Some(Role::Attention));
        assert_eq!(Role::of("frontend"), Some(Role::Frontend));
        for other in [
            "card-",
            "card-x",
            "attn",
            "attn-1a",
            "frontend-0",
            "cards-1",
            "",
        ] {
            assert_eq!(Role::of(other), None, "{other}");
        }
    }
}
