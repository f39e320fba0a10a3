//! Mutual TLS from the cluster CA: the rustls configurations quinn runs on (and, with ALPN `h2`,
//! the gRPC control plane's), the check that a peer's claimed node name is the name in its
//! certificate, and reading that name from a verified certificate.

use std::sync::Arc;

use rustls::RootCertStore;
use rustls::crypto::CryptoProvider;
use rustls::server::{ParsedCertificate, WebPkiClientVerifier};
use rustls_pki_types::{CertificateDer, ServerName};

use crate::certs::NodeIdentity;
use crate::error::{Error, Result};

/// ALPN protocol id; a peer speaking anything else fails the handshake.
pub(crate) const ALPN: &[u8] = b"jetstream/1";

/// ring's provider with AES-128-GCM first: all TLS 1.3 suites stay allowed, but this one
/// (mandatory in TLS 1.3, ten AES rounds instead of fourteen) is picked between our nodes,
/// which saves a good part of the per-byte cost of a bulk transfer.
fn provider() -> Arc<CryptoProvider> {
    let mut provider = rustls::crypto::ring::default_provider();
    provider
        .cipher_suites
        .sort_by_key(|suite| suite.suite() != rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
    Arc::new(provider)
}

fn roots(identity: &NodeIdentity) -> Result<Arc<RootCertStore>> {
    let mut roots = RootCertStore::empty();
    roots
        .add(identity.ca.clone())
        .map_err(|source| Error::TlsSetup {
            what: "the cluster CA certificate",
            source,
        })?;
    Ok(Arc::new(roots))
}

/// ALPN protocol id of the gRPC control plane (HTTP/2 over TLS).
const CONTROL_ALPN: &[u8] = b"h2";

/// Server side: presents the node certificate and requires a client certificate signed by the
/// cluster CA.
pub(crate) fn server_config(identity: &NodeIdentity) -> Result<rustls::ServerConfig> {
    server_config_for(identity, ALPN)
}

/// Client side: trusts only the cluster CA and presents the node certificate.
pub(crate) fn client_config(identity: &NodeIdentity) -> Result<rustls::ClientConfig> {
    client_config_for(identity, ALPN)
}

/// The gRPC control plane's server configuration: JetStream's mutual TLS (the node's
/// certificate, client certificates from the cluster CA required), speaking `h2`.
pub fn control_server_config(identity: &NodeIdentity) -> Result<rustls::ServerConfig> {
    server_config_for(identity, CONTROL_ALPN)
}

/// The gRPC control plane's client configuration: trusts only the cluster CA, presents the
/// node's certificate, speaks `h2`.
pub fn control_client_config(identity: &NodeIdentity) -> Result<rustls::ClientConfig> {
    client_config_for(identity, CONTROL_ALPN)
}

fn server_config_for(identity: &NodeIdentity, alpn: &[u8]) -> Result<rustls::ServerConfig> {
    let tls = |source| Error::TlsSetup {
        what: "server configuration",
        source,
    };
    let verifier = WebPkiClientVerifier::builder_with_provider(roots(identity)?, provider())
        .build()
        .map_err(Error::TlsVerifier)?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(vec![identity.certificate.clone()], identity.private_key())
        .map_err(tls)?;
    config.alpn_protocols = vec![alpn.to_vec()];
    Ok(config)
}

fn client_config_for(identity: &NodeIdentity, alpn: &[u8]) -> Result<rustls::ClientConfig> {
    let tls = |source| Error::TlsSetup {
        what: "client configuration",
        source,
    };
    let mut config = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls)?
        .with_root_certificates(roots(identity)?)
        .with_client_auth_cert(vec![identity.certificate.clone()], identity.private_key())
        .map_err(tls)?;
    config.alpn_protocols = vec![alpn.to_vec()];
    Ok(config)
}

/// The node name of a peer whose chain the TLS handshake verified against the cluster CA: the
/// end-entity certificate's DNS name (a node certificate has exactly one, see
/// [`crate::ClusterCa::issue`]), checked with [`verify_peer_name`].
pub fn peer_node_name(chain: &[CertificateDer<'_>]) -> Result<String> {
    let end_entity = chain
        .first()
        .ok_or_else(|| Error::Certificate("the peer presented no certificate".into()))?;
    let parsed = webpki::EndEntityCert::try_from(end_entity).map_err(|error| {
        Error::Certificate(format!("the peer certificate does not parse: {error}"))
    })?;
    let mut names = parsed.valid_dns_names();
    let (Some(name), None) = (names.next(), names.next()) else {
        return Err(Error::Certificate(
            "the peer certificate does not name exactly one node (was it made by `afd certs`?)"
                .into(),
        ));
    };
    let name = name.to_owned();
    verify_peer_name(chain, &name)?;
    Ok(name)
}

/// Checks that the peer's (already CA-verified) end-entity certificate carries `claimed` as a
/// name, so a node cannot act under another node's name.
pub fn verify_peer_name(chain: &[CertificateDer<'_>], claimed: &str) -> Result<()> {
    let end_entity = chain
        .first()
        .ok_or_else(|| Error::Certificate("the peer presented no certificate".into()))?;
    let parsed =
        ParsedCertificate::try_from(end_entity).map_err(|source| Error::PeerCertificate {
            what: "the peer certificate does not parse".into(),
            source,
        })?;
    let name = ServerName::try_from(claimed).map_err(|_| Error::InvalidNodeName {
        name: claimed.to_owned(),
    })?;
    rustls::client::verify_server_name(&parsed, &name).map_err(|source| Error::PeerCertificate {
        what: format!("the peer claims to be `{claimed}` but its certificate is not for that name"),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ClusterCa;

    #[test]
    fn a_node_certificate_names_its_node_and_nothing_else_passes_for_it() {
        let ca = ClusterCa::generate().unwrap();
        let node = ca.issue("card-3").unwrap();
        let chain = [node.certificate.clone()];
        assert_eq!(peer_node_name(&chain).unwrap(), "card-3");
        assert!(verify_peer_name(&chain, "card-4").is_err());
        assert!(peer_node_name(&[]).is_err());
        // Both control-plane configurations build from the identity and speak h2.
        assert_eq!(
            control_server_config(&node).unwrap().alpn_protocols,
            [b"h2"]
        );
        assert_eq!(
            control_client_config(&node).unwrap().alpn_protocols,
            [b"h2"]
        );
    }
}
