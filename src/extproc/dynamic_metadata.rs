//! The dynamic metadata a gateway forwards with each ext-proc message
//! (`ProcessingRequest.metadata_context`), decoded only where kvpick reads it.
//!
//! The field is generated as its encoded bytes (`build.rs`): Envoy repeats the forwarded
//! namespaces in every message of a stream, and kvpick reads them on request headers (the
//! subset hint, an observing stream's pick hand-off) and, for the conformance echo, on
//! response headers — never on the body chunks that make up most of a streamed response.

use bytes::Bytes;
use prost::Message;

use super::error::ProtocolError;
use crate::pb::envoy::config::core::v3::Metadata;

/// Decodes a message's forwarded metadata; `None` when the gateway forwarded none.
pub fn decode(raw: &Bytes) -> Result<Option<Metadata>, ProtocolError> {
    if raw.is_empty() {
        return Ok(None);
    }
    Metadata::decode(raw.clone())
        .map(Some)
        .map_err(|error| ProtocolError::BadMetadata(error.to_string()))
}

/// Encodes `metadata` as a gateway forwards it (tests, and clients built on kvpick's types).
pub fn encode(metadata: &Metadata) -> Bytes {
    metadata.encode_to_vec().into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::google::protobuf::{Struct, Value, value::Kind};

    #[test]
    fn forwarded_metadata_reads_back_and_absent_metadata_is_none() {
        let mut metadata = Metadata::default();
        let mut fields = std::collections::BTreeMap::new();
        fields.insert(
            "x".to_owned(),
            Value {
                kind: Some(Kind::StringValue("10.0.0.1:8000".into())),
            },
        );
        metadata
            .filter_metadata
            .insert("envoy.lb.subset_hint".to_owned(), Struct { fields });
        assert_eq!(decode(&encode(&metadata)), Ok(Some(metadata)));
        assert_eq!(decode(&Bytes::new()), Ok(None));
    }

    #[test]
    fn undecodable_metadata_is_a_protocol_error_not_a_panic() {
        // A length-delimited field 1 (filter_metadata) that claims 100 bytes and has 2.
        let truncated = Bytes::from_static(&[0x0a, 100, 1, 2]);
        assert!(matches!(
            decode(&truncated),
            Err(ProtocolError::BadMetadata(_))
        ));
    }
}
