//! The cluster's certificates: a cluster CA and one certificate per node, whose only name
//! (DNS SAN and common name) is the node name. Made in memory (rcgen) for embedded use, or
//! written to and read from a directory of PEM files for deployments:
//!
//! | file              | contents                                                        |
//! |-------------------|-----------------------------------------------------------------|
//! | `ca.pem`          | the cluster CA certificate (every node needs it)               |
//! | `ca.key.pem`      | the CA's private key (only to issue more node certificates)    |
//! | `NODE.pem`        | the node's certificate                                         |
//! | `NODE.key.pem`    | the node's private key (give it to that node only)             |

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

use crate::error::{Error, Result};
use crate::transport::validate_node_name;

const CA_NAME: &str = "afd cluster CA";
const CA_CERT_FILE: &str = "ca.pem";
const CA_KEY_FILE: &str = "ca.key.pem";

fn cert_error(what: &'static str) -> impl FnOnce(rcgen::Error) -> Error {
    move |source| Error::CertificateKey { what, source }
}

/// The CA parameters are fixed, so a CA loaded back from its key and certificate issues
/// certificates that chain to it exactly like the original.
fn ca_params() -> CertificateParams {
    let mut params = CertificateParams::default();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, CA_NAME);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params
}

/// The cluster certificate authority: it signs every node certificate, and every node trusts
/// exactly it.
pub struct ClusterCa {
    key: KeyPair,
    certificate: CertificateDer<'static>,
}

impl std::fmt::Debug for ClusterCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterCa").finish_non_exhaustive()
    }
}

impl ClusterCa {
    /// Makes a new CA with a fresh key.
    pub fn generate() -> Result<Self> {
        let key = KeyPair::generate().map_err(cert_error("generating the CA key"))?;
        let certificate = ca_params()
            .self_signed(&key)
            .map_err(cert_error("signing the CA certificate"))?;
        Ok(Self {
            key,
            certificate: certificate.der().clone(),
        })
    }

    /// The CA certificate (DER).
    pub fn certificate(&self) -> &CertificateDer<'static> {
        &self.certificate
    }

    /// Issues the certificate of node `node`: its DNS SAN and common name are the node name,
    /// valid for both TLS server and client authentication.
    pub fn issue(&self, node: &str) -> Result<NodeIdentity> {
        validate_node_name(node)?;
        let key = KeyPair::generate().map_err(cert_error("generating a node key"))?;
        let mut params = CertificateParams::new(vec![node.to_owned()])
            .map_err(cert_error("node certificate name"))?;
        params.distinguished_name.push(DnType::CommonName, node);
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.use_authority_key_identifier_extension = true;
        let issuer = Issuer::new(ca_params(), &self.key);
        let certificate = params
            .signed_by(&key, &issuer)
            .map_err(cert_error("signing a node certificate"))?;
        Ok(NodeIdentity {
            node: node.to_owned(),
            certificate: certificate.der().clone(),
            key: PrivatePkcs8KeyDer::from(key.serialize_der()),
            ca: self.certificate.clone(),
        })
    }

    /// Writes `ca.pem` and `ca.key.pem` into `dir` (created if missing).
    pub fn write_pem(&self, dir: &Path) -> Result<()> {
        create_dir(dir)?;
        write_file(
            &dir.join(CA_CERT_FILE),
            &pem("CERTIFICATE", &self.certificate),
            false,
        )?;
        write_file(&dir.join(CA_KEY_FILE), &self.key.serialize_pem(), true)
    }

    /// Loads a CA written by [`ClusterCa::write_pem`].
    pub fn read_pem(dir: &Path) -> Result<Self> {
        let key_text = read_file(&dir.join(CA_KEY_FILE))?;
        let key = KeyPair::from_pem(&String::from_utf8_lossy(&key_text))
            .map_err(cert_error("reading ca.key.pem"))?;
        let certificate = read_certificate(&dir.join(CA_CERT_FILE))?;
        Ok(Self { key, certificate })
    }
}

/// What one node needs for mutual TLS: its certificate and key, and the cluster CA.
#[derive(Debug)]
pub struct NodeIdentity {
    /// The node name (the certificate's only name).
    pub node: String,
    /// The node certificate (DER), signed by the cluster CA.
    pub certificate: CertificateDer<'static>,
    /// The node's private key (PKCS#8 DER).
    pub key: PrivatePkcs8KeyDer<'static>,
    /// The cluster CA certificate this node trusts.
    pub ca: CertificateDer<'static>,
}

impl Clone for NodeIdentity {
    fn clone(&self) -> Self {
        Self {
            node: self.node.clone(),
            certificate: self.certificate.clone(),
            key: self.key.clone_key(),
            ca: self.ca.clone(),
        }
    }
}

impl NodeIdentity {
    /// The private key in the form rustls takes.
    pub fn private_key(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::Pkcs8(self.key.clone_key())
    }

    /// Writes `NODE.pem` and `NODE.key.pem` into `dir` (created if missing).
    pub fn write_pem(&self, dir: &Path) -> Result<()> {
        create_dir(dir)?;
        write_file(
            &dir.join(format!("{}.pem", self.node)),
            &pem("CERTIFICATE", &self.certificate),
            false,
        )?;
        write_file(
            &dir.join(format!("{}.key.pem", self.node)),
            &pem("PRIVATE KEY", self.key.secret_pkcs8_der()),
            true,
        )
    }

    /// Loads node `node`'s identity from a directory made by [`write_cluster`].
    pub fn read_pem(dir: &Path, node: &str) -> Result<Self> {
        validate_node_name(node)?;
        let certificate = read_certificate(&dir.join(format!("{node}.pem")))?;
        let key_path = dir.join(format!("{node}.key.pem"));
        let key = match PrivateKeyDer::from_pem_slice(&read_file(&key_path)?) {
            Ok(PrivateKeyDer::Pkcs8(key)) => key,
            Ok(_) => {
                return Err(Error::Certificate(format!(
                    "{}: expected a PKCS#8 private key",
                    key_path.display()
                )));
            }
            Err(source) => {
                return Err(Error::Pem {
                    path: key_path.display().to_string(),
                    source,
                });
            }
        };
        let ca = read_certificate(&dir.join(CA_CERT_FILE))?;
        Ok(Self {
            node: node.to_owned(),
            certificate,
            key,
            ca,
        })
    }
}

/// Writes a cluster's certificates into `dir`: the CA (made now, or reused when `dir` already
/// holds one, so nodes can be added later) and one certificate per node. Returns the files
/// written.
pub fn write_cluster(dir: &Path, nodes: &[String]) -> Result<Vec<PathBuf>> {
    if nodes.is_empty() {
        return Err(Error::Certificate(
            "no node names given: pass at least one, e.g. --nodes attn,card-0".into(),
        ));
    }
    for node in nodes {
        validate_node_name(node)?;
    }
    let mut written = Vec::new();
    let ca = if dir.join(CA_CERT_FILE).exists() {
        ClusterCa::read_pem(dir)?
    } else {
        let ca = ClusterCa::generate()?;
        ca.write_pem(dir)?;
        written.extend([dir.join(CA_CERT_FILE), dir.join(CA_KEY_FILE)]);
        ca
    };
    for node in nodes {
        ca.issue(node)?.write_pem(dir)?;
        written.extend([
            dir.join(format!("{node}.pem")),
            dir.join(format!("{node}.key.pem")),
        ]);
    }
    Ok(written)
}

fn pem(label: &str, der: &[u8]) -> String {
    const LINE: usize = 64;
    let encoded = base64_encode(der);
    let mut out = format!("-----BEGIN {label}-----\n");
    for line in encoded.as_bytes().chunks(LINE) {
        out.push_str(&String::from_utf8_lossy(line));
        out.push('\n');
    }
    out.push_str(&format!("-----END {label}-----\n"));
    out
}

fn base64_encode(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for group in bytes.chunks(3) {
        let word = (u32::from(group[0]) << 16)
            | (u32::from(*group.get(1).unwrap_or(&0)) << 8)
            | u32::from(*group.get(2).unwrap_or(&0));
        for index in 0..4 {
            if index <= group.len() {
                out.push(ALPHABET[(word >> (18 - 6 * index)) as usize & 63] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

fn read_certificate(path: &Path) -> Result<CertificateDer<'static>> {
    CertificateDer::from_pem_slice(&read_file(path)?).map_err(|source| Error::Pem {
        path: path.display().to_string(),
        source,
    })
}

fn create_dir(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|source| Error::Io {
        path: dir.display().to_string(),
        source,
    })
}

fn read_file(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|source| Error::Io {
        path: path.display().to_string(),
        source,
    })
}

fn write_file(path: &Path, contents: &str, secret: bool) -> Result<()> {
    let io = |source| Error::Io {
        path: path.display().to_string(),
        source,
    };
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    if secret {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    #[cfg(not(unix))]
    let _ = secret;
    let mut file = options.open(path).map_err(io)?;
    std::io::Write::write_all(&mut file, contents.as_bytes()).map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_known_vectors() {
        for (input, expected) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64_encode(input.as_bytes()), expected);
        }
    }

    #[test]
    fn cluster_round_trips_through_pem_files() {
        let dir = tempfile::tempdir().unwrap();
        let nodes = vec!["attn".to_owned(), "card-0".to_owned()];
        let written = write_cluster(dir.path(), &nodes).unwrap();
        assert_eq!(written.len(), 6);
        for path in &written {
            assert!(path.exists(), "{}", path.display());
        }
        let identity = NodeIdentity::read_pem(dir.path(), "card-0").unwrap();
        assert_eq!(identity.node, "card-0");
        let ca = ClusterCa::read_pem(dir.path()).unwrap();
        assert_eq!(&identity.ca, ca.certificate());
        crate::tls::verify_peer_name(std::slice::from_ref(&identity.certificate), "card-0")
            .unwrap();
        assert!(
            crate::tls::verify_peer_name(std::slice::from_ref(&identity.certificate), "attn")
                .is_err()
        );

        // Adding a node later reuses the CA.
        write_cluster(dir.path(), &["card-1".to_owned()]).unwrap();
        let later = NodeIdentity::read_pem(dir.path(), "card-1").unwrap();
        assert_eq!(later.ca, identity.ca);
    }

    #[test]
    fn bad_inputs_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        assert!(write_cluster(dir.path(), &[]).is_err());
        assert!(matches!(
            write_cluster(dir.path(), &["bad name".to_owned()]),
            Err(Error::InvalidNodeName { .. })
        ));
        assert!(matches!(
            NodeIdentity::read_pem(dir.path(), "missing"),
            Err(Error::Io { .. })
        ));
    }
}
