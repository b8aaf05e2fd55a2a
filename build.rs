//! Compiles the replica exchange's protocol (`proto/kvpick/replica/v1/replica.proto`) into
//! Rust at build time. `protox` parses the file in Rust, so no `protoc` binary is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
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
