//! TLS on the replica exchange (`--replica-exchange-tls`) through the real binary: two
//! replicas sharing a `--cert-path` certificate exchange over mutual TLS pinned to it; a
//! plaintext client and a TLS client presenting another certificate are refused.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvpick::replica::proto::replica_exchange_client::ReplicaExchangeClient;
use kvpick::replica::proto::{Batch, RoutingRecord};
use rustls::pki_types::PrivateKeyDer;
use rustls::pki_types::pem::PemObject;

use crate::replica_exchange::exchange_port;
use crate::support;
use crate::tls_extproc::{Recorder, write_pair};
use support::backend::{Backend, pool_yaml};
use support::kvpick::Kvpick;

/// Sends one batch with one record over `channel`: whether the peer took it.
async fn exchange(channel: tonic::transport::Channel, endpoint: &str) -> bool {
    let batch = Batch {
        replica: "intruder".into(),
        records: vec![RoutingRecord {
            endpoint: endpoint.to_owned(),
            block_size: 16,
            block_keys: vec![1, 2, 3],
        }],
        in_flight: vec![],
    };
    ReplicaExchangeClient::new(channel)
        .exchange(tokio_stream::iter([batch]))
        .await
        .is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_sharing_a_certificate_exchange_over_mutual_tls_and_refuse_others() {
    let backends = [
        Backend::start("127.0.0.1").await,
        Backend::start("127.0.0.1").await,
    ];
    let pool = pool_yaml(&backends.iter().collect::<Vec<_>>());
    let shared = tempfile::tempdir().expect("tempdir");
    write_pair(shared.path());
    let dir = shared.path().display().to_string();
    let (port_a, port_b) = (exchange_port(), exchange_port());
    let replica = |own: u16, peer: u16| {
        [
            "--secure-serving".to_owned(),
            "--cert-path".to_owned(),
            dir.clone(),
            "--replica-exchange-port".to_owned(),
            own.to_string(),
            "--replica-peers".to_owned(),
            format!("127.0.0.1:{peer}"),
            "--replica-exchange-tls".to_owned(),
        ]
    };
    let (args_a, args_b) = (replica(port_a, port_b), replica(port_b, port_a));
    let args_a: Vec<&str> = args_a.iter().map(String::as_str).collect();
    let args_b: Vec<&str> = args_b.iter().map(String::as_str).collect();
    let (a, b) = tokio::join!(Kvpick::start(&pool, &args_a), Kvpick::start(&pool, &args_b));
    let received = "kvpick_replica_batches_total{direction=\"received\"}";
    // Each dials the other over TLS and gets its heartbeats (one a second at least).
    for kvpick in [&a, &b] {
        support::wait_until(
            "a TLS stream to the peer",
            Duration::from_secs(10),
            || async {
                kvpick.metric("kvpick_replica_peers_connected").await == 1.0
                    && kvpick.metric(received).await >= 1.0
            },
        )
        .await;
    }
    let good = backends[0].addr.to_string();
    let url = format!("http://127.0.0.1:{port_b}");
    let endpoint = tonic::transport::Endpoint::from_shared(url).expect("endpoint");

    // A plaintext client is refused (no TLS handshake).
    let plain = match endpoint.connect().await {
        Ok(channel) => exchange(channel, &good).await,
        Err(_) => false,
    };
    assert!(!plain, "a plaintext client must not reach the exchange");

    // A TLS client that accepts B's certificate but presents another one is refused by B.
    let other = tempfile::tempdir().expect("tempdir");
    write_pair(other.path());
    let cert = std::fs::read(other.path().join("tls.crt")).expect("cert");
    let key = std::fs::read(other.path().join("tls.key")).expect("key");
    let certs = vec![rustls::pki_types::CertificateDer::from_pem_slice(&cert).expect("pem")];
    let key = PrivateKeyDer::from_pem_slice(&key).expect("key pem");
    let provider = rustls::crypto::ring::default_provider();
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(provider.clone()))
        .with_safe_default_protocol_versions()
        .expect("versions")
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(Recorder {
            seen: Mutex::new(None),
            provider,
        }))
        .with_client_auth_cert(certs, key)
        .expect("client cert");
    config.alpn_protocols = vec![b"h2".to_vec()];
    let failed = "kvpick_tls_handshakes_total{result=\"failed\"}";
    let failed_before = b.metric(failed).await;
    let connector = kvpick::replica::tls::TlsConnect(Arc::new(config));
    let stranger = match endpoint.connect_with_connector(connector).await {
        Ok(channel) => exchange(channel, &good).await,
        Err(_) => false,
    };
    assert!(
        !stranger,
        "a client with another certificate must not reach the exchange"
    );
    support::wait_until(
        "B to count the refused handshake",
        Duration::from_secs(5),
        || async { b.metric(failed).await > failed_before },
    )
    .await;
    assert_eq!(
        b.metric("kvpick_replica_records_total{direction=\"received\"}")
            .await,
        0.0,
        "no record from either client was applied"
    );
    // A and B still exchange.
    let before = b.metric(received).await;
    support::wait_until(
        "the next heartbeat from A",
        Duration::from_secs(5),
        || async { b.metric(received).await > before },
    )
    .await;
}

#[test]
fn exchange_tls_needs_a_shared_certificate() {
    for (args, want) in [
        (
            vec!["--replica-exchange-port", "9010", "--replica-exchange-tls"],
            "--replica-exchange-tls: needs --secure-serving with --cert-path",
        ),
        (
            vec![
                "--secure-serving",
                "--replica-exchange-port",
                "9010",
                "--replica-exchange-tls",
            ],
            "--replica-exchange-tls: needs --secure-serving with --cert-path",
        ),
        (
            vec!["--replica-exchange-tls"],
            "--replica-exchange-tls: needs --replica-exchange-port",
        ),
    ] {
        let stderr = support::kvpick::serve_refused(
            &[&["--endpoints-file", "pool.yaml"], &args[..]].concat(),
            &[],
        );
        assert!(stderr.contains(want), "{args:?}: stderr {stderr}");
    }
}
