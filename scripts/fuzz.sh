#!/usr/bin/env bash
# Fuzzes the KV-event wire decoders (crates/kvevents-wire) for a bounded time with cargo-fuzz
# (libFuzzer, nightly, AddressSanitizer, overflow checks on): `decode_payload` (payloads,
# frames, topics) gets two thirds of the time, `decode_zmtp` (the ZMTP codec under every
# KV-event connection) one third.
# Usage: scripts/fuzz.sh [SECONDS]   (default 60, in all)
#        scripts/fuzz.sh --prepare   (installs what is missing and builds the targets, no
#                                     fuzzing: scripts/test.sh runs it beside its build)
#
# Exits non-zero when the fuzzer finds a crash (panic, sanitizer report, OOM, slow input); the
# reproducer is saved under fuzz/artifacts/<target>/ and its path printed ("Failing
# input"); cargo-fuzz prints the exact command that replays it.
#
# Cost, measured on the 2-core dev VM shared with other builds (load average 3-6), 60 s:
#   cold (nothing installed, empty caches): ~3m05s at load ~3 (cargo install cargo-fuzz 70 s,
#     nightly build of libFuzzer (C++) + the wire crate 52 s, fuzzing 61 s); ~5m10s at load
#     ~5.5 (install 2m21s incl. downloads, build 1m45s, fuzzing 61 s).
#   warm (cargo-fuzz installed, target dir below kept): ~62 s, i.e. the fuzzing itself.
# It builds only crates/kvevents-wire, never kvpick (tonic, tokenizers, … would take 5+ min).
set -euo pipefail
cd "$(dirname "$0")/.."
prepare=0
if [ "${1:-}" = --prepare ]; then
  prepare=1
  shift
fi
seconds="${1:-60}"
cache="${XDG_CACHE_HOME:-$HOME/.cache}/kvpick"
# Fixed dirs outside the clone: CI works in a fresh clone each run, so a target dir inside it
# would rebuild libFuzzer and the crate every time; here a warm run rebuilds only what changed.
# The working corpus lives there too (libFuzzer adds every input that finds new coverage to
# the first corpus dir), so it keeps growing across runs; the committed seeds stay read-only.
target_dir="${KVPICK_FUZZ_TARGET_DIR:-$cache/fuzz-target}"

if ! rustup run nightly rustc --version >/dev/null 2>&1; then
  echo "fuzz: installing the nightly toolchain" >&2
  rustup toolchain install nightly --profile minimal
fi
if ! command -v cargo-fuzz >/dev/null 2>&1; then
  echo "fuzz: installing cargo-fuzz" >&2
  cargo install --locked cargo-fuzz
fi
if [ "$prepare" = 1 ]; then
  for target in decode_payload decode_zmtp; do
    cargo +nightly fuzz build --debug-assertions --target-dir "$target_dir" "$target"
  done
  exit 0
fi
zmtp_seconds=$(( seconds / 3 ))
payload_seconds=$(( seconds - zmtp_seconds ))

# fuzz_one TARGET SECONDS
fuzz_one() {
  local target="$1" secs="$2"
  local corpus="$cache/fuzz-corpus/$target"
  local seeds="fuzz/seeds/$target"
  [ "$secs" -gt 0 ] || return 0
  mkdir -p "$corpus"
  # NOTE: bounded disk: each run adds inputs (about 700-2,000 for 60 s); past 2,000 files the
  # corpus is minimized to the inputs that keep its coverage (~700 files, ~11 s).
  if [ "$(find "$corpus" -type f | wc -l)" -gt 2000 ]; then
    echo "fuzz: minimizing the working corpus of $target" >&2
    cargo +nightly fuzz cmin --debug-assertions --target-dir "$target_dir" "$target" "$corpus"
  fi
  echo "fuzz: $target for ${secs}s (target dir $target_dir, corpus $corpus)" >&2
  local marker status=0
  marker="$(mktemp)"
  local dirs=("$corpus")
  [ -d "$seeds" ] && dirs+=("$seeds")
  cargo +nightly fuzz run --debug-assertions --target-dir "$target_dir" "$target" \
    "${dirs[@]}" -- \
    -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 || status=$?
  if [ "$status" -ne 0 ]; then
    echo "fuzz: $target FAILED (exit $status): new failing inputs:" >&2
    find "fuzz/artifacts/$target" -type f -newer "$marker" 2>/dev/null | sed 's|^|  |' >&2 || true
    rm -f "$marker"
    exit "$status"
  fi
  rm -f "$marker"
}

fuzz_one decode_payload "$payload_seconds"
fuzz_one decode_zmtp "$zmtp_seconds"
echo "fuzz: no crash in ${seconds}s" >&2
