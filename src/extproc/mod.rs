//! The Envoy ext-proc endpoint-picker protocol (DESIGN §2).
//!
//! - [`stream`]: the per-request state machine (pure; every ordering rule lives here);
//! - [`service`]: the tonic service that drives one state machine per gRPC stream;
//! - [`mutations`]: the messages sent back (destination header + metadata, body chunks);
//! - [`request_body`]: how the gateway sends request bodies, and so how a pick is answered;
//! - [`meta`]: the request headers kvpick reads (path, control headers);
//! - `prepare`: body parsing, model rewrite and tokenization (on the blocking pool);
//! - `response`: the response path, restoring a rewritten model name;
//! - [`scores`]: the score-tracing and prefill headers (and their `kvpick` metadata);
//! - [`handoff`]: what a routing stream hands an observing stream (split filters);
//! - [`dynamic_metadata`]: the metadata the gateway forwards, decoded where it is read;
//! - [`subset`]: the gateway's subset hint;
//! - [`budget`]: the shared body buffer budget and each stream's share of it;
//! - [`admission`]: shedding and flow control before the pick;
//! - [`error`]: request and protocol errors, mapped to statuses in one place.

pub mod admission;
pub mod budget;
pub mod conformance;
pub mod dynamic_metadata;
pub mod error;
pub mod handoff;
pub mod meta;
pub mod mutations;
pub mod prepare;
pub mod request_body;
mod response;
pub mod scores;
pub mod service;
pub mod stream;
pub mod subset;
pub mod usage;

pub use budget::BodyBudget;
pub use service::{ExtProcService, MessageLimits};
pub use stream::{RequestStream, StreamContext, StreamTimeouts};
