//! The current certificate, swapped by the reload task when `--cert-path`'s files change.
//!
//! NOTE: the files are polled (contents compared once a second) rather than watched with
//! inotify: Kubernetes updates a mounted Secret by swapping a symlinked directory, which a
//! content comparison always sees, and it needs no new dependency.

use std::path::PathBuf;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio_util::sync::CancellationToken;

use super::{CERT_FILE, KEY_FILE, load_pair};

/// How often `--enable-cert-reload` looks at the files.
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(1);

/// Serves every handshake the current certificate.
#[derive(Debug)]
pub struct CertResolver {
    current: RwLock<Arc<CertifiedKey>>,
}

impl CertResolver {
    /// A resolver serving `pair`.
    pub fn new(pair: CertifiedKey) -> Self {
        Self {
            current: RwLock::new(Arc::new(pair)),
        }
    }

    /// The pair served now.
    pub fn current(&self) -> Arc<CertifiedKey> {
        Arc::clone(&self.current.read().unwrap_or_else(PoisonError::into_inner))
    }

    /// Serves `pair` from the next handshake on.
    pub fn set(&self, pair: CertifiedKey) {
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(pair);
    }
}

impl ResolvesServerCert for CertResolver {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(Arc::clone(
            &self.current.read().unwrap_or_else(PoisonError::into_inner),
        ))
    }
}

fn contents(dir: &std::path::Path) -> Option<(Vec<u8>, Vec<u8>)> {
    Some((
        std::fs::read(dir.join(CERT_FILE)).ok()?,
        std::fs::read(dir.join(KEY_FILE)).ok()?,
    ))
}

/// Polls `dir` until `cancel`; a changed, valid pair is served from the next handshake, an
/// invalid one is logged and counted (`failures`) and the last good pair stays.
pub async fn watch_files(
    dir: PathBuf,
    resolver: Arc<CertResolver>,
    reloads: prometheus::IntCounterVec,
    cancel: CancellationToken,
) {
    let mut seen = contents(&dir);
    let mut tick = tokio::time::interval(RELOAD_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        let now = contents(&dir);
        if now.is_none() || now == seen {
            continue;
        }
        seen = now;
        let dir2 = dir.clone();
        match tokio::task::spawn_blocking(move || load_pair(&dir2)).await {
            Ok(Ok(pair)) => {
                resolver.set(pair);
                reloads.with_label_values(&["ok"]).inc();
                tracing::info!(dir = %dir.display(), "TLS certificate reloaded");
            }
            Ok(Err(error)) => {
                reloads.with_label_values(&["invalid"]).inc();
                tracing::warn!(%error, dir = %dir.display(), "new TLS certificate rejected; keeping the last good one");
            }
            Err(_) => reloads.with_label_values(&["invalid"]).inc(),
        }
    }
}
