//! TLS on the replica exchange (`--replica-exchange-tls`): mutual TLS pinned to the
//! `--cert-path` certificate that every replica shares (one Secret mounted in every pod). A
//! replica admits a peer, and a peer's client admits the replica it dials, only when the other
//! side presents exactly that certificate and proves it holds its key, so a client that
//! merely reaches the port cannot send records, and a replica cannot be impersonated.
//!
//! NOTE: pinning instead of a CA: the replicas' certificate is often self-issued for the
//! gateway (which does not verify it), and a CA would admit any certificate it ever signed.
//! While a rotated Secret reaches the replicas one by one, a pair that disagrees fails its
//! handshake and retries with backoff; records are lost meanwhile, never requests.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use hyper_util::rt::TokioIo;
use rustls::client::ResolvesClientCert;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::sign::CertifiedKey;
use rustls::{DigitallySignedStruct, DistinguishedName, SignatureScheme};
use tokio::net::TcpStream;
use tonic::codegen::http::Uri;

use crate::tls::CertResolver;

/// Admits exactly the certificate `resolver` serves now, on either side of a handshake.
#[derive(Debug)]
struct SameCert {
    resolver: Arc<CertResolver>,
    provider: Arc<CryptoProvider>,
}

impl SameCert {
    fn check(&self, end_entity: &CertificateDer<'_>) -> Result<(), rustls::Error> {
        match self.resolver.current().cert.first() {
            Some(own) if own.as_ref() == end_entity.as_ref() => Ok(()),
            _ => {
                tracing::debug!("replica exchange: the other side presented another certificate");
                Err(rustls::Error::InvalidCertificate(
                    rustls::CertificateError::ApplicationVerificationFailure,
                ))
            }
        }
    }

    fn tls12(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn tls13(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

impl ServerCertVerifier for SameCert {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.check(end_entity)
            .map(|()| ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.tls12(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.tls13(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.schemes()
    }
}

impl ClientCertVerifier for SameCert {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.check(end_entity)
            .map(|()| ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.tls12(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.tls13(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.schemes()
    }
}

/// Presents the replica's own (current) certificate as a client.
#[derive(Debug)]
struct OwnCert(Arc<CertResolver>);

impl ResolvesClientCert for OwnCert {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        Some(self.0.current())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// Both sides' TLS settings of the exchange, from the ext-proc port's certificate.
#[derive(Clone)]
pub struct ExchangeTls {
    /// The exchange server's config (client certificates required and pinned).
    pub server: Arc<rustls::ServerConfig>,
    /// The peer clients' config.
    pub client: Arc<rustls::ClientConfig>,
}

impl ExchangeTls {
    /// Both configs, pinned to what `resolver` serves (reloads included).
    pub fn new(resolver: &Arc<CertResolver>) -> Result<Self, rustls::Error> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let same = Arc::new(SameCert {
            resolver: Arc::clone(resolver),
            provider: Arc::clone(&provider),
        });
        let mut server =
            rustls::ServerConfig::builder_with_provider(Arc::clone(&provider))
                .with_safe_default_protocol_versions()?
                .with_client_cert_verifier(Arc::clone(&same) as Arc<dyn ClientCertVerifier>)
                .with_cert_resolver(
                    Arc::clone(resolver) as Arc<dyn rustls::server::ResolvesServerCert>
                );
        server.alpn_protocols = vec![b"h2".to_vec()];
        let mut client = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .dangerous()
            .with_custom_certificate_verifier(same)
            .with_client_cert_resolver(Arc::new(OwnCert(Arc::clone(resolver))));
        client.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Self {
            server: Arc::new(server),
            client: Arc::new(client),
        })
    }
}

/// A tonic connector dialling `host:port` over TLS with the exchange's client config.
#[derive(Clone)]
pub struct TlsConnect(pub Arc<rustls::ClientConfig>);

impl tonic::codegen::Service<Uri> for TlsConnect {
    type Response = TokioIo<tokio_rustls::client::TlsStream<TcpStream>>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, io::Error>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), io::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let connector = tokio_rustls::TlsConnector::from(Arc::clone(&self.0));
        Box::pin(async move {
            let bad = |what: &str| {
                io::Error::new(io::ErrorKind::InvalidInput, format!("{what} in {uri}"))
            };
            let host = uri
                .host()
                .map(|h| h.trim_start_matches('[').trim_end_matches(']').to_owned())
                .ok_or_else(|| bad("no host"))?;
            let port = uri.port_u16().ok_or_else(|| bad("no port"))?;
            let name = ServerName::try_from(host.clone()).map_err(|_| bad("a bad host"))?;
            let tcp = TcpStream::connect((host.as_str(), port)).await?;
            tcp.set_nodelay(true)?;
            Ok(TokioIo::new(connector.connect(name, tcp).await?))
        })
    }
}
