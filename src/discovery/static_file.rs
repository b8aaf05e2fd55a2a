//! The static endpoint source: a YAML pool file (DESIGN §2.1), re-read when it changes.
//!
//! The file is polled rather than watched with inotify: Kubernetes ConfigMap mounts swap a
//! symlink, editors write via rename, and both defeat naive watches, while a poll of a small
//! file every second costs nothing. An invalid edit is logged and counted and the last good
//! pool stays in place, so a typo never empties the pool.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use crate::endpoints::{Datastore, Endpoint, PodId};
use crate::telemetry::EppMetrics;

/// Why a pool file was rejected.
#[derive(Debug, thiserror::Error)]
pub enum PoolFileError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The YAML does not have the pool file's shape.
    #[error("{path}: {source}")]
    Yaml {
        /// The file.
        path: PathBuf,
        /// The parse error (with line and column).
        source: serde_yaml::Error,
    },
    /// An endpoint's address is not `ip:port`.
    #[error("endpoints[{index}].address `{address}` is not ip:port")]
    Address {
        /// Position in the list.
        index: usize,
        /// The text given.
        address: String,
    },
    /// The same address is listed twice.
    #[error("endpoints[{index}].address {address} is listed twice")]
    Duplicate {
        /// Position of the second occurrence.
        index: usize,
        /// The address.
        address: PodId,
    },
    /// A KV-event endpoint is not `tcp://host:port`.
    #[error("endpoints[{index}].{field} `{value}` is not tcp://host:port")]
    ZmqEndpoint {
        /// Position in the list.
        index: usize,
        /// `kvEvents` or `kvReplay`.
        field: &'static str,
        /// The text given.
        value: String,
    },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PoolFile {
    #[serde(default)]
    endpoints: Vec<EndpointEntry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct EndpointEntry {
    address: String,
    #[serde(default)]
    kv_events: Option<String>,
    #[serde(default)]
    kv_replay: Option<String>,
    #[serde(default)]
    labels: BTreeMap<String, String>,
}

/// Parses and validates pool-file text.
pub fn parse_pool(path: &Path, text: &str) -> Result<Vec<Endpoint>, PoolFileError> {
    let file: PoolFile = if text.trim().is_empty() {
        PoolFile {
            endpoints: Vec::new(),
        }
    } else {
        serde_yaml::from_str(text).map_err(|source| PoolFileError::Yaml {
            path: path.to_owned(),
            source,
        })?
    };
    let mut seen = HashSet::new();
    let mut endpoints = Vec::with_capacity(file.endpoints.len());
    for (index, entry) in file.endpoints.into_iter().enumerate() {
        let id: PodId = entry.address.parse().map_err(|_| PoolFileError::Address {
            index,
            address: entry.address.clone(),
        })?;
        if !seen.insert(id) {
            return Err(PoolFileError::Duplicate { index, address: id });
        }
        let kv_events = validate_zmq(index, "kvEvents", entry.kv_events)?;
        let kv_replay = validate_zmq(index, "kvReplay", entry.kv_replay)?;
        endpoints.push(Endpoint {
            id,
            kv_events,
            kv_replay,
            labels: entry.labels,
        });
    }
    Ok(endpoints)
}

fn validate_zmq(
    index: usize,
    field: &'static str,
    value: Option<String>,
) -> Result<Option<String>, PoolFileError> {
    let Some(value) = value else { return Ok(None) };
    if super::is_zmq_endpoint(&value) {
        Ok(Some(value))
    } else {
        Err(PoolFileError::ZmqEndpoint {
            index,
            field,
            value,
        })
    }
}

/// Reads and validates the pool file.
pub async fn load_pool(path: &Path) -> Result<Vec<Endpoint>, PoolFileError> {
    let text = tokio::fs::read_to_string(path)
        .await
        .map_err(|source| PoolFileError::Read {
            path: path.to_owned(),
            source,
        })?;
    parse_pool(path, &text)
}

/// Polls the pool file and publishes each valid change into the datastore until cancelled.
///
/// `initial` is the text already applied at start-up, so the first poll does not re-apply it.
pub async fn watch_pool_file(
    path: PathBuf,
    interval: Duration,
    initial: Option<String>,
    datastore: Arc<Datastore>,
    metrics: Arc<EppMetrics>,
    cancel: CancellationToken,
) {
    let mut last_text = initial;
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let text = match tokio::fs::read_to_string(&path).await {
            Ok(text) => text,
            Err(error) => {
                // NOTE: a vanished file keeps the last pool: during a ConfigMap swap the file
                // can be briefly absent, and emptying the pool would fail every request.
                if last_text.is_some() {
                    tracing::warn!(path = %path.display(), %error, "cannot read endpoints file; keeping the last good pool");
                    metrics.pool_reload_errors.inc();
                    last_text = None;
                }
                continue;
            }
        };
        if last_text.as_deref() == Some(text.as_str()) {
            continue;
        }
        // NOTE: an empty file is read as a half-written one (a truncate-then-write edit read
        // between the two), not as an empty pool: emptying the pool would fail every request
        // until the next read. `endpoints: []` empties it on purpose.
        if text.trim().is_empty() {
            if !last_text.as_deref().is_some_and(|t| t.trim().is_empty()) {
                tracing::warn!(path = %path.display(), "endpoints file is empty; keeping the last good pool (write `endpoints: []` to empty it)");
                metrics.pool_reload_errors.inc();
            }
            last_text = Some(text);
            continue;
        }
        match parse_pool(&path, &text) {
            Ok(endpoints) => {
                tracing::info!(path = %path.display(), endpoints = endpoints.len(), "endpoints file reloaded");
                datastore.set_endpoints(endpoints);
                metrics.pool_reloads.inc();
            }
            Err(error) => {
                tracing::error!(%error, "invalid endpoints file; keeping the last good pool");
                metrics.pool_reload_errors.inc();
            }
        }
        last_text = Some(text);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_shape_error_names_its_field_path() {
        let text = "endpoints:\n  - address: 10.0.0.1:8000\n  - address: 10.0.0.2:8000\n    kvEvent: tcp://10.0.0.2:5557\n";
        let error = parse_pool(Path::new("pool.yaml"), text)
            .unwrap_err()
            .to_string();
        assert!(error.contains("endpoints[1]"), "{error}");
        assert!(error.contains("kvEvent"), "{error}");
    }

    use super::*;

    fn parse(text: &str) -> Result<Vec<Endpoint>, PoolFileError> {
        parse_pool(Path::new("pool.yaml"), text)
    }

    #[test]
    fn parses_the_documented_shape() {
        let endpoints = parse(
            "endpoints:\n  - address: 127.0.0.1:8101\n    kvEvents: tcp://127.0.0.1:5557\n    kvReplay: tcp://127.0.0.1:6557\n    labels:\n      inference.networking.k8s.io/engine-type: vllm\n  - address: 127.0.0.1:8102\n",
        )
        .expect("valid");
        assert_eq!(endpoints.len(), 2);
        assert_eq!(endpoints[0].id.to_string(), "127.0.0.1:8101");
        assert_eq!(
            endpoints[0].kv_events.as_deref(),
            Some("tcp://127.0.0.1:5557")
        );
        assert_eq!(
            endpoints[0].kv_replay.as_deref(),
            Some("tcp://127.0.0.1:6557")
        );
        assert_eq!(
            endpoints[0]
                .labels
                .get(crate::endpoints::ENGINE_TYPE_LABEL)
                .map(String::as_str),
            Some("vllm")
        );
        assert!(endpoints[1].kv_events.is_none());
        assert!(parse("").expect("empty file is an empty pool").is_empty());
        assert!(parse("endpoints: []").expect("empty list").is_empty());
    }

    #[test]
    fn rejects_bad_entries_with_the_field_named() {
        let unknown = parse("endpoints:\n  - address: 127.0.0.1:1\n    adress: x\n");
        assert!(matches!(unknown, Err(PoolFileError::Yaml { .. })));
        assert!(unknown.unwrap_err().to_string().contains("adress"));
        let address = parse("endpoints:\n  - address: pod-a:8000\n");
        assert!(matches!(
            address,
            Err(PoolFileError::Address { index: 0, .. })
        ));
        let dup = parse("endpoints:\n  - address: 127.0.0.1:1\n  - address: 127.0.0.1:1\n");
        assert!(matches!(
            dup,
            Err(PoolFileError::Duplicate { index: 1, .. })
        ));
        let zmq = parse("endpoints:\n  - address: 127.0.0.1:1\n    kvEvents: 127.0.0.1:5557\n");
        assert!(matches!(
            zmq,
            Err(PoolFileError::ZmqEndpoint {
                field: "kvEvents",
                ..
            })
        ));
        assert!(matches!(
            parse("- 1\n- 2\n"),
            Err(PoolFileError::Yaml { .. })
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn reload_applies_valid_edits_and_keeps_the_last_good_pool() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("pool.yaml");
        std::fs::write(&path, "endpoints:\n  - address: 127.0.0.1:1\n").expect("write");
        let datastore = Arc::new(Datastore::new());
        let metrics = Arc::new(EppMetrics::new(&prometheus::Registry::new()).expect("metrics"));
        let cancel = CancellationToken::new();
        let task = tokio::spawn(watch_pool_file(
            path.clone(),
            Duration::from_secs(1),
            None,
            Arc::clone(&datastore),
            Arc::clone(&metrics),
            cancel.clone(),
        ));
        let wait_for = |want: usize| {
            let datastore = Arc::clone(&datastore);
            async move {
                for _ in 0..50 {
                    if datastore.is_synced() && datastore.snapshot().endpoints.len() == want {
                        return true;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                false
            }
        };
        assert!(wait_for(1).await, "initial pool applied");

        std::fs::write(
            &path,
            "endpoints:\n  - address: 127.0.0.1:1\n  - address: 127.0.0.1:2\n",
        )
        .expect("write");
        assert!(wait_for(2).await, "valid edit applied");

        std::fs::write(&path, "endpoints:\n  - address: not-an-address\n").expect("write");
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(
            datastore.snapshot().endpoints.len(),
            2,
            "last good pool kept"
        );
        assert_eq!(metrics.pool_reload_errors.get(), 1);

        // A half-written (empty) file keeps the pool; `endpoints: []` empties it.
        std::fs::write(&path, "").expect("write");
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(
            datastore.snapshot().endpoints.len(),
            2,
            "empty file: pool kept"
        );
        assert_eq!(metrics.pool_reload_errors.get(), 2, "counted once");
        std::fs::write(&path, "endpoints: []\n").expect("write");
        assert!(wait_for(0).await, "an explicit empty list empties the pool");

        cancel.cancel();
        task.await.expect("watcher exits on cancel");
    }
}
