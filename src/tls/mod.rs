//! TLS on the ext-proc gRPC port (`--secure-serving`, `--cert-path`, `--enable-cert-reload`,
//! llm-d's flags): the certificate from `DIR/tls.crt` and `DIR/tls.key`, or a self-signed one
//! made at start; reloaded when the files change.
//!
//! [`self_signed`] makes the certificate, [`reload`] holds the current one (a rustls
//! certificate resolver that the reload task swaps), [`incoming`] turns accepted TCP
//! connections into TLS connections for tonic, handshaking each on its own task.

pub mod incoming;
pub mod reload;
pub mod self_signed;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::sign::CertifiedKey;

pub use incoming::{Conn, TlsMetrics, incoming};
pub use reload::CertResolver;

/// The validated TLS settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsConfig {
    /// `--cert-path`: the directory with `tls.crt` and `tls.key` (`None`: self-signed).
    pub cert_path: Option<PathBuf>,
    /// `--enable-cert-reload`: watch the files and use a new pair when they change.
    pub reload: bool,
    /// `--tls-min-version=VersionTLS13`: TLS 1.3 only (otherwise 1.2 and 1.3).
    pub tls13_only: bool,
}

/// Why TLS could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A certificate or key file cannot be read or parsed.
    #[error("{path}: {reason}")]
    File {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The key does not fit the certificate, or rustls refuses it.
    #[error("{0}")]
    Key(String),
    /// No self-signed certificate could be made.
    #[error(transparent)]
    SelfSigned(#[from] self_signed::SelfSignedError),
}

/// The certificate file's name in `--cert-path`.
pub const CERT_FILE: &str = "tls.crt";
/// The key file's name in `--cert-path`.
pub const KEY_FILE: &str = "tls.key";

/// Reads and checks the pair in `dir` (`tls.crt`: the chain, leaf first; `tls.key`: PKCS#8,
/// PKCS#1 or SEC1 PEM).
pub fn load_pair(dir: &Path) -> Result<CertifiedKey, TlsError> {
    let (cert_path, key_path) = (dir.join(CERT_FILE), dir.join(KEY_FILE));
    let fail = |path: &Path, reason: String| TlsError::File {
        path: path.to_owned(),
        reason,
    };
    let cert_pem = std::fs::read(&cert_path).map_err(|e| fail(&cert_path, e.to_string()))?;
    let key_pem = std::fs::read(&key_path).map_err(|e| fail(&key_path, e.to_string()))?;
    let chain = CertificateDer::pem_slice_iter(&cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| fail(&cert_path, e.to_string()))?;
    if chain.is_empty() {
        return Err(fail(&cert_path, "no PEM certificate".to_owned()));
    }
    let key =
        PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| fail(&key_path, e.to_string()))?;
    certified(chain, key)
}

/// A chain and its key as rustls signs with them; the key must match the leaf.
pub fn certified(
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<CertifiedKey, TlsError> {
    let provider = rustls::crypto::ring::default_provider();
    CertifiedKey::from_der(chain, key, &provider).map_err(|e| TlsError::Key(e.to_string()))
}

/// The first pair: from `--cert-path`, else a fresh self-signed one.
pub fn initial_pair(config: &TlsConfig) -> Result<CertifiedKey, TlsError> {
    match &config.cert_path {
        Some(dir) => load_pair(dir),
        None => {
            let (cert, key) = self_signed::generate()?;
            certified(vec![cert], key)
        }
    }
}

/// A rustls server config that takes its certificate from `resolver` and speaks HTTP/2
/// (gRPC) over ALPN.
pub fn server_config(
    resolver: Arc<CertResolver>,
    tls13_only: bool,
) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let versions: &[&rustls::SupportedProtocolVersion] = if tls13_only {
        &[&rustls::version::TLS13]
    } else {
        rustls::DEFAULT_VERSIONS
    };
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_protocol_versions(versions)
    .map_err(|e| TlsError::Key(e.to_string()))?
    .with_no_client_auth()
    .with_cert_resolver(resolver);
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(config))
}
