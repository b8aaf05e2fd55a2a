//! Whether an endpoint is down: gone from the network, not merely slow or busy.
//!
//! An endpoint is down when its `/metrics` scrape cannot reach it — nothing listens (refused,
//! reset, unroutable), or its host answers nothing at all (no connection within the timeout,
//! twice in a row: `ScrapeStatus::connection_failed`); a slow answer is not enough — **and**
//! its KV-event stream is disconnected (TCP keepalive ends the stream of a host that went
//! silent, `kvevents::transport`). For an endpoint without a configured KV-event endpoint
//! the scrape alone decides. Once down, only a scrape that answers makes it live again: a
//! restarting vLLM binds its ZMQ publisher seconds before its HTTP server listens (about 7 s,
//! measured on vLLM 0.32 by `scripts/vllm-e2e.sh`), so a reconnected event stream alone would
//! bring back a pod that still refuses requests.
//!
//! Down endpoints are left out of the candidates, so a dead engine stops getting traffic;
//! when every candidate is down all are kept (`super::live_candidates`): a pick among doubtful
//! pods is better than a certain 503, and the gateway retries on the fallbacks.
//!
//! One tracker task (`app::liveness`) writes the verdict; requests read it lock-free. It
//! lives beside the in-flight count in [`super::EndpointState`] and, like it, survives pool
//! reloads for endpoints that stay.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

/// One endpoint's down/up verdict and why.
#[derive(Debug, Default)]
pub struct Liveness {
    down: AtomicBool,
    reason: Mutex<Option<String>>,
}

impl Liveness {
    /// Whether the endpoint is down (left out of the candidates).
    pub fn is_down(&self) -> bool {
        self.down.load(Ordering::Relaxed)
    }

    /// Why it is down (`None` while it is up).
    pub fn reason(&self) -> Option<String> {
        self.reason
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Records a verdict (`Some(reason)`: down); returns whether up/down changed.
    pub fn set(&self, down: Option<String>) -> bool {
        let is_down = down.is_some();
        *self.reason.lock().unwrap_or_else(|p| p.into_inner()) = down;
        self.down.swap(is_down, Ordering::Relaxed) != is_down
    }
}

/// What the verdict is made of, as read from the scraper and the KV-event status.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Signals {
    /// The last scrape's connection failure (refused/reset/unroutable), if that is how it
    /// failed.
    pub scrape_connection_error: Option<String>,
    /// Whether the pool file names a KV-event endpoint for it.
    pub kv_events_configured: bool,
    /// Whether its KV-event stream is connected now.
    pub kv_events_connected: bool,
    /// Whether it is down now (the last verdict).
    pub was_down: bool,
}

/// The verdict: `Some(reason)` when the endpoint is down.
pub fn judge(signals: &Signals) -> Option<String> {
    let scrape = signals.scrape_connection_error.as_deref()?;
    if signals.was_down {
        return Some(format!(
            "metrics scrape {scrape} (down until the scrape answers)"
        ));
    }
    if !signals.kv_events_configured {
        return Some(format!(
            "metrics scrape {scrape} (no KV-event endpoint configured)"
        ));
    }
    (!signals.kv_events_connected)
        .then(|| format!("metrics scrape {scrape}; KV-event stream disconnected"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn signals(refused: bool, configured: bool, connected: bool) -> Signals {
        Signals {
            scrape_connection_error: refused.then(|| "connection refused".to_owned()),
            kv_events_configured: configured,
            kv_events_connected: connected,
            was_down: false,
        }
    }

    #[test]
    fn a_down_pod_comes_back_only_when_its_scrape_answers() {
        let down = |refused: bool, connected: bool| Signals {
            was_down: true,
            ..signals(refused, true, connected)
        };
        let reason = judge(&down(true, true)).expect("events reconnected, HTTP still refused");
        assert!(reason.contains("until the scrape answers"), "{reason}");
        assert!(judge(&down(false, true)).is_none(), "the scrape answers");
        assert!(judge(&down(false, false)).is_none());
    }

    #[test]
    fn down_needs_a_refused_scrape_and_no_event_stream() {
        assert!(
            judge(&signals(false, true, false)).is_none(),
            "scrape answers"
        );
        assert!(
            judge(&signals(true, true, true)).is_none(),
            "events connected"
        );
        let reason = judge(&signals(true, true, false)).expect("down");
        assert!(reason.contains("connection refused") && reason.contains("KV-event stream"));
        let reason = judge(&signals(true, false, false)).expect("down without events");
        assert!(reason.contains("no KV-event endpoint"), "{reason}");
    }

    #[test]
    fn set_reports_transitions_only() {
        let live = Liveness::default();
        assert!(!live.set(None));
        assert!(live.set(Some("gone".into())));
        assert!(live.is_down());
        assert!(!live.set(Some("still gone".into())));
        assert_eq!(live.reason().as_deref(), Some("still gone"));
        assert!(live.set(None));
        assert!(!live.is_down() && live.reason().is_none());
    }
}
