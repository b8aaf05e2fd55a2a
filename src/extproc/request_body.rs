//! How the gateway sends the request body (its `processing_mode.request_body_mode`, told in
//! the first message's `protocol_config`), which decides how kvpick answers a pick.
//!
//! - `FULL_DUPLEX_STREAMED` (GIE's EPP protocol, DESIGN §2): Envoy sends the headers and the
//!   body chunks without waiting and keeps no copy; kvpick answers the headers with the pick
//!   once the body is in, and streams the body back.
//! - `BUFFERED`: Envoy sends the headers (kvpick continues them at once, holding nothing),
//!   holds the body until it is complete and sends it as one message; kvpick answers that
//!   message with the pick as header mutations. No body bytes go back unless the model was
//!   rewritten. One more round trip than full duplex, one body copy less each way.
//!
//! `STREAMED` and `BUFFERED_PARTIAL` are refused: in both the headers leave Envoy before the
//! whole body has reached kvpick, so the pick could not use the prompt.

use super::error::ProtocolError;
use crate::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use crate::pb::envoy::service::ext_proc::v3::ProtocolConfiguration;

/// How request bodies reach kvpick, and so how a pick is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RequestBodyMode {
    /// `FULL_DUPLEX_STREAMED`: the pick answers the headers; the body goes back in chunks.
    #[default]
    FullDuplex,
    /// `BUFFERED`: the headers are continued at once; the pick answers the whole body.
    Buffered,
}

impl RequestBodyMode {
    /// The mode a gateway's `protocol_config` announces.
    ///
    /// NOTE: `NONE` is read as full duplex, as is a gateway that sends no `protocol_config`
    /// (older Envoys, other ext-proc clients): protobuf cannot tell `NONE` from an unset
    /// field, and a gateway that leaves it unset but streams the body must keep working. An
    /// observing stream (`request_body_mode: NONE`) never reaches the request-body path.
    pub fn from_config(config: &ProtocolConfiguration) -> Result<Self, ProtocolError> {
        // Not the generated getter: it reads an unknown value (a newer Envoy's mode) as NONE.
        let unsupported = |mode: String| Err(ProtocolError::UnsupportedBodyMode { mode });
        match BodySendMode::try_from(config.request_body_mode) {
            Ok(BodySendMode::FullDuplexStreamed | BodySendMode::None) => Ok(Self::FullDuplex),
            Ok(BodySendMode::Buffered) => Ok(Self::Buffered),
            Ok(other) => unsupported(other.as_str_name().to_owned()),
            Err(_) => unsupported(format!("unknown mode {}", config.request_body_mode)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(mode: BodySendMode) -> ProtocolConfiguration {
        ProtocolConfiguration {
            request_body_mode: mode as i32,
            ..Default::default()
        }
    }

    #[test]
    fn modes_that_deliver_the_whole_body_are_accepted_and_the_others_refused() {
        let mode = |m| RequestBodyMode::from_config(&config(m));
        assert_eq!(
            mode(BodySendMode::FullDuplexStreamed),
            Ok(RequestBodyMode::FullDuplex)
        );
        assert_eq!(mode(BodySendMode::None), Ok(RequestBodyMode::FullDuplex));
        assert_eq!(mode(BodySendMode::Buffered), Ok(RequestBodyMode::Buffered));
        let refused = mode(BodySendMode::Streamed).expect_err("refused");
        assert!(refused.to_string().contains("STREAMED"), "{refused}");
        assert!(mode(BodySendMode::BufferedPartial).is_err());
        // A value this build does not know (a newer Envoy's mode) is refused, not guessed.
        let unknown = ProtocolConfiguration {
            request_body_mode: 99,
            ..Default::default()
        };
        assert!(RequestBodyMode::from_config(&unknown).is_err());
    }
}
