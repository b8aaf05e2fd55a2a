//! Asking a pod for only the metrics kvpick reads.
//!
//! For every GET of `/metrics`, vLLM renders its whole exposition: ~670 lines (~55 KB) of
//! text, built in Python on the API server's event loop, the one that also tokenizes and
//! streams requests. kvpick reads 7 of its ~90 families, 20 times a second per pod and per
//! kvpick replica. vLLM also mounts prometheus_client's own ASGI app behind `/metrics/`
//! (`vllm/entrypoints/serve/instrumentator/metrics.py`: a `Mount` added after the
//! instrumentator's `/metrics` route, which ignores query parameters), and that app answers
//! `?name[]=…` with only the named samples: prometheus_client's restricted registry collects
//! and renders only the collectors that own those names. Measured with prometheus_client
//! 0.26 on the families of the real vLLM 0.32 page (`bench/vllm_metrics_cost.py`): 1.9–2.1 ms
//! → 59–75 µs of the server's CPU per scrape, 42.7 KB → 1.9 KB (docs/benchmarks.md, session
//! 24).
//!
//! The names are *sample* names (a counter's would need its `_total`); vLLM's signals are all
//! gauges, so each name is its family's (test below, against the fixture).
//!
//! A pod that does not answer by name (another server in front, another version: a 404, a
//! redirect, or an answer without what kvpick needs) is scraped whole from then on; finding
//! out costs one more GET, once per pod. A pod that answers by name but leaves out a signal
//! it would have on its whole page cannot happen: the restricted registry drops only what was
//! not asked for.

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

/// Whether a by-name scrape's failure says the pod does not answer by name (so its whole
/// page is asked for instead): a redirect or a client error (no such path, not allowed), or
/// a 200 without kvpick's signals. A pod that is down, slow or failing (5xx) is not a
/// reason: that is the pod's state, not the path's.
pub(super) fn not_served_by_name(error: &ScrapeError) -> bool {
    match error {
        ScrapeError::Status(status) => (300..500).contains(status),
        ScrapeError::Missing(_) => true,
        _ => false,
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
    fn only_answers_without_the_signals_mean_the_whole_page() {
        assert!(not_served_by_name(&ScrapeError::Status(404)));
        assert!(not_served_by_name(&ScrapeError::Status(307)));
        assert!(not_served_by_name(&ScrapeError::Missing(MissingMetric(
            "vllm:num_requests_waiting"
        ))));
        assert!(not_served_by_name(&ScrapeError::Status(403)));
        assert!(!not_served_by_name(&ScrapeError::Status(500)));
        assert!(!not_served_by_name(&ScrapeError::Status(503)));
        assert!(!not_served_by_name(&ScrapeError::Timeout));
        assert!(!not_served_by_name(&ScrapeError::Connect("refused".into())));
        assert!(!not_served_by_name(&ScrapeError::Body("cut off".into())));
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
