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
//! The hand-off is one string field (`pick`: a JSON array, [`PickHandoff::to_value`]) rather
//! than a struct of nine: Envoy copies the forwarded namespace into every message of the
//! observing stream (each response chunk), so each field it holds is a map entry Envoy copies,
//! encodes and frees per chunk and kvpick's connection reads past per chunk.
//!
//! The pick itself is counted from the decision on, under a token the hand-off carries
//! (`crate::endpoints::PendingPicks`): an observing stream on the same replica takes that
//! count over rather than starting its own, so picks made before their observing streams are
//! read (a burst on one connection) see each other. A hand-off without a token (an older
//! routing replica) is counted from the observing stream on, as before.
//!
//! NOTE: the layouts of earlier versions are still read (the struct of nine fields, and the
//! `pick` array without its tenth element, the token), so during a rollout an observing
//! replica of this version follows a routing replica of the last. The other way round (an
//! older replica reading this layout) the older one logs an unreadable hand-off and does not
//! observe that response, which costs a rollout's worth of observations, not requests. The
//! token rides in the array rather than in a field of its own for the reason above: a field
//! would be copied with every response chunk.

use std::net::SocketAddr;

use crate::pb::envoy::config::core::v3::Metadata;
use crate::pb::google::protobuf::{Struct, Value, value::Kind};

use crate::telemetry::RequestLabels;

/// Dynamic-metadata namespace of the hand-off.
pub const PICK_NAMESPACE: &str = "kvpick.pick";

/// The namespace's one field: the hand-off as a JSON array.
const PICK_FIELD: &str = "pick";

/// Longest label value carried (longer ones are refused, not cut: kvpick wrote them).
const MAX_LABEL_BYTES: usize = 1024;
/// Longest hand-off string read: three labels at their longest, each byte escaped as JSON's
/// longest escape (`\u0001`: 6 bytes), with their quotes, and the endpoint, numbers and
/// priority (under 256 bytes).
const MAX_PICK_BYTES: usize = 3 * (6 * MAX_LABEL_BYTES + 3) + 256;
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
    /// The routing replica's reservation of the pick (`None` from versions before it).
    pub reservation: Option<u64>,
}

/// Why the forwarded hand-off could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandoffError {
    /// A field is missing or of the wrong type.
    #[error("field `{0}` is missing or not of its type")]
    Field(&'static str),
    /// The `pick` string is not the JSON array kvpick writes.
    #[error("`pick` is not a hand-off: {0}")]
    Compact(String),
    /// The `pick` string is longer than any kvpick writes.
    #[error("`pick` is {0} bytes, longer than any hand-off")]
    TooLong(usize),
    /// The endpoint is not `ip:port`.
    #[error("endpoint `{0}` is not ip:port")]
    Endpoint(String),
    /// A number is negative, not finite, or too large.
    #[error("field `{0}` is out of range")]
    Range(&'static str),
}

/// The hand-off's fields in the order of the `pick` array: endpoint, uncached, cached,
/// predicted ms (or `null`), streamed, model, target model, fairness id, priority, and the
/// reservation's token (absent from versions before it).
/// NOTE: the strings are read as owned copies (serde cannot borrow into a tuple), once per
/// request; numbers travel as JSON decimals, which may come back an ULP off — nothing that
/// reads them can tell.
#[derive(serde::Deserialize)]
struct CompactPick(
    String,
    f64,
    f64,
    Option<f64>,
    bool,
    String,
    String,
    String,
    String,
    #[serde(default)] Option<u64>,
);

/// A hand-off's fields as read, before they are checked.
struct RawPick<'a> {
    endpoint: &'a str,
    uncached: f64,
    cached: f64,
    predicted_ms: Option<f64>,
    streamed: bool,
    model: &'a str,
    target_model: &'a str,
    fairness_id: &'a str,
    priority: &'a str,
    reservation: Option<u64>,
}

impl PickHandoff {
    /// The hand-off as the value of [`PICK_NAMESPACE`] in a reply's dynamic metadata.
    pub fn to_value(&self) -> Value {
        // A prediction that is not a finite number is no prediction (JSON has no NaN).
        let predicted_ms = self.predicted_ms.filter(|ms| ms.is_finite());
        let pick = (
            self.endpoint.to_string(),
            self.uncached_tokens,
            self.cached_tokens,
            predicted_ms,
            self.streamed,
            &self.labels.model,
            &self.labels.target_model,
            &self.labels.fairness_id,
            &self.labels.priority,
            self.reservation,
        );
        // NOTE: serializing strings, numbers and a bool into a `String` cannot fail (a
        // non-finite count becomes `null`, which the reader refuses: not a number); the empty
        // string of an impossible failure would be refused by the reader, not misread.
        let text = serde_json::to_string(&pick).unwrap_or_default();
        let mut fields = std::collections::BTreeMap::new();
        fields.insert(
            PICK_FIELD.to_owned(),
            Value {
                kind: Some(Kind::StringValue(text)),
            },
        );
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
        match fields.get(PICK_FIELD).and_then(|v| v.kind.as_ref()) {
            Some(Kind::StringValue(text)) if text.len() > MAX_PICK_BYTES => {
                Err(HandoffError::TooLong(text.len()))
            }
            Some(Kind::StringValue(text)) => {
                let pick: CompactPick = serde_json::from_str(text)
                    .map_err(|error| HandoffError::Compact(error.to_string()))?;
                let CompactPick(
                    endpoint,
                    uncached,
                    cached,
                    predicted_ms,
                    streamed,
                    model,
                    target,
                    fairness,
                    priority,
                    reservation,
                ) = &pick;
                RawPick {
                    endpoint,
                    uncached: *uncached,
                    cached: *cached,
                    predicted_ms: *predicted_ms,
                    streamed: *streamed,
                    model,
                    target_model: target,
                    fairness_id: fairness,
                    priority,
                    reservation: *reservation,
                }
                .check()
                .map(Some)
            }
            Some(_) => Err(HandoffError::Field(PICK_FIELD)),
            None => Self::from_fields(fields).map(Some),
        }
    }

    /// The nine-field layout kvpick wrote before the `pick` string.
    fn from_fields(
        fields: &std::collections::BTreeMap<String, Value>,
    ) -> Result<Self, HandoffError> {
        let kind = |key: &str| fields.get(key).and_then(|v| v.kind.as_ref());
        let text = |key: &'static str| match kind(key) {
            Some(Kind::StringValue(s)) => Ok(s.as_str()),
            _ => Err(HandoffError::Field(key)),
        };
        let count = |key: &'static str| match kind(key) {
            Some(Kind::NumberValue(n)) => Ok(*n),
            _ => Err(HandoffError::Field(key)),
        };
        let predicted_ms = match kind("predicted_ms") {
            None => None,
            Some(Kind::NumberValue(n)) => Some(*n),
            Some(_) => return Err(HandoffError::Range("predicted_ms")),
        };
        let streamed = match kind("stream") {
            Some(Kind::BoolValue(b)) => *b,
            _ => return Err(HandoffError::Field("stream")),
        };
        RawPick {
            endpoint: text("endpoint")?,
            uncached: count("uncached")?,
            cached: count("cached")?,
            predicted_ms,
            streamed,
            model: text("model")?,
            target_model: text("target_model")?,
            fairness_id: text("fairness_id")?,
            priority: text("priority")?,
            reservation: None,
        }
        .check()
    }
}

impl RawPick<'_> {
    /// The hand-off, once every field is in range.
    fn check(self) -> Result<PickHandoff, HandoffError> {
        let label = |key: &'static str, value: &str| {
            if value.len() <= MAX_LABEL_BYTES {
                Ok(())
            } else {
                Err(HandoffError::Field(key))
            }
        };
        let count = |key: &'static str, n: f64| {
            if n.is_finite() && (0.0..=MAX_TOKENS).contains(&n) {
                Ok(n)
            } else {
                Err(HandoffError::Range(key))
            }
        };
        // Every string is bounded before it is parsed or copied into an error.
        label("endpoint", self.endpoint)?;
        label("priority", self.priority)?;
        label("model", self.model)?;
        label("target_model", self.target_model)?;
        label("fairness_id", self.fairness_id)?;
        let endpoint = self
            .endpoint
            .parse()
            .map_err(|_| HandoffError::Endpoint(self.endpoint.to_owned()))?;
        let predicted_ms = match self.predicted_ms {
            Some(n) if !(n.is_finite() && n >= 0.0) => {
                return Err(HandoffError::Range("predicted_ms"));
            }
            other => other,
        };
        let priority: i32 = self
            .priority
            .parse()
            .map_err(|_| HandoffError::Range("priority"))?;
        Ok(PickHandoff {
            endpoint,
            uncached_tokens: count("uncached", self.uncached)?,
            cached_tokens: count("cached", self.cached)?,
            predicted_ms,
            streamed: self.streamed,
            labels: RequestLabels::new(
                Some(self.model),
                Some(self.target_model),
                Some(self.fairness_id),
                priority,
            ),
            reservation: self.reservation,
        })
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
            // Above 2^53: a token must come back exactly, not as a JSON double.
            reservation: Some(u64::MAX - 3),
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

    fn text(s: &str) -> Value {
        Value {
            kind: Some(Kind::StringValue(s.to_owned())),
        }
    }

    fn number(n: f64) -> Value {
        Value {
            kind: Some(Kind::NumberValue(n)),
        }
    }

    /// The hand-off as kvpick wrote it before the `pick` string: nine fields.
    fn nine_fields(pick: &PickHandoff) -> Metadata {
        let mut fields = std::collections::BTreeMap::new();
        fields.insert("endpoint".to_owned(), text(&pick.endpoint.to_string()));
        fields.insert("uncached".to_owned(), number(pick.uncached_tokens));
        fields.insert("cached".to_owned(), number(pick.cached_tokens));
        if let Some(ms) = pick.predicted_ms {
            fields.insert("predicted_ms".to_owned(), number(ms));
        }
        fields.insert(
            "stream".to_owned(),
            Value {
                kind: Some(Kind::BoolValue(pick.streamed)),
            },
        );
        fields.insert("model".to_owned(), text(&pick.labels.model));
        fields.insert("target_model".to_owned(), text(&pick.labels.target_model));
        fields.insert("fairness_id".to_owned(), text(&pick.labels.fairness_id));
        fields.insert("priority".to_owned(), text(&pick.labels.priority));
        forwarded(Value {
            kind: Some(Kind::StructValue(Struct { fields })),
        })
    }

    /// The forwarded namespace with its `pick` field set to `value`.
    fn with_pick(value: Value) -> Metadata {
        let mut fields = std::collections::BTreeMap::new();
        fields.insert(PICK_FIELD.to_owned(), value);
        forwarded(Value {
            kind: Some(Kind::StructValue(Struct { fields })),
        })
    }

    #[test]
    fn a_hand_off_reads_back_as_written() {
        let pick = sample();
        let written = pick.to_value();
        let Some(Kind::StructValue(fields)) = &written.kind else {
            panic!("a struct");
        };
        assert_eq!(fields.fields.len(), 1, "one field: {fields:?}");
        let read = PickHandoff::from_metadata(Some(&forwarded(written)));
        assert_eq!(read, Ok(Some(pick.clone())));
        let unpredicted = PickHandoff {
            predicted_ms: None,
            ..pick.clone()
        };
        let read = PickHandoff::from_metadata(Some(&forwarded(unpredicted.to_value())));
        assert_eq!(read, Ok(Some(unpredicted)));
        // Labels are the client's words: quotes, separators, escapes and any script.
        let odd = PickHandoff {
            endpoint: "[fd00::17]:8000".parse().expect("addr"),
            labels: RequestLabels::new(
                Some("a \"quoted\", [model]\n"),
                Some("模型/served\\x"),
                Some(""),
                i32::MIN,
            ),
            ..pick
        };
        let read = PickHandoff::from_metadata(Some(&forwarded(odd.to_value())));
        assert_eq!(read, Ok(Some(odd)));
    }

    #[test]
    fn the_longest_labels_fit_even_when_every_byte_is_escaped() {
        // A control character is JSON's longest escape (`\u0001`, six bytes for one).
        let longest = "\u{1}".repeat(MAX_LABEL_BYTES);
        let pick = PickHandoff {
            endpoint: "[fd00:aaaa:bbbb:cccc:dddd:eeee:ffff:1111]:65535"
                .parse()
                .expect("addr"),
            uncached_tokens: MAX_TOKENS,
            cached_tokens: 0.123_456_789,
            predicted_ms: Some(1e9),
            labels: RequestLabels::new(Some(&longest), Some(&longest), Some(&longest), i32::MIN),
            ..sample()
        };
        let read = PickHandoff::from_metadata(Some(&forwarded(pick.to_value())));
        assert_eq!(read, Ok(Some(pick.clone())));
        // One byte more is refused as a label kvpick would not have written.
        let over = PickHandoff {
            labels: RequestLabels::new(Some(&format!("{longest}x")), Some("m"), None, 0),
            ..pick
        };
        assert_eq!(
            PickHandoff::from_metadata(Some(&forwarded(over.to_value()))),
            Err(HandoffError::Field("model"))
        );
    }

    #[test]
    fn non_finite_numbers_are_written_as_no_prediction_or_refused() {
        let unpredictable = PickHandoff {
            predicted_ms: Some(f64::NAN),
            ..sample()
        };
        assert_eq!(
            PickHandoff::from_metadata(Some(&forwarded(unpredictable.to_value()))),
            Ok(Some(PickHandoff {
                predicted_ms: None,
                ..sample()
            }))
        );
        let uncountable = PickHandoff {
            uncached_tokens: f64::INFINITY,
            ..sample()
        };
        assert!(matches!(
            PickHandoff::from_metadata(Some(&forwarded(uncountable.to_value()))),
            Err(HandoffError::Compact(_))
        ));
    }

    #[test]
    fn a_reservation_token_is_read_exactly_and_a_bad_one_is_refused() {
        let with = |token: &str| {
            let pick = format!(
                r#"["10.0.0.7:8000",312.0,2048.0,41.5,true,"alias","served","tenant-a","-1",{token}]"#
            );
            PickHandoff::from_metadata(Some(&with_pick(text(&pick))))
        };
        let token = |read: Result<Option<PickHandoff>, HandoffError>| {
            read.map(|p| p.and_then(|p| p.reservation))
        };
        assert_eq!(token(with("18446744073709551615")), Ok(Some(u64::MAX)));
        assert_eq!(token(with("null")), Ok(None));
        for bad in ["-1", "1.5", "\"7\"", "18446744073709551616", "[1]"] {
            assert!(
                matches!(with(bad), Err(HandoffError::Compact(_))),
                "{bad}: {:?}",
                with(bad)
            );
        }
    }

    #[test]
    fn the_nine_field_layout_is_still_read() {
        let pick = PickHandoff {
            reservation: None,
            ..sample()
        };
        assert_eq!(
            PickHandoff::from_metadata(Some(&nine_fields(&pick))),
            Ok(Some(pick.clone()))
        );
        let unpredicted = PickHandoff {
            predicted_ms: None,
            ..pick
        };
        assert_eq!(
            PickHandoff::from_metadata(Some(&nine_fields(&unpredicted))),
            Ok(Some(unpredicted))
        );
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
            let mut metadata = nine_fields(&sample());
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
            edit("endpoint", Some(text("pod-a"))),
            Err(HandoffError::Endpoint("pod-a".into()))
        );
        assert_eq!(edit("endpoint", None), Err(HandoffError::Field("endpoint")));
        // A long endpoint is refused before it is copied into the error.
        assert_eq!(
            edit("endpoint", Some(text(&"9".repeat(1 << 20)))),
            Err(HandoffError::Field("endpoint"))
        );
        assert_eq!(
            edit("uncached", Some(number(f64::NAN))),
            Err(HandoffError::Range("uncached"))
        );
        assert_eq!(
            edit("cached", Some(number(-1.0))),
            Err(HandoffError::Range("cached"))
        );
        assert_eq!(
            edit("cached", Some(text("12"))),
            Err(HandoffError::Field("cached"))
        );
        assert_eq!(
            edit("predicted_ms", Some(number(f64::INFINITY))),
            Err(HandoffError::Range("predicted_ms"))
        );
        assert_eq!(edit("stream", None), Err(HandoffError::Field("stream")));
        assert_eq!(
            edit("priority", Some(text("99999999999"))),
            Err(HandoffError::Range("priority"))
        );
        assert_eq!(
            edit("model", Some(text(&"m".repeat(MAX_LABEL_BYTES + 1)))),
            Err(HandoffError::Field("model"))
        );
    }

    #[test]
    fn a_bad_pick_string_is_refused_with_its_cause() {
        let read = |pick: &str| PickHandoff::from_metadata(Some(&with_pick(text(pick))));
        // The layout of the version before reservations (nine elements) is still read.
        let good = r#"["10.0.0.7:8000",312.0,2048.0,41.5,true,"alias","served","tenant-a","-1"]"#;
        let unreserved = PickHandoff {
            reservation: None,
            ..sample()
        };
        assert_eq!(read(good), Ok(Some(unreserved)));
        for garbage in [
            "",
            "not json",
            "{}",
            r#"["10.0.0.7:8000",312.0,2048.0,41.5,true,"alias","served","tenant-a"]"#,
            r#"["10.0.0.7:8000",312.0,2048.0,41.5,true,"alias","served","tenant-a","-1",7,8]"#,
            r#"["10.0.0.7:8000","312",2048.0,41.5,true,"alias","served","tenant-a","-1"]"#,
            r#"["10.0.0.7:8000",null,2048.0,41.5,true,"alias","served","tenant-a","-1"]"#,
            r#"["10.0.0.7:8000",312.0,2048.0,41.5,1,"alias","served","tenant-a","-1"]"#,
        ] {
            assert!(
                matches!(read(garbage), Err(HandoffError::Compact(_))),
                "{garbage:?}: {:?}",
                read(garbage)
            );
        }
        let edit = |from: &str, to: &str| read(&good.replacen(from, to, 1));
        assert_eq!(
            edit("10.0.0.7:8000", "pod-a"),
            Err(HandoffError::Endpoint("pod-a".into()))
        );
        assert_eq!(edit("312.0", "-1.0"), Err(HandoffError::Range("uncached")));
        assert_eq!(edit("2048.0", "1e300"), Err(HandoffError::Range("cached")));
        assert_eq!(
            edit("41.5", "-0.5"),
            Err(HandoffError::Range("predicted_ms"))
        );
        assert_eq!(
            edit("\"-1\"", "\"99999999999\""),
            Err(HandoffError::Range("priority"))
        );
        assert_eq!(
            edit("alias", &"m".repeat(MAX_LABEL_BYTES + 1)),
            Err(HandoffError::Field("model"))
        );
        assert_eq!(
            read(&" ".repeat(MAX_PICK_BYTES + 1)),
            Err(HandoffError::TooLong(MAX_PICK_BYTES + 1))
        );
        assert_eq!(
            PickHandoff::from_metadata(Some(&with_pick(number(1.0)))),
            Err(HandoffError::Field(PICK_FIELD))
        );
    }
}
