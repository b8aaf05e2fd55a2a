//! Everything that can go wrong on the ext-proc path, and the one place that maps it to what
//! the gateway sees.
//!
//! A [`Rejection`] becomes an `ImmediateResponse` with an HTTP status and an
//! `inference error: <reason>` body (DESIGN §2). A [`ProtocolError`] means the gateway broke
//! the ext-proc contract; it ends the gRPC stream with a status, and the gateway's failure
//! mode (FailOpen/FailClose) decides what the client sees.

use crate::request::RequestError;
use crate::scheduling::{FlowError, ScheduleError};

/// A request kvpick refuses, with the HTTP status the client gets.
#[derive(Debug, thiserror::Error)]
pub enum Rejection {
    /// The body is not a request kvpick can read (not JSON, no `model`, …).
    #[error("{0}")]
    BadRequest(#[from] RequestError),
    /// The body is over the configured limit.
    #[error("request body exceeds {limit} bytes")]
    BodyTooLarge {
        /// The configured `--max-body-bytes`.
        limit: usize,
    },
    /// The global body buffer budget is used up by other requests.
    #[error("request body buffer budget exhausted, retry later")]
    BufferBudgetExhausted,
    /// The body did not arrive in full within `--request-body-timeout`.
    #[error("request body not received within {limit:?}")]
    BodyTimeout {
        /// The configured timeout.
        limit: std::time::Duration,
    },
    /// The gateway's subset hint left no endpoint of the pool.
    #[error("no endpoint of the pool is in the gateway's subset hint")]
    EmptySubset,
    /// A conformance test's `test-epp-endpoint-selection` named no live endpoint.
    #[error("no endpoint of the pool is in test-epp-endpoint-selection")]
    NoSelectedEndpoint,
    /// The scheduler found no endpoint.
    #[error("{0}")]
    Schedule(#[from] ScheduleError),
    /// The request is sheddable (negative priority) and the pool is saturated.
    #[error("request is sheddable and the pool is saturated")]
    Shed,
    /// Flow control refused or timed the request out.
    #[error("{0}")]
    Queue(FlowError),
    /// kvpick could not finish reading the request (an internal fault, not the client's).
    #[error("internal error: {0}")]
    Internal(&'static str),
}

impl Rejection {
    /// The HTTP status code the client gets.
    pub fn http_status(&self) -> u16 {
        match self {
            Self::BadRequest(_) => 400,
            Self::BodyTooLarge { .. } => 413,
            Self::BodyTimeout { .. } => 408,
            Self::BufferBudgetExhausted
            | Self::EmptySubset
            | Self::NoSelectedEndpoint
            | Self::Schedule(ScheduleError::NoCandidates) => 503,
            Self::Shed | Self::Schedule(ScheduleError::SloUnattainable) => 429,
            Self::Queue(error) => error.http_status(),
            Self::Internal(_) => 500,
        }
    }

    /// The label value for the error metric (GIE-style error codes).
    pub fn error_code(&self) -> &'static str {
        match self {
            Self::BadRequest(_) | Self::BodyTooLarge { .. } => "BadRequest",
            Self::BufferBudgetExhausted => "ResourceExhausted",
            Self::BodyTimeout { .. } => "RequestTimeout",
            Self::EmptySubset
            | Self::NoSelectedEndpoint
            | Self::Schedule(ScheduleError::NoCandidates) => "ServiceUnavailable",
            Self::Shed
            | Self::Schedule(ScheduleError::SloUnattainable)
            | Self::Queue(FlowError::QueueFull) => "InferencePoolResourceExhausted",
            Self::Queue(FlowError::TimedOut) => "ServiceUnavailable",
            Self::Internal(_) => "Internal",
        }
    }
}

/// The gateway broke the ext-proc stream contract.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ProtocolError {
    /// A message arrived that the current phase does not allow.
    #[error("unexpected {message} while {phase}")]
    Unexpected {
        /// The message kind.
        message: &'static str,
        /// The phase.
        phase: &'static str,
    },
    /// A `ProcessingRequest` with no request oneof set.
    #[error("processing request carries no message")]
    Empty,
    /// The gateway sends request bodies in a mode kvpick cannot pick in
    /// ([`super::request_body::RequestBodyMode`]).
    #[error(
        "request_body_mode {mode} is not supported: the pick needs the whole body before the headers go on (use FULL_DUPLEX_STREAMED or BUFFERED)"
    )]
    UnsupportedBodyMode {
        /// The mode's name.
        mode: String,
    },
    /// The forwarded dynamic metadata is not an `envoy.config.core.v3.Metadata`.
    #[error("metadata_context is not a Metadata message: {0}")]
    BadMetadata(String),
    /// The stream sent no request headers within `--request-headers-timeout`.
    #[error("no request headers within {limit:?}")]
    NoHeaders {
        /// The configured timeout.
        limit: std::time::Duration,
    },
}

impl From<ProtocolError> for tonic::Status {
    fn from(error: ProtocolError) -> Self {
        match error {
            ProtocolError::NoHeaders { .. } => tonic::Status::deadline_exceeded(error.to_string()),
            ProtocolError::BadMetadata(_) => tonic::Status::invalid_argument(error.to_string()),
            ProtocolError::UnsupportedBodyMode { .. } => {
                tonic::Status::unimplemented(error.to_string())
            }
            _ => tonic::Status::failed_precondition(error.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_follow_the_protocol() {
        assert_eq!(
            Rejection::BadRequest(RequestError::MissingModel).http_status(),
            400
        );
        assert_eq!(Rejection::BodyTooLarge { limit: 1 }.http_status(), 413);
        assert_eq!(Rejection::EmptySubset.http_status(), 503);
        assert_eq!(Rejection::BufferBudgetExhausted.http_status(), 503);
        let timeout = Rejection::BodyTimeout {
            limit: std::time::Duration::from_secs(30),
        };
        assert_eq!(timeout.http_status(), 408);
        assert_eq!(timeout.to_string(), "request body not received within 30s");
        assert_eq!(
            Rejection::Schedule(ScheduleError::NoCandidates).http_status(),
            503
        );
    }
}
