//! TLS on the ext-proc port (`--secure-serving`, `--cert-path`, `--enable-cert-reload`)
//! through the real `kvpick serve` binary: a real Envoy routes over TLS to it, a rustls
//! client checks the certificate served (self-signed, from files, and after the files
//! change), and bad flags or files are start-up errors naming them.

use crate::support;

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use support::backend::{Backend, pool_yaml};
use support::envoy::{Envoy, EnvoyOptions};
use support::http::{post_json, send};
use support::kvpick::Kvpick;

/// Accepts any certificate (as gateways do for the EPP's self-signed one) but records it,
/// and still checks the handshake signature against it (which parses the certificate).
#[derive(Debug)]
pub(crate) struct Recorder {
    pub(crate) seen: Mutex<Option<Vec<u8>>>,
    pub(crate) provider: rustls::crypto::CryptoProvider,
}

impl ServerCertVerifier for Recorder {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        *self.seen.lock().expect("lock") = Some(end_entity.to_vec());
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
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

    fn verify_tls13_signature(
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

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// Handshakes with `port` and returns the certificate served and the ALPN protocol chosen.
async fn handshake(port: u16) -> Result<(Vec<u8>, Option<Vec<u8>>), String> {
    handshake_with(port, rustls::DEFAULT_VERSIONS).await
}

/// [`handshake`], offering only these TLS versions.
async fn handshake_with(
    port: u16,
    versions: &[&'static rustls::SupportedProtocolVersion],
) -> Result<(Vec<u8>, Option<Vec<u8>>), String> {
    let provider = rustls::crypto::ring::default_provider();
    let recorder = Arc::new(Recorder {
        seen: Mutex::new(None),
        provider: provider.clone(),
    });
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(provider))
        .with_protocol_versions(versions)
        .map_err(|e| e.to_string())?
        .dangerous()
        .with_custom_certificate_verifier(recorder.clone())
        .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| e.to_string())?;
    let name = ServerName::try_from("localhost").map_err(|e| e.to_string())?;
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
        .map_err(|e| e.to_string())?;
    let alpn = tls.get_ref().1.alpn_protocol().map(<[u8]>::to_vec);
    let seen = recorder.seen.lock().expect("lock").clone();
    Ok((seen.ok_or("no certificate")?, alpn))
}

fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

fn pem(label: &str, der: &[u8]) -> String {
    let body = base64(der);
    let lines: Vec<&str> = body
        .as_bytes()
        .chunks(64)
        .map(|c| std::str::from_utf8(c).expect("ascii"))
        .collect();
    format!(
        "-----BEGIN {label}-----\n{}\n-----END {label}-----\n",
        lines.join("\n")
    )
}

/// Writes a fresh pair into `dir` and returns its certificate's DER.
pub(crate) fn write_pair(dir: &Path) -> Vec<u8> {
    let (cert, key) = kvpick::tls::self_signed::generate().expect("certificate");
    let PrivateKeyDer::Pkcs8(key) = key else {
        panic!("a PKCS#8 key")
    };
    std::fs::write(
        dir.join("tls.key"),
        pem("PRIVATE KEY", key.secret_pkcs8_der()),
    )
    .expect("key");
    std::fs::write(dir.join("tls.crt"), pem("CERTIFICATE", &cert)).expect("cert");
    cert.to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_min_version_13_refuses_tls_12_clients() {
    // llm-d's `--tls-min-version` (README "llm-d's flags").
    let backend = Backend::start("127.0.0.1").await;
    let pool = pool_yaml(&[&backend]);
    let tls13 = Kvpick::start(
        &pool,
        &["--secure-serving", "--tls-min-version=VersionTLS13"],
    )
    .await;
    let refused = handshake_with(tls13.grpc_port, &[&rustls::version::TLS12]).await;
    assert!(refused.is_err(), "a TLS 1.2 client is refused: {refused:?}");
    handshake_with(tls13.grpc_port, &[&rustls::version::TLS13])
        .await
        .expect("TLS 1.3 is served");
    // Without the flag, TLS 1.2 is served too.
    let default = Kvpick::start(&pool, &["--secure-serving"]).await;
    handshake_with(default.grpc_port, &[&rustls::version::TLS12])
        .await
        .expect("TLS 1.2 is served by default");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn self_signed_tls_carries_envoys_ext_proc_streams() {
    let backend = Backend::start("127.0.0.1").await;
    let kvpick = Kvpick::start(&pool_yaml(&[&backend]), &["--secure-serving"]).await;
    let (cert, alpn) = handshake(kvpick.grpc_port).await.expect("TLS handshake");
    assert!(cert.len() > 100, "a certificate is served");
    assert_eq!(alpn.as_deref(), Some(&b"h2"[..]), "gRPC's ALPN");

    let envoy = Envoy::start(
        &kvpick,
        EnvoyOptions {
            kvpick_tls: true,
            ..EnvoyOptions::default()
        },
    )
    .await;
    let reply = post_json(
        &envoy.url("/v1/completions"),
        br#"{"model":"m","prompt":"hello"}"#,
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(backend.seen().len(), 1, "routed through kvpick over TLS");
    assert!(
        kvpick
            .metric("kvpick_tls_handshakes_total{result=\"ok\"}")
            .await
            >= 2.0
    );

    // A plaintext client is refused (its bytes are not a TLS ClientHello).
    let plain = send(
        "GET",
        &format!("http://127.0.0.1:{}/", kvpick.grpc_port),
        &[],
        Vec::new(),
    )
    .await;
    assert!(
        plain.is_err(),
        "plaintext got {:?}",
        plain.map(|r| r.status)
    );
    support::wait_until(
        "the failed handshake is counted",
        Duration::from_secs(5),
        || async {
            kvpick
                .metric("kvpick_tls_handshakes_total{result=\"failed\"}")
                .await
                >= 1.0
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificate_files_are_served_and_reloaded_when_they_change() {
    let backend = Backend::start("127.0.0.1").await;
    let dir = tempfile::tempdir().expect("tempdir");
    let first = write_pair(dir.path());
    let cert_path = dir.path().display().to_string();
    let kvpick = Kvpick::start(
        &pool_yaml(&[&backend]),
        &[
            "--secure-serving",
            "--cert-path",
            &cert_path,
            "--enable-cert-reload",
        ],
    )
    .await;
    assert_eq!(
        handshake(kvpick.grpc_port).await.expect("handshake").0,
        first
    );

    // A broken certificate file: rejected, counted, the last good pair stays.
    std::fs::write(dir.path().join("tls.crt"), "not a certificate").expect("write");
    support::wait_until(
        "the bad file is counted",
        Duration::from_secs(10),
        || async {
            kvpick
                .metric("kvpick_tls_cert_reloads_total{result=\"invalid\"}")
                .await
                >= 1.0
        },
    )
    .await;
    assert_eq!(
        handshake(kvpick.grpc_port).await.expect("handshake").0,
        first
    );

    // A new pair is served from the next handshake on, without a restart.
    let second = write_pair(dir.path());
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let served = handshake(kvpick.grpc_port).await.expect("handshake").0;
        if served == second {
            break;
        }
        assert_eq!(served, first, "either pair, nothing else");
        assert!(
            Instant::now() < deadline,
            "the new certificate was not served"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        kvpick
            .metric("kvpick_tls_cert_reloads_total{result=\"ok\"}")
            .await
            >= 1.0
    );
}

#[test]
fn tls_flags_and_files_are_checked_at_start() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = dir.path().join("pool.yaml");
    std::fs::write(&pool, "endpoints:\n  - address: 127.0.0.1:8000\n").expect("pool");
    let pool = pool.display().to_string();
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).expect("dir");
    let empty = empty.display().to_string();
    let cases: [(Vec<&str>, &str); 4] = [
        (
            vec!["--cert-path", &empty],
            "--cert-path: needs --secure-serving",
        ),
        (
            vec!["--secure-serving", "--enable-cert-reload"],
            "--enable-cert-reload: needs --cert-path",
        ),
        (
            vec!["--secure-serving=false", "--enable-cert-reload"],
            "--enable-cert-reload",
        ),
        (vec!["--secure-serving", "--cert-path", &empty], "tls.crt"),
    ];
    for (args, want) in cases {
        // Port 0: a refusal must come from the flags, never from a port another test holds.
        let base = [
            "--bind-address",
            "127.0.0.1",
            "--endpoints-file",
            &pool,
            "--grpc-port",
            "0",
            "--grpc-health-port",
            "0",
            "--metrics-port",
            "0",
            "--debug-port",
            "0",
        ];
        let stderr = support::kvpick::serve_refused(&[&base[..], &args[..]].concat(), &[]);
        assert!(stderr.contains(want), "{args:?}: stderr {stderr}");
    }
}
