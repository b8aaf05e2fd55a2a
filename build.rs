//! Compiles kvpick's gRPC protocols into Rust at build time. `protox` parses the `.proto`
//! files in Rust, so no `protoc` binary is needed.
//! - the replica exchange (`proto/kvpick/replica/v1/replica.proto`);
//! - Envoy's external-processing API (`proto/vendor/`, vendored unchanged, README there):
//!   all but the option-only annotation packages become Rust (`src/pb.rs`); those
//!   carry options only, and Google's well-known types are `prost-types`'.

use std::error::Error;

fn main() -> Result<(), Box<dyn Error>> {
    replica()?;
    ext_proc()
}

fn replica() -> Result<(), Box<dyn Error>> {
    let proto = "proto/kvpick/replica/v1/replica.proto";
    println!("cargo:rerun-if-changed={proto}");
    let descriptors = protox::compile([proto], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .emit_rerun_if_changed(false)
        .compile_fds(descriptors)?;
    Ok(())
}

fn ext_proc() -> Result<(), Box<dyn Error>> {
    println!("cargo:rerun-if-changed=proto/vendor");
    let mut descriptors = protox::compile(
        ["envoy/service/ext_proc/v3/external_processor.proto"],
        ["proto/vendor"],
    )?;
    // NOTE: the set holds every imported file; generating the option-only annotation
    // packages (validate's ~40 rule messages among them) would only add compile time.
    // Google's stay in the set (prost reads their messages' fields) but are not generated:
    // they are `prost-types`' by prost's default extern path.
    // An exclusion list: a newer vendored file that imports another package gets it generated
    // (or fails on the missing .proto), not a build error deep in the generated code.
    const OPTIONS_ONLY: [&str; 4] = [
        "validate",
        "udpa.annotations",
        "xds.annotations.v3",
        "envoy.annotations",
    ];
    descriptors
        .file
        .retain(|file| !OPTIONS_ONLY.contains(&file.package()));
    metadata_context_as_bytes(&mut descriptors)?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .emit_rerun_if_changed(false)
        .disable_comments(["."])
        // Bodies as `Bytes`: decoded as slices of the received frame, and a reply's chunks
        // sent as slices of the request's body, instead of a copy each way.
        .bytes(".envoy.service.ext_proc.v3")
        // Header values too: a header map's values are slices of the frame, not a `Vec` each.
        .bytes(".envoy.config.core.v3.HeaderValue")
        .include_file("envoy_ext_proc.rs")
        .compile_fds(descriptors)?;
    Ok(())
}

/// `ProcessingRequest.metadata_context` (an `envoy.config.core.v3.Metadata`) is generated as
/// its encoded bytes, a slice of the frame, which kvpick decodes where it reads it (request
/// headers: the subset hint, the observing stream's hand-off).
// NOTE: Envoy copies the forwarded namespaces into every message of a stream, so each
// response chunk of an observing stream carries the pick's hand-off again; decoding it into
// maps of strings per chunk was ~4% of kvpick's CPU under a streaming load (perf). The two
// are the same on the wire (a length-delimited field), and the vendored .proto stays as
// Envoy publishes it: only the descriptor handed to the generator changes.
fn metadata_context_as_bytes(
    descriptors: &mut tonic_prost_build::FileDescriptorSet,
) -> Result<(), Box<dyn Error>> {
    /// `FieldDescriptorProto.Type.TYPE_BYTES`.
    const TYPE_BYTES: i32 = 12;
    let field = descriptors
        .file
        .iter_mut()
        .filter(|file| file.package() == "envoy.service.ext_proc.v3")
        .flat_map(|file| file.message_type.iter_mut())
        .filter(|message| message.name() == "ProcessingRequest")
        .flat_map(|message| message.field.iter_mut())
        .find(|field| field.name() == "metadata_context")
        .ok_or("ProcessingRequest.metadata_context not found in the vendored ext_proc proto")?;
    if field.type_name() != ".envoy.config.core.v3.Metadata" {
        return Err(format!(
            "ProcessingRequest.metadata_context is a {}, not the Metadata kvpick decodes",
            field.type_name()
        )
        .into());
    }
    field.r#type = Some(TYPE_BYTES);
    field.type_name = None;
    Ok(())
}
