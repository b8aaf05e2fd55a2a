//! The exchange's flags (`--replica-exchange-port`, `--replica-peers`, `--peer-selector`,
//! `--replica-batch-interval`) validated into a [`ReplicaConfig`].

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use super::{PeerSource, ReplicaConfig};

/// Batches queued per peer: at the default 10 ms interval, 0.64 s of batches, well inside
/// the speculative TTL (records older than that would only hold stale routes).
pub const QUEUE_BATCHES: usize = 64;
/// The longest batch interval: peers forget a replica's counts after 3 s of silence and
/// expect a batch every heartbeat (1 s).
const MAX_BATCH_INTERVAL: Duration = Duration::from_secs(1);
/// Static peers at most.
const MAX_STATIC_PEERS: usize = 64;

/// A flag of the exchange that is invalid.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("--{flag}: {reason}")]
pub struct ReplicaFlagError {
    /// The flag.
    pub flag: &'static str,
    /// What is wrong.
    pub reason: String,
}

/// The exchange's flags as given.
#[derive(Debug, Clone)]
pub struct ReplicaFlags<'a> {
    /// `--replica-exchange-port`.
    pub port: Option<u16>,
    /// `--bind-address`.
    pub bind: IpAddr,
    /// `--replica-peers`.
    pub peers: &'a [String],
    /// `--peer-selector`.
    pub peer_selector: Option<&'a str>,
    /// `--replica-batch-interval`.
    pub batch_interval: Duration,
    /// The namespace peers are looked for in.
    pub namespace: String,
    /// `--replica-exchange-tls`.
    pub tls: bool,
    /// Whether the ext-proc port serves a certificate from `--cert-path` (`--secure-serving`).
    pub shared_cert: bool,
}

fn fail(flag: &'static str, reason: impl Into<String>) -> ReplicaFlagError {
    ReplicaFlagError {
        flag,
        reason: reason.into(),
    }
}

/// Validates the flags; `None` when the exchange is off (no port).
pub fn validate(flags: ReplicaFlags<'_>) -> Result<Option<ReplicaConfig>, ReplicaFlagError> {
    let Some(port) = flags.port else {
        if !flags.peers.is_empty() {
            return Err(fail("replica-peers", "needs --replica-exchange-port"));
        }
        if flags.peer_selector.is_some() {
            return Err(fail("peer-selector", "needs --replica-exchange-port"));
        }
        if flags.tls {
            return Err(fail(
                "replica-exchange-tls",
                "needs --replica-exchange-port",
            ));
        }
        return Ok(None);
    };
    if flags.tls && !flags.shared_cert {
        return Err(fail(
            "replica-exchange-tls",
            "needs --secure-serving with --cert-path: a certificate every replica shares (a \
             self-signed one differs per replica)",
        ));
    }
    if flags.batch_interval.is_zero() || flags.batch_interval > MAX_BATCH_INTERVAL {
        return Err(fail(
            "replica-batch-interval",
            format!(
                "must be above 0 and at most {MAX_BATCH_INTERVAL:?} (got {:?})",
                flags.batch_interval
            ),
        ));
    }
    let peers = match (flags.peers.is_empty(), flags.peer_selector) {
        (false, Some(_)) => {
            return Err(fail(
                "peer-selector",
                "and --replica-peers are given together: pass one source of peers",
            ));
        }
        (true, None) => None,
        (true, Some(selector)) => Some(PeerSource::Selector(
            crate::discovery::kube::LabelSelector::parse(selector)
                .map_err(|reason| fail("peer-selector", reason))?,
        )),
        (false, None) => {
            let mut list = BTreeSet::new();
            for peer in flags
                .peers
                .iter()
                .map(|p| p.trim())
                .filter(|p| !p.is_empty())
            {
                check_peer(peer).map_err(|reason| fail("replica-peers", reason))?;
                list.insert(peer.to_owned());
            }
            if list.len() > MAX_STATIC_PEERS {
                return Err(fail(
                    "replica-peers",
                    format!("more than {MAX_STATIC_PEERS} peers"),
                ));
            }
            Some(PeerSource::Static(list))
        }
    };
    Ok(Some(ReplicaConfig {
        listen: SocketAddr::new(flags.bind, port),
        peers,
        batch_interval: flags.batch_interval,
        queue_batches: QUEUE_BATCHES,
        namespace: flags.namespace,
        tls: flags.tls,
    }))
}

/// A peer is `host:port` (an IPv6 address in brackets).
fn check_peer(peer: &str) -> Result<(), String> {
    if peer.parse::<SocketAddr>().is_ok() {
        return Ok(());
    }
    let bad = || format!("`{peer}` is not HOST:PORT");
    let (host, port) = peer.rsplit_once(':').ok_or_else(bad)?;
    let port: u16 = port.parse().map_err(|_| bad())?;
    let host_ok = !host.is_empty()
        && host.len() <= 253
        && host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.');
    if port == 0 || !host_ok {
        return Err(bad());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags<'a>(
        port: Option<u16>,
        peers: &'a [String],
        selector: Option<&'a str>,
    ) -> ReplicaFlags<'a> {
        ReplicaFlags {
            port,
            bind: IpAddr::from([127, 0, 0, 1]),
            peers,
            peer_selector: selector,
            batch_interval: Duration::from_millis(10),
            namespace: "default".into(),
            tls: false,
            shared_cert: false,
        }
    }

    #[test]
    fn flags_name_what_is_wrong() {
        assert_eq!(validate(flags(None, &[], None)), Ok(None));
        let peers = vec!["a.b:9100".to_owned(), "10.0.0.2:9100".to_owned()];
        let err = validate(flags(None, &peers, None)).unwrap_err();
        assert_eq!(err.flag, "replica-peers");
        let err = validate(flags(Some(9100), &peers, Some("app=kvpick"))).unwrap_err();
        assert_eq!(err.flag, "peer-selector");
        let bad = vec!["no-port".to_owned()];
        let err = validate(flags(Some(9100), &bad, None)).unwrap_err();
        assert!(err.reason.contains("no-port"), "{err}");
        let config = validate(flags(Some(9100), &peers, None)).unwrap().unwrap();
        assert_eq!(config.listen.port(), 9100);
        assert!(matches!(config.peers, Some(PeerSource::Static(ref p)) if p.len() == 2));
        let mut slow = flags(Some(9100), &[], None);
        slow.batch_interval = Duration::from_secs(5);
        assert_eq!(validate(slow).unwrap_err().flag, "replica-batch-interval");
        let config = validate(flags(Some(9100), &[], Some("app=kvpick")))
            .unwrap()
            .unwrap();
        assert!(matches!(config.peers, Some(PeerSource::Selector(_))));
        let mut tls = flags(Some(9100), &[], None);
        tls.tls = true;
        assert_eq!(
            validate(tls.clone()).unwrap_err().flag,
            "replica-exchange-tls"
        );
        tls.shared_cert = true;
        assert!(validate(tls.clone()).unwrap().unwrap().tls);
        tls.port = None;
        assert_eq!(validate(tls).unwrap_err().flag, "replica-exchange-tls");
    }
}
