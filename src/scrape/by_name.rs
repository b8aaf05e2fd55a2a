//! Asking a pod for only the metrics kvpick reads.
//!
//! For every GET of `/metrics`, vLLM renders its whole exposition: ~670 lines (~55 KB) of
//! text, built by prometheus_client in the API server's Python process (the instrumentator's
//! handler runs in a worker thread, holding the interpreter lock the event loop that
//! tokenizes and streams requests also needs). kvpick reads 7 of its ~90 families, 20 times a
//! second per pod and per kvpick replica. vLLM also mounts prometheus_client's own ASGI app
//! behind `/metrics/` (`vllm/entrypoints/serve/instrumentator/metrics.py`: a `Mount` added
//! after the instrumentator's `/metrics` route, which ignores query parameters), and that app
//! answers `?name[]=…` with only the named samples: prometheus_client's restricted registry
//! collects and renders only the collectors that own those names (on the event loop itself:
//! the app is async). Measured with prometheus_client 0.26 on the families of the real vLLM
//! 0.32 page and a live process collector (`bench/vllm_metrics_cost.py`): 2.2–2.3 ms → 125–147
//! µs of the server's CPU per scrape, 42.7 KB → 1.9 KB as rendered (docs/benchmarks.md,
//! session 24).
//!
//! The names are *sample* names (a counter's would need its `_total`); vLLM's signals are all
//! gauges, so each name is its family's (test below, against the fixture).
//!
//! # When a pod is scraped whole
//! [`PageChoice`] holds the rules. A pod that says it does not answer by name (a redirect, a
//! client error, or a 200 without kvpick's signals: another server in front, another vLLM
//! version, or vLLM with several API servers, whose multiprocess registry answers by name
//! with an empty page) is scraped whole from then on, the same scrape retrying the whole page
//! at once. Until a pod has answered by name once, any other failure of a pod that was
//! reached (its answer timed out, a 5xx) is also retried on the whole page, and a whole page
//! that comes back makes the pod a whole-page pod: a path that stalls or fails where the whole
//! page works must not leave the pod unscraped (saturated) for good. A pod that was not
//! reached (refused, or no connection within the timeout) is not asked twice: the path played
//! no part, and a second timeout would only double the tick of a pod still starting or gone.
//! Once it has answered by name, failures are the pod's state, not the path's, and are not
//! retried. A pod that answers by name but leaves out a signal it would have on its whole
//! page cannot happen: the restricted registry drops only what was not asked for.

use super::engine::EngineKind;
use super::error::ScrapeError;

/// The path that asks for only the metrics kvpick reads from `engine`, next to the
/// configured `path`; `None` where kvpick only scrapes whole pages (engines other than vLLM,
/// whose servers are not known to answer by name, and paths with a query of their own).
pub(super) fn path_by_name(path: &str, engine: EngineKind) -> Option<String> {
    if engine != EngineKind::Vllm || path.contains(['?', '#']) {
        return None;
    }
    let mut by_name = format!("{}/?", path.trim_end_matches('/'));
    for (i, name) in engine.read_names().iter().enumerate() {
        if i > 0 {
            by_name.push('&');
        }
        by_name.push_str("name%5B%5D=");
        percent_encode(name, &mut by_name);
    }
    Some(by_name)
}

/// Whether a by-name scrape's failure says the pod does not answer by name: a redirect or a
/// client error (no such path, not allowed; not 429, which is the pod's load), or a 200
/// without kvpick's signals. A pod that is down, slow or failing (5xx) says nothing about
/// the path.
fn not_served_by_name(error: &ScrapeError) -> bool {
    match error {
        ScrapeError::Status(status) => (300..500).contains(status) && *status != 429,
        ScrapeError::Missing(_) => true,
        _ => false,
    }
}

/// Whether a scrape failed before the pod was reached: nothing listens (refused, reset,
/// unroutable) or no connection came within the timeout. Such a failure is the pod's,
/// whichever path was asked, so the whole page is not asked for after it.
fn pod_unreached(error: &ScrapeError) -> bool {
    matches!(error, ScrapeError::Connect(_) | ScrapeError::ConnectTimeout)
}

/// Which page one pod's scrapes ask for, and what its answers have shown (module docs).
#[derive(Debug)]
pub(super) struct PageChoice {
    /// The by-name path, while the pod is asked by name.
    by_name: Option<String>,
    /// Whether the pod has answered by name.
    answered: bool,
}

impl PageChoice {
    /// By name where `engine` and `path` allow it and `wanted`; else whole pages.
    pub(super) fn new(wanted: bool, path: &str, engine: EngineKind) -> Self {
        Self {
            by_name: path_by_name(path, engine).filter(|_| wanted),
            answered: false,
        }
    }

    /// Whole pages from now on.
    pub(super) fn whole() -> Self {
        Self {
            by_name: None,
            answered: false,
        }
    }

    /// The path to ask, while the pod is asked by name.
    pub(super) fn by_name_path(&self) -> Option<&str> {
        self.by_name.as_deref()
    }

    /// A by-name scrape succeeded.
    pub(super) fn answered_by_name(&mut self) {
        self.answered = true;
    }

    /// Whether a by-name scrape that failed with `error` is retried on the whole page now.
    pub(super) fn retry_whole(&self, error: &ScrapeError) -> bool {
        self.by_name.is_some()
            && (not_served_by_name(error) || (!self.answered && !pod_unreached(error)))
    }

    /// The whole page was asked after a by-name scrape failed with `error` and `came` back
    /// or not; whether the pod is scraped whole from now on.
    pub(super) fn whole_page_came(&mut self, error: &ScrapeError, came: bool) -> bool {
        let whole = not_served_by_name(error) || came;
        if whole {
            self.by_name = None;
        }
        whole
    }
}

/// Appends `text` to `out` with every byte but RFC 3986's unreserved ones percent-encoded.
fn percent_encode(text: &str, out: &mut String) {
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || b"-._~".contains(&byte) {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scrape::engine::MissingMetric;
    use crate::scrape::prom_text;

    #[test]
    fn vllm_pods_are_asked_for_what_kvpick_reads_by_name() {
        let path = path_by_name("/metrics", EngineKind::Vllm).expect("vLLM answers by name");
        assert!(
            path.starts_with("/metrics/?name%5B%5D=vllm%3Anum_requests_waiting&"),
            "{path}"
        );
        assert_eq!(
            path.matches("name%5B%5D=").count(),
            EngineKind::Vllm.read_names().len()
        );
        assert!(
            path.ends_with("&name%5B%5D=vllm%3Alora_requests_info"),
            "{path}"
        );
        assert!(path.parse::<hyper::Uri>().is_ok(), "{path}");
        // A configured path keeps its place; a trailing slash is not doubled.
        assert!(
            path_by_name("/stats/prometheus/", EngineKind::Vllm)
                .is_some_and(|p| p.starts_with("/stats/prometheus/?name%5B%5D=")),
        );
        assert!(path_by_name("/", EngineKind::Vllm).is_some_and(|p| p.starts_with("/?name")));
    }

    #[test]
    fn other_engines_and_paths_with_a_query_are_scraped_whole() {
        assert_eq!(path_by_name("/metrics", EngineKind::Sglang), None);
        assert_eq!(path_by_name("/metrics", EngineKind::TrtLlm), None);
        assert_eq!(path_by_name("/metrics?format=text", EngineKind::Vllm), None);
    }

    #[test]
    fn only_answers_without_the_signals_say_the_path_is_not_served() {
        assert!(not_served_by_name(&ScrapeError::Status(404)));
        assert!(not_served_by_name(&ScrapeError::Status(307)));
        assert!(not_served_by_name(&ScrapeError::Status(403)));
        assert!(not_served_by_name(&ScrapeError::Missing(MissingMetric(
            "vllm:num_requests_waiting"
        ))));
        assert!(!not_served_by_name(&ScrapeError::Status(429)));
        assert!(!not_served_by_name(&ScrapeError::Status(500)));
        assert!(!not_served_by_name(&ScrapeError::Status(503)));
        assert!(!not_served_by_name(&ScrapeError::Timeout));
        assert!(!not_served_by_name(&ScrapeError::Connect("refused".into())));
        assert!(!not_served_by_name(&ScrapeError::Body("cut off".into())));
    }

    #[test]
    fn a_path_that_is_not_served_means_whole_pages_whatever_the_whole_page_does() {
        for answered_before in [false, true] {
            let mut page = PageChoice::new(true, "/metrics", EngineKind::Vllm);
            if answered_before {
                page.answered_by_name();
            }
            let not_found = ScrapeError::Status(404);
            assert!(page.retry_whole(&not_found));
            assert!(page.whole_page_came(&not_found, false));
            assert_eq!(page.by_name_path(), None);
            assert!(!page.retry_whole(&not_found), "nothing to retry any more");
        }
    }

    #[test]
    fn before_a_first_answer_by_name_any_failure_tries_the_whole_page() {
        let mut page = PageChoice::new(true, "/metrics", EngineKind::Vllm);
        for error in [ScrapeError::Timeout, ScrapeError::Status(500)] {
            assert!(page.retry_whole(&error));
            // The whole page failed too: the pod is down, not the path; by name still.
            assert!(!page.whole_page_came(&error, false));
            assert!(page.by_name_path().is_some());
        }
        // The whole page came where the by-name one timed out: whole pages from now on.
        assert!(page.whole_page_came(&ScrapeError::Timeout, true));
        assert_eq!(page.by_name_path(), None);
    }

    #[test]
    fn a_pod_that_was_never_reached_is_not_asked_again_for_its_whole_page() {
        let page = PageChoice::new(true, "/metrics", EngineKind::Vllm);
        // Nothing listens, or no connection came: the path was never asked, so asking the
        // other one would only wait out a second timeout (a pod still starting, or gone).
        for error in [
            ScrapeError::Connect("refused".into()),
            ScrapeError::ConnectTimeout,
        ] {
            assert!(!page.retry_whole(&error), "{error:?}");
        }
        assert!(page.by_name_path().is_some());
    }

    #[test]
    fn after_an_answer_by_name_a_failing_pod_is_not_retried() {
        let mut page = PageChoice::new(true, "/metrics", EngineKind::Vllm);
        page.answered_by_name();
        for error in [
            ScrapeError::Timeout,
            ScrapeError::Status(500),
            ScrapeError::Status(429),
            ScrapeError::Connect("refused".into()),
        ] {
            assert!(!page.retry_whole(&error), "{error:?}");
        }
        assert!(page.by_name_path().is_some());
    }

    #[test]
    fn whole_pages_when_not_wanted_or_not_possible() {
        assert_eq!(
            PageChoice::new(false, "/metrics", EngineKind::Vllm).by_name_path(),
            None
        );
        assert_eq!(
            PageChoice::new(true, "/metrics", EngineKind::Sglang).by_name_path(),
            None
        );
        assert_eq!(PageChoice::whole().by_name_path(), None);
        assert!(!PageChoice::whole().retry_whole(&ScrapeError::Status(404)));
    }

    /// The restricted registry matches sample names: every name asked for must be the exact
    /// name of its samples on a real page (a counter's family name would match nothing).
    #[test]
    fn every_name_asked_for_is_a_sample_name_of_the_real_page() {
        let text = std::fs::read_to_string(
            crate::test_paths::fixtures().join("vllm-0.32-kv-events/metrics-load.txt"),
        )
        .expect("fixture");
        let samples = prom_text::parse_wanted(&text, EngineKind::Vllm.read_names()).samples;
        for name in EngineKind::Vllm.read_names() {
            let typed = text
                .lines()
                .find_map(|l| l.strip_prefix(&format!("# TYPE {name} ")));
            if let Some(kind) = typed {
                assert_eq!(
                    kind, "gauge",
                    "{name} is a {kind}: its samples are not named {name}"
                );
                assert!(samples.iter().any(|s| s.name == *name), "{name}");
            }
        }
        // The signals scheduling needs are on the page (the others are optional).
        for needed in ["vllm:num_requests_waiting", "vllm:num_requests_running"] {
            assert!(samples.iter().any(|s| s.name == needed), "{needed}");
        }
    }
}
