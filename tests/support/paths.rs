//! Where test data lives: the repository's own files and the shared real-vLLM captures in
//! `../shared/fixtures/` beside the checkout. Std only, so a test that needs nothing else of
//! `support` includes just this file (`#[path = "support/paths.rs"] mod paths;`, also from the
//! other workspace crates' tests) instead of compiling all of `support` for two paths.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// The repository (workspace) root, from the tests of any workspace package.
pub fn repo_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    // The workspace root is the nearest directory holding the (committed) Cargo.lock.
    manifest
        .ancestors()
        .find(|dir| dir.join("Cargo.lock").is_file())
        .unwrap_or(manifest)
        .to_path_buf()
}

/// The shared fixtures: `../shared/fixtures` beside the checkout, else
/// `/work/shared/fixtures` (for a git worktree that is not beside `shared/`).
pub fn fixtures() -> PathBuf {
    let local = repo_root().join("../shared/fixtures");
    if local.exists() {
        local
    } else {
        PathBuf::from("/work/shared/fixtures")
    }
}

/// A binary of the workspace (any member package), built next to this test's executable
/// (`target/<profile>/deps/<test>` → `target/<profile>/<name>`). `cargo nextest run` at the
/// root builds every member's binaries.
///
/// NOTE: a test of another package than the binary's cannot make cargo build it; run alone
/// (`-p`/`--test`), it may find none (this panics, naming the build command) or one older
/// than the sources.
pub fn workspace_bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable's path");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("the test executable is in target/<profile>/deps");
    let bin = dir.join(name);
    assert!(
        bin.is_file(),
        "{} is not built: run the whole suite, or `cargo build --bin {name}` first",
        bin.display()
    );
    bin
}
