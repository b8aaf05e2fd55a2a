#!/usr/bin/env bash
# The test command: prepares what the tests need (Envoy in .venv/), then runs every test
# with nextest, plus format and lint checks, then fuzzes the KV-event decoder for a bounded
# time (scripts/fuzz.sh; KVPICK_FUZZ_SECONDS, default 40, 0 skips it: ~45 s warm, ~3 min cold
# with the cargo-fuzz install and nightly build). Usage: scripts/test.sh [nextest filters…]
# Each phase prints its start time (to see where the ~15 min CI budget goes).
set -euo pipefail
cd "$(dirname "$0")/.."
phase() { echo "test: $(date -u +%H:%M:%S) $*" >&2; }
# NOTE: incremental compilation only pays when the same tree is rebuilt; a CI clone builds
# once, and writing the incremental caches costs it time.
if [ "${CI:-}" = true ]; then
  export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
fi
phase setup
# NOTE: the Python installs (~2 min on a fresh machine, mostly downloads and one core) and
# the fuzzer's install and build (~2 min) run beside the format check and the test build,
# and are waited for before anything that needs them (the Dockerfile lint, the tests): the
# build leaves a core idle in its serial stretches (the kvpick crate, linking), and the
# downloads need none.
setup_log=$(mktemp)
(
  scripts/setup-venv.sh
  # inference-perf and the peers for the side-by-side benchmark's smoke test (crates/kvpick-bench).
  scripts/setup-bench-venv.sh
  # hadolint and Helm (helm-python-sdk) for the deployable package's checks (tests/it/deploy_*.rs).
  scripts/setup-deploy-tools.sh
  # The fuzzer's install (cargo-fuzz, nightly) and build, so the fuzz phase only fuzzes.
  if [ "${KVPICK_FUZZ_SECONDS:-40}" -gt 0 ]; then
    scripts/fuzz.sh --prepare
  fi
) >"$setup_log" 2>&1 &
setup_pid=$!
# A check that fails ends the script: take the installs down with it.
kill_tree() {
  local child
  for child in $(pgrep -P "$1" || true); do kill_tree "$child"; done
  kill "$1" 2>/dev/null || true
}
trap 'kill_tree "$setup_pid"; rm -f "$setup_log"' EXIT
if ! command -v cargo-nextest >/dev/null 2>&1; then
  echo "test: installing cargo-nextest" >&2
  cargo install --locked cargo-nextest
fi
# --all/--workspace: kvpick and its workspace crates (kvpick-sim, kvpick-bench, kvpick-e2e,
# kvevents-wire); the e2e tests run the binaries the workspace build puts in target/.
phase fmt
cargo fmt --all --check
# NOTE: clippy lints the workspace's crates while they compile for the tests: `cargo clippy`
# is `cargo check` with clippy-driver as the workspace's rustc wrapper and its arguments in
# CLIPPY_ARGS, and the same wrapper on the test build lints every target (--all-targets:
# the benches too, built in the test profile and not run) in the one compile of the
# dependencies the tests need, where a separate `cargo clippy` checked them all again (its
# phase took 6 min on a fresh machine, though less than that was saved: build scripts, their
# C code and proc macros were shared with the build; docs/benchmarks.md). The wrapper is part of the build's fingerprint, so the run below keeps
# it. `-D warnings` as `cargo clippy -- -D warnings` passes it. Only these two cargo commands
# get the wrapper: the fuzzer's nightly build must not run a stable clippy-driver.
with_clippy=(env "RUSTC_WORKSPACE_WRAPPER=$(rustc --print sysroot)/bin/clippy-driver"
  "CLIPPY_ARGS=-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__")
phase build and clippy
"${with_clippy[@]}" cargo test --workspace --all-targets --locked --no-run
phase waiting for setup
setup_status=0
wait "$setup_pid" || setup_status=$?
cat "$setup_log" >&2
trap - EXIT
rm -f "$setup_log"
if [ "$setup_status" -ne 0 ]; then
  echo "test: setup failed (exit $setup_status)" >&2
  exit "$setup_status"
fi
scripts/lint-dockerfile.sh
phase nextest
"${with_clippy[@]}" cargo nextest run --workspace --locked --no-fail-fast "$@"
# The heavier conformance run against two real vLLM CPU engines (README "Conformance against
# real vLLM"): only when asked, since its first run downloads ≈2.4 GB.
if [ "${KVPICK_VLLM_E2E:-0}" = 1 ]; then
  scripts/vllm-e2e.sh
fi
fuzz_seconds="${KVPICK_FUZZ_SECONDS:-40}"
if [ "$fuzz_seconds" -gt 0 ]; then
  phase fuzz
  scripts/fuzz.sh "$fuzz_seconds"
fi
phase done
