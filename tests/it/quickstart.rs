//! The README's quickstart, run for real: `scripts/demo.sh --once` brings up Envoy, kvpick
//! and two simulated pods on the default ports, sends a request through Envoy and checks that
//! kvpick picked the pod that served it.
//!
//! NOTE: the demo binds the fixed default ports (8081, 9002, 9003, 9090, 9901, 8101-8102,
//! 5557-5558, 6557-6558); no other test uses them (they take ephemeral ports).

use std::path::Path;
use std::process::Command;

#[test]
fn the_quickstart_demo_routes_a_request_through_kvpick() {
    let bin_dir = Path::new(env!("CARGO_BIN_EXE_kvpick"))
        .parent()
        .expect("binary directory");
    assert!(
        bin_dir.join("kvpick-sim").exists(),
        "kvpick-sim is built next to kvpick"
    );
    let output = Command::new("bash")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/demo.sh"))
        .arg("--once")
        .env("KVPICK_BIN_DIR", bin_dir)
        .output()
        .expect("run scripts/demo.sh");
    let stderr = String::from_utf8_lossy(&output.stderr);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "demo failed:\n{stderr}\n{stdout}");
    assert!(stderr.contains("demo: ok"), "{stderr}");
    assert!(stdout.contains("\"chat.completion\""), "{stdout}");
}
