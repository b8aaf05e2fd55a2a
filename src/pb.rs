//! Envoy's external-processing API as Rust types, generated at build time from the vendored
//! `.proto` files (`proto/vendor/`, `build.rs`): the messages, the `ExternalProcessor`
//! service (server for kvpick, client for its tests) and what they import. Paths follow the
//! protobuf packages (`pb::envoy::service::ext_proc::v3::ProcessingRequest`); Google's
//! well-known types are `prost-types`' (`pb::google::protobuf::Struct`).

#![allow(missing_docs, clippy::all, clippy::pedantic)]

include!(concat!(env!("OUT_DIR"), "/envoy_ext_proc.rs"));

/// Google's well-known types, as the generated code names them.
pub mod google {
    /// `google.protobuf`.
    pub mod protobuf {
        pub use prost_types::*;
    }
}
