//! What kvpick reads from the request headers: the path and its control headers.

use std::borrow::Cow;

use crate::pb::envoy::config::core::v3::HeaderMap;

/// Objective name → priority (`x-gateway-inference-objective`).
pub const OBJECTIVE_HEADER: &str = "x-gateway-inference-objective";
/// Flow-control tenant (`x-gateway-inference-fairness-id`).
pub const FAIRNESS_HEADER: &str = "x-gateway-inference-fairness-id";
/// Per-request model rewrite (`x-gateway-model-name-rewrite`).
pub const MODEL_REWRITE_HEADER: &str = "x-gateway-model-name-rewrite";
/// Client session id for session affinity.
pub const SESSION_HEADER: &str = "x-session-id";
/// Time-to-first-token objective in ms (llm-d; `x-slo-ttft-ms` is its deprecated alias).
pub const SLO_TTFT_HEADER: &str = "x-llm-d-slo-ttft-ms";
/// Time-per-output-token objective in ms (llm-d; `x-slo-tpot-ms` is its deprecated alias).
pub const SLO_TPOT_HEADER: &str = "x-llm-d-slo-tpot-ms";
/// Longest control-header value kept; longer values are ignored (hostile input).
const MAX_VALUE_BYTES: usize = 256;
/// Longest `test-epp-endpoint-selection` kept: a list of addresses (~100 IPv4 `ip:port`).
const MAX_SELECTION_BYTES: usize = 2048;

/// The request headers kvpick acts on.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RequestMeta {
    /// `:path` (decides the API kind of the body).
    pub path: String,
    /// The objective named by the client.
    pub objective: Option<String>,
    /// The flow-control tenant.
    pub fairness_id: Option<String>,
    /// A model to rewrite `model` to.
    pub model_rewrite: Option<String>,
    /// The session id.
    pub session_id: Option<String>,
    /// The latency objectives (an absent, unparsable, zero, negative or non-finite value is
    /// no objective, as llm-d treats it).
    pub slo: crate::scheduling::LatencySlo,
    /// A conformance test's endpoint list (`test-epp-endpoint-selection`; acted on only
    /// with `--enable-conformance-hooks`).
    pub endpoint_selection: Option<String>,
    /// Control headers present (removed before forwarding), lower-case; also any client
    /// copy of a header only kvpick sets (`super::scores::KVPICK_SET_HEADERS`).
    pub control_headers: Vec<String>,
}

impl RequestMeta {
    /// Reads the headers Envoy sent.
    pub fn from_headers(headers: Option<&HeaderMap>) -> Self {
        let mut meta = Self::default();
        let Some(headers) = headers else { return meta };
        for header in &headers.headers {
            // NOTE: nothing is allocated for the headers kvpick does not act on (most of
            // them): gateways send keys in lower case already, and a value is copied only
            // for a key that is read.
            let key: Cow<'_, str> = if header.key.bytes().any(|b| b.is_ascii_uppercase()) {
                Cow::Owned(header.key.to_ascii_lowercase())
            } else {
                Cow::Borrowed(&header.key)
            };
            let raw = if header.raw_value.is_empty() {
                header.value.as_bytes()
            } else {
                &header.raw_value[..]
            };
            let value = || {
                std::str::from_utf8(raw)
                    .ok()
                    .map(str::trim)
                    .filter(|v| !v.is_empty() && v.len() <= MAX_VALUE_BYTES)
                    .map(str::to_owned)
            };
            if super::scores::KVPICK_SET_HEADERS.contains(&key.as_ref()) {
                // Never trusted from a client: removed, or overwritten by kvpick's own value.
                if !meta.control_headers.iter().any(|known| *known == key) {
                    meta.control_headers.push(key.into_owned());
                }
                continue;
            }
            match key.as_ref() {
                ":path" => meta.path = String::from_utf8_lossy(raw).into_owned(),
                super::conformance::SELECTION_HEADER => {
                    meta.endpoint_selection = std::str::from_utf8(raw)
                        .ok()
                        .filter(|v| v.len() <= MAX_SELECTION_BYTES)
                        .map(str::to_owned);
                }
                OBJECTIVE_HEADER => meta.objective = value(),
                FAIRNESS_HEADER => meta.fairness_id = value(),
                MODEL_REWRITE_HEADER => meta.model_rewrite = value(),
                SESSION_HEADER => meta.session_id = value(),
                SLO_TTFT_HEADER | "x-slo-ttft-ms" => {
                    meta.slo.ttft_ms = slo_ms(value().as_deref()).or(meta.slo.ttft_ms);
                }
                SLO_TPOT_HEADER | "x-slo-tpot-ms" => {
                    meta.slo.tpot_ms = slo_ms(value().as_deref()).or(meta.slo.tpot_ms);
                }
                _ => continue,
            }
            if matches!(
                key.as_ref(),
                OBJECTIVE_HEADER | FAIRNESS_HEADER | MODEL_REWRITE_HEADER
            ) {
                meta.control_headers.push(key.into_owned());
            }
        }
        meta
    }
}

/// A latency objective header's value in ms: a positive finite number.
fn slo_ms(value: Option<&str>) -> Option<f64> {
    value?
        .parse::<f64>()
        .ok()
        .filter(|ms| ms.is_finite() && *ms > 0.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::envoy::config::core::v3::HeaderValue;

    fn header(key: &str, value: &str) -> HeaderValue {
        HeaderValue {
            key: key.to_owned(),
            raw_value: bytes::Bytes::copy_from_slice(value.as_bytes()),
            ..Default::default()
        }
    }

    #[test]
    fn slo_headers_are_positive_finite_milliseconds() {
        let read = |pairs: &[(&str, &str)]| {
            let map = HeaderMap {
                headers: pairs.iter().map(|(k, v)| header(k, v)).collect(),
            };
            RequestMeta::from_headers(Some(&map)).slo
        };
        let slo = read(&[(SLO_TTFT_HEADER, " 250 "), (SLO_TPOT_HEADER, "12.5")]);
        assert_eq!((slo.ttft_ms, slo.tpot_ms), (Some(250.0), Some(12.5)));
        let slo = read(&[("x-slo-ttft-ms", "300")]);
        assert_eq!(slo.ttft_ms, Some(300.0), "the deprecated alias");
        for bad in ["0", "-5", "NaN", "inf", "soon", ""] {
            let slo = read(&[(SLO_TTFT_HEADER, bad), (SLO_TPOT_HEADER, bad)]);
            assert!(!slo.is_set(), "`{bad}` is no objective");
        }
        let slo = read(&[(SLO_TTFT_HEADER, "200"), ("x-slo-ttft-ms", "junk")]);
        assert_eq!(
            slo.ttft_ms,
            Some(200.0),
            "a bad alias does not erase a good value"
        );
    }

    #[test]
    fn an_oversized_endpoint_selection_is_ignored() {
        let read = |value: &str| {
            let map = HeaderMap {
                headers: vec![header(super::super::conformance::SELECTION_HEADER, value)],
            };
            RequestMeta::from_headers(Some(&map)).endpoint_selection
        };
        assert_eq!(read("10.0.0.7").as_deref(), Some("10.0.0.7"));
        assert_eq!(
            read(&"10.0.0.7,".repeat(300)),
            None,
            "over 2 KiB: no restriction"
        );
    }

    #[test]
    fn reads_path_and_control_headers() {
        let map = HeaderMap {
            headers: vec![
                header(":path", "/v1/chat/completions?x=1"),
                header("X-Gateway-Inference-Objective", " critical "),
                header(FAIRNESS_HEADER, "tenant-a"),
                header(MODEL_REWRITE_HEADER, &"m".repeat(300)),
                header(SESSION_HEADER, "s1"),
                header("X-Kvpick-Endpoint-Scores", "10.0.0.9:1=9"),
                header("x-prefiller-host-port", "10.0.0.9:1"),
                header("x-prefiller-host-port", "10.0.0.8:1"),
                HeaderValue {
                    key: "other".into(),
                    value: "v".into(),
                    ..Default::default()
                },
            ],
        };
        let meta = RequestMeta::from_headers(Some(&map));
        assert_eq!(meta.path, "/v1/chat/completions?x=1");
        assert_eq!(meta.objective.as_deref(), Some("critical"));
        assert_eq!(meta.fairness_id.as_deref(), Some("tenant-a"));
        assert_eq!(meta.model_rewrite, None, "oversized value ignored");
        assert_eq!(meta.session_id.as_deref(), Some("s1"));
        assert_eq!(
            meta.control_headers,
            [
                OBJECTIVE_HEADER,
                FAIRNESS_HEADER,
                MODEL_REWRITE_HEADER,
                "x-kvpick-endpoint-scores",
                "x-prefiller-host-port"
            ]
        );
    }
}
