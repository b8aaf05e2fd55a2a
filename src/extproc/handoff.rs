//! The hand-off from a routing stream to an observing stream: kvpick's work split over two
//! ext_proc filters (`deploy/envoy/envoy.yaml`).
//!
//! The routing filter sends the request and none of the response (response modes SKIP and
//! NONE); a second filter in Envoy's `observability_mode` sends the request headers and the
//! response without waiting for answers ("send and go"). Why: a response no longer passes
//! through kvpick, so a replica that dies mid-response costs no request (with one filter the
//! chunk Envoy had handed the dead replica was lost, and the request with it), and kvpick
//! adds nothing to the response's latency and sends no reply per chunk.
//!
//! Envoy closes the routing stream as soon as its request half is done, so the routing
//! stream ends at its decision (counting the request nowhere), and what the response half
//! needs of the decision travels in the `kvpick.pick` dynamic-metadata namespace, which the
//! routing filter accepts and the observing filter forwards. The observing stream may be on
//! another replica than the routing one: that replica counts the request in flight and
//! awaiting its first byte from then on, times its first byte and chunks, and reads its
//! usage. Replicas add their in-flight counts up over the exchange, so a request counted on
//! the observing replica still counts for all; its prefill backlog and timing teach the
//! observing replica's fit, as each replica's own picks teach it with one filter. Flow
//! control's progress signal (a response ended, so a queued request at its TTL may still go)
//! is likewise counted by the replica that observed the end; with several replicas each sees
//! about its share of the pool's completions.
//!
//! A gateway is in split mode when the routing stream's `protocol_config` says the response
//! body is not sent (`response_body_mode: NONE`), and a stream is an observing one when its
//! messages carry `observability_mode`.
//!
//! NOTE: between the routing stream's decision and the observing stream's request headers
//! (the next filter of the same request, well under a millisecond) the request is counted
//! nowhere; counting it in both would double it for the same instant on a single replica.

use std::net::SocketAddr;

use crate::pb::envoy::config::core::v3::Metadata;
use crate::pb::google::protobuf::{Struct, Value, value::Kind};

use super::mutations::string_value;
use crate::telemetry::RequestLabels;

/// Dynamic-metadata namespace of the hand-off.
pub const PICK_NAMESPACE: &str = "kvpick.pick";

/// Longest label value carried (longer ones are refused, not cut: kvpick wrote them).
const MAX_LABEL_BYTES: usize = 1024;
/// Largest token count carried (a 100M-token prompt is no request).
const MAX_TOKENS: f64 = 1e8;

/// What the response half needs of a pick.
#[derive(Debug, Clone, PartialEq)]
pub struct PickHandoff {
    /// The pod the request was sent to (the first of the destination list).
    pub endpoint: SocketAddr,
    /// Prompt tokens the pod had to prefill, as predicted at the pick.
    pub uncached_tokens: f64,
    /// Prompt tokens the pod held, as predicted at the pick.
    pub cached_tokens: f64,
    /// The predicted time to first token, ms, when the scheduler predicted one.
    pub predicted_ms: Option<f64>,
    /// Whether the client asked for a streamed response.
    pub streamed: bool,
    /// The request's metric labels.
    pub labels: RequestLabels,
}

/// Why the forwarded hand-off could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandoffError {
    /// A field is missing or of the wrong type.
    #[error("field `{0}` is missing or not of its type")]
    Field(&'static str),
    /// The endpoint is not `ip:port`.
    #[error("endpoint `{0}` is not ip:port")]
    Endpoint(String),
    /// A number is negative, not finite, or too large.
    #[error("field `{0}` is out of range")]
    Range(&'static str),
}

fn number(value: f64) -> Value {
    Value {
        kind: Some(Kind::NumberValue(value)),
    }
}

impl PickHandoff {
    /// The hand-off as the value of [`PICK_NAMESPACE`] in a reply's dynamic metadata.
    pub fn to_value(&self) -> Value {
        let mut fields = std::collections::BTreeMap::new();
        fields.insert(
            "endpoint".to_owned(),
            string_value(&self.endpoint.to_string()),
        );
        fields.insert("uncached".to_owned(), number(self.uncached_tokens));
        fields.insert("cached".to_owned(), number(self.cached_tokens));
        if let Some(ms) = self.predicted_ms {
            fields.insert("predicted_ms".to_owned(), number(ms));
        }
        fields.insert(
            "stream".to_owned(),
            Value {
                kind: Some(Kind::BoolValue(self.streamed)),
            },
        );
        fields.insert("model".to_owned(), string_value(&self.labels.model));
        fields.insert(
            "target_model".to_owned(),
            string_value(&self.labels.target_model),
        );
        fields.insert(
            "fairness_id".to_owned(),
            string_value(&self.labels.fairness_id),
        );
        fields.insert("priority".to_owned(), string_value(&self.labels.priority));
        Value {
            kind: Some(Kind::StructValue(Struct { fields })),
        }
    }

    /// Reads the hand-off the observing filter forwarded; `Ok(None)` when there is none (the
    /// request was not routed by kvpick: failed open, or answered by kvpick itself).
    pub fn from_metadata(metadata: Option<&Metadata>) -> Result<Option<Self>, HandoffError> {
        let Some(fields) = metadata.and_then(|m| m.filter_metadata.get(PICK_NAMESPACE)) else {
            return Ok(None);
        };
        let fields = &fields.fields;
        let text = |key: &'static str| match fields.get(key).and_then(|v| v.kind.as_ref()) {
            Some(Kind::StringValue(s)) if s.len() <= MAX_LABEL_BYTES => Ok(s.as_str()),
            _ => Err(HandoffError::Field(key)),
        };
        let count = |key: &'static str| match fields.get(key).and_then(|v| v.kind.as_ref()) {
            Some(Kind::NumberValue(n)) if n.is_finite() && (0.0..=MAX_TOKENS).contains(n) => Ok(*n),
            Some(Kind::NumberValue(_)) => Err(HandoffError::Range(key)),
            _ => Err(HandoffError::Field(key)),
        };
        let endpoint = text("endpoint")?;
        let endpoint = endpoint
            .parse()
            .map_err(|_| HandoffError::Endpoint(endpoint.to_owned()))?;
        let predicted_ms = match fields.get("predicted_ms").and_then(|v| v.kind.as_ref()) {
            None => None,
            Some(Kind::NumberValue(n)) if n.is_finite() && *n >= 0.0 => Some(*n),
            Some(_) => return Err(HandoffError::Range("predicted_ms")),
        };
        let streamed = match fields.get("stream").and_then(|v| v.kind.as_ref()) {
            Some(Kind::BoolValue(b)) => *b,
            _ => return Err(HandoffError::Field("stream")),
        };
        let priority: i32 = text("priority")?
            .parse()
            .map_err(|_| HandoffError::Range("priority"))?;
        let labels = RequestLabels::new(
            Some(text("model")?),
            Some(text("target_model")?),
            Some(text("fairness_id")?),
            priority,
        );
        Ok(Some(Self {
            endpoint,
            uncached_tokens: count("uncached")?,
            cached_tokens: count("cached")?,
            predicted_ms,
            streamed,
            labels,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> PickHandoff {
        PickHandoff {
            endpoint: "10.0.0.7:8000".parse().expect("addr"),
            uncached_tokens: 312.0,
            cached_tokens: 2048.0,
            predicted_ms: Some(41.5),
            streamed: true,
            labels: RequestLabels::new(Some("alias"), Some("served"), Some("tenant-a"), -1),
        }
    }

    fn forwarded(value: Value) -> Metadata {
        let Some(Kind::StructValue(fields)) = value.kind else {
            panic!("a struct");
        };
        let mut metadata = Metadata::default();
        metadata
            .filter_metadata
            .insert(PICK_NAMESPACE.to_owned(), fields);
        metadata
    }

    #[test]
    fn a_hand_off_reads_back_as_written() {
        let pick = sample();
        let read = PickHandoff::from_metadata(Some(&forwarded(pick.to_value())));
        assert_eq!(read, Ok(Some(pick.clone())));
        let unpredicted = PickHandoff {
            predicted_ms: None,
            ..pick
        };
        let read = PickHandoff::from_metadata(Some(&forwarded(unpredicted.to_value())));
        assert_eq!(read, Ok(Some(unpredicted)));
    }

    #[test]
    fn no_namespace_is_no_hand_off() {
        assert_eq!(PickHandoff::from_metadata(None), Ok(None));
        assert_eq!(
            PickHandoff::from_metadata(Some(&Metadata::default())),
            Ok(None)
        );
    }

    #[test]
    fn a_bad_hand_off_names_its_field() {
        let edit = |key: &str, value: Option<Value>| {
            let mut metadata = forwarded(sample().to_value());
            let fields = &mut metadata
                .filter_metadata
                .get_mut(PICK_NAMESPACE)
                .expect("namespace")
                .fields;
            match value {
                Some(v) => fields.insert(key.to_owned(), v),
                None => fields.remove(key),
            };
            PickHandoff::from_metadata(Some(&metadata))
        };
        assert_eq!(
            edit("endpoint", Some(string_value("pod-a"))),
            Err(HandoffError::Endpoint("pod-a".into()))
        );
        assert_eq!(edit("endpoint", None), Err(HandoffError::Field("endpoint")));
        assert_eq!(
            edit("uncached", Some(number(f64::NAN))),
            Err(HandoffError::Range("uncached"))
        );
        assert_eq!(
            edit("cached", Some(number(-1.0))),
            Err(HandoffError::Range("cached"))
        );
        assert_eq!(
            edit("cached", Some(string_value("12"))),
            Err(HandoffError::Field("cached"))
        );
        assert_eq!(
            edit("predicted_ms", Some(number(f64::INFINITY))),
            Err(HandoffError::Range("predicted_ms"))
        );
        assert_eq!(edit("stream", None), Err(HandoffError::Field("stream")));
        assert_eq!(
            edit("priority", Some(string_value("99999999999"))),
            Err(HandoffError::Range("priority"))
        );
        assert_eq!(
            edit(
                "model",
                Some(string_value(&"m".repeat(MAX_LABEL_BYTES + 1)))
            ),
            Err(HandoffError::Field("model"))
        );
    }
}
