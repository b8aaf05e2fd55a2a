//! The Envoy ext-proc endpoint-picker protocol (DESIGN §2).
//!
//! - [`stream`]: the per-request state machine (pure; every ordering rule lives here);
//! - [`service`]: the tonic service that drives one state machine per gRPC stream;
//! - [`mutations`]: the messages sent back (destination header + metadata, body chunks);
//! - [`subset`]: the gateway's subset hint;
//! - [`error`]: request and protocol errors, mapped to statuses in one place.

mod body;
pub mod error;
pub mod mutations;
pub mod service;
pub mod stream;
pub mod subset;

pub use service::ExtProcService;
pub use stream::{RequestStream, StreamContext};
