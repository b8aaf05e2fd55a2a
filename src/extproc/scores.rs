//! The tracing headers of `--emit-endpoint-scores` and the prefill header of P/D
//! disaggregation, built from a [`Pick`].
//!
//! Why headers and metadata: a tracing proxy or the model server's access log sees request
//! headers; Envoy's access log and filters see dynamic metadata. The values are the same in
//! both. They live in kvpick's own `kvpick` metadata namespace, never in `envoy.lb`, so GIE's
//! destination contract is unchanged.
//!
//! Formats (documented in the README; numbers with 4 decimals; the picked candidate first,
//! then the others best total first):
//! - `x-kvpick-endpoint-scores: 10.0.0.1:8000=2.8300;10.0.0.2:8000=1.4100` — each candidate's
//!   final score (Σ weight × score) in the profile that picked the destination;
//! - `x-kvpick-scorer-scores: 10.0.0.1:8000=queue-scorer:1.0000,prefix-cache-scorer:0.5000;…`
//!   — each candidate's raw per-scorer scores in [0, 1] (before weights), by plugin name.
//!
//! Both are bounded: at most [`MAX_TRACED_ENDPOINTS`] candidates and [`MAX_TRACE_BYTES`]
//! bytes each; entries past either bound are left out whole (the best ones are kept).

use std::fmt::Write as _;

use crate::scheduling::{Pick, ScoreTrace};

/// Each candidate's final score.
pub const ENDPOINT_SCORES_HEADER: &str = "x-kvpick-endpoint-scores";
/// Each candidate's per-scorer scores.
pub const SCORER_SCORES_HEADER: &str = "x-kvpick-scorer-scores";
/// The prefill endpoint under P/D disaggregation (llm-d's header, read by its sidecar).
pub const PREFILL_HEADER: &str = "x-prefiller-host-port";
/// The dynamic-metadata namespace of the headers above.
pub const KVPICK_NAMESPACE: &str = "kvpick";
/// Headers kvpick alone may set: a client's copies are removed (never trusted).
pub const KVPICK_SET_HEADERS: [&str; 3] =
    [ENDPOINT_SCORES_HEADER, SCORER_SCORES_HEADER, PREFILL_HEADER];
/// Most candidates listed in a tracing header.
pub const MAX_TRACED_ENDPOINTS: usize = 16;
/// Longest tracing header value, bytes.
pub const MAX_TRACE_BYTES: usize = 4096;

/// The headers kvpick sets for `pick` beyond the destination: the prefill endpoint, and the
/// two score headers when the pick carries a trace. Empty for a plain pick.
pub fn pick_headers(pick: &Pick) -> Vec<(&'static str, String)> {
    let mut headers = Vec::new();
    if let Some(prefill) = pick.prefill {
        headers.push((PREFILL_HEADER, prefill.to_string()));
    }
    if let Some(trace) = pick.trace.as_deref() {
        headers.push((ENDPOINT_SCORES_HEADER, endpoint_scores(trace)));
        headers.push((SCORER_SCORES_HEADER, scorer_scores(trace)));
    }
    headers
}

/// `addr=total;addr=total…`.
pub fn endpoint_scores(trace: &ScoreTrace) -> String {
    bounded(trace, |entry, candidate| {
        let _ = write!(entry, "{}={}", candidate.address, number(candidate.total));
    })
}

/// `addr=scorer:score,scorer:score;addr=…`.
pub fn scorer_scores(trace: &ScoreTrace) -> String {
    bounded(trace, |entry, candidate| {
        entry.push_str(&candidate.address);
        entry.push('=');
        for (i, (name, score)) in candidate.scores.iter().enumerate() {
            if i > 0 {
                entry.push(',');
            }
            push_token(entry, name);
            let _ = write!(entry, ":{}", number(*score));
        }
    })
}

fn bounded(
    trace: &ScoreTrace,
    format: impl Fn(&mut String, &crate::scheduling::CandidateExplain),
) -> String {
    let mut value = String::new();
    let mut entry = String::new();
    for candidate in trace.candidates.iter().take(MAX_TRACED_ENDPOINTS) {
        entry.clear();
        format(&mut entry, candidate);
        let separator = usize::from(!value.is_empty());
        if value.len() + separator + entry.len() > MAX_TRACE_BYTES {
            break;
        }
        if separator == 1 {
            value.push(';');
        }
        value.push_str(&entry);
    }
    value
}

fn number(value: f64) -> String {
    format!("{:.4}", if value.is_finite() { value } else { 0.0 })
}

/// Plugin names come from the config: keep them to characters that cannot break the format
/// or the header (`[A-Za-z0-9._-]`, anything else becomes `_`).
fn push_token(out: &mut String, name: &str) {
    out.extend(name.chars().map(|c| {
        if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
            c
        } else {
            '_'
        }
    }));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduling::CandidateExplain;
    use std::collections::BTreeMap;

    fn candidate(i: usize, total: f64, scores: &[(&str, f64)]) -> CandidateExplain {
        CandidateExplain {
            address: format!("10.0.0.{i}:8000"),
            scores: scores
                .iter()
                .map(|(k, v)| ((*k).to_owned(), *v))
                .collect::<BTreeMap<_, _>>(),
            total,
            cached_tokens: 0.0,
            saturation: 0.0,
            estimated_ttft_ms: None,
            displacement_ms: None,
            holdup_ms: None,
            in_flight: 0,
            fresh_metrics: true,
        }
    }

    #[test]
    fn formats_totals_and_per_scorer_scores() {
        let trace = ScoreTrace {
            profile: "default".into(),
            candidates: vec![
                candidate(1, 2.83, &[("queue-scorer", 1.0), ("odd name;=", 0.5)]),
                candidate(2, f64::NAN, &[("queue-scorer", 0.25)]),
            ],
        };
        assert_eq!(
            endpoint_scores(&trace),
            "10.0.0.1:8000=2.8300;10.0.0.2:8000=0.0000"
        );
        assert_eq!(
            scorer_scores(&trace),
            "10.0.0.1:8000=odd_name__:0.5000,queue-scorer:1.0000;10.0.0.2:8000=queue-scorer:0.2500"
        );
    }

    #[test]
    fn values_are_bounded_by_count_and_bytes() {
        let many = ScoreTrace {
            profile: "p".into(),
            candidates: (0..100).map(|i| candidate(i, 1.0, &[])).collect(),
        };
        assert_eq!(
            endpoint_scores(&many).split(';').count(),
            MAX_TRACED_ENDPOINTS
        );
        let long_name = "s".repeat(1500);
        let wide = ScoreTrace {
            profile: "p".into(),
            candidates: (0..10)
                .map(|i| candidate(i, 1.0, &[(long_name.as_str(), 1.0)]))
                .collect(),
        };
        let value = scorer_scores(&wide);
        assert!(value.len() <= MAX_TRACE_BYTES, "{}", value.len());
        assert_eq!(value.split(';').count(), 2, "whole entries only");
        assert!(value.starts_with("10.0.0.0:8000="));
    }

    #[test]
    fn a_plain_pick_sets_no_extra_header() {
        let pod: crate::endpoints::PodId = "10.0.0.1:8000".parse().expect("pod");
        assert!(pick_headers(&Pick::new(pod, Vec::new())).is_empty());
        let mut pick = Pick::new(pod, Vec::new());
        pick.prefill = Some("10.0.0.9:8000".parse().expect("pod"));
        assert_eq!(
            pick_headers(&pick),
            vec![(PREFILL_HEADER, "10.0.0.9:8000".to_owned())]
        );
    }
}
