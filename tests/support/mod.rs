//! Real processes and servers for end-to-end tests: HTTP model-server stand-ins, the kvpick
//! binary, and a real Envoy built from `deploy/envoy/envoy.yaml`.
//!
//! Envoy comes from the project's venv (`scripts/setup-envoy.sh`, run by `scripts/test.sh`)
//! or from `KVPICK_ENVOY`. A missing Envoy fails the test loudly: an e2e test that silently
//! skips proves nothing.

#![allow(dead_code)]

pub mod backend;
pub mod envoy;
pub mod extproc;
pub mod http;
pub mod kv_reference;
pub mod kvpick;
pub mod log_tail;
pub mod metrics;
pub mod paths;
pub mod sim_pod;
pub mod zmtp_peer;

use std::net::TcpListener;
use std::time::{Duration, Instant};

#[allow(unused_imports)] // each test binary uses some of them
pub use paths::{fixtures, repo_root, workspace_bin};

/// A port free right now on 127.0.0.1.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// Polls `check` until it is true (`true`) or `child` exits (`false`: e.g. a port found free
/// was taken by another test's process before the child bound it); panics after `limit`.
pub async fn ready_or_exited<F, Fut>(
    what: &str,
    child: &mut std::process::Child,
    limit: Duration,
    mut check: F,
) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    loop {
        if check().await {
            return true;
        }
        if child.try_wait().expect("try_wait").is_some() {
            eprintln!("{what}: the process exited while starting");
            return false;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Polls `check` until it is true or `limit` passes; readiness of real processes only.
pub async fn wait_until<F, Fut>(what: &str, limit: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if check().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("timed out waiting for {what}");
}
