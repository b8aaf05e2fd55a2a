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
scripts/setup-venv.sh
# inference-perf and the peers for the side-by-side benchmark's smoke test (crates/kvpick-bench).
scripts/setup-bench-venv.sh
# hadolint and Helm (helm-python-sdk) for the deployable package's checks (tests/it/deploy_*.rs).
scripts/setup-deploy-tools.sh
if ! command -v cargo-nextest >/dev/null 2>&1; then
  echo "test: installing cargo-nextest" >&2
  cargo install --locked cargo-nextest
fi
# --all/--workspace: kvpick and its workspace crates (kvpick-sim, kvpick-bench, kvpick-e2e,
# kvevents-wire); the e2e tests run the binaries the workspace build puts in target/.
phase fmt and clippy
cargo fmt --all --check
cargo clippy --workspace --all-targets --locked -- -D warnings
scripts/lint-dockerfile.sh
phase nextest
cargo nextest run --workspace --locked --no-fail-fast "$@"
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
