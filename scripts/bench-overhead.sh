#!/usr/bin/env bash
# What kvpick adds to a request: Envoy+kvpick vs Envoy alone, same two backends (instant
# responders, so only the proxy path is timed), fixed concurrency, 8 KB JSON bodies.
# Runs the two setups alternately (A B A B …) so machine drift hits both alike, and reads
# kvpick's CPU time from /proc around the kvpick runs.
# Usage: scripts/bench-overhead.sh [rounds] [requests-per-round] [concurrency]
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS="${1:-3}"; REQUESTS="${2:-3000}"; CONCURRENCY="${3:-8}"
scripts/setup-envoy.sh
cargo build --release --quiet --bin kvpick --bin kvpick-bench
BIN="${CARGO_TARGET_DIR:-target}/release"
WORK=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$WORK"; }
trap cleanup EXIT

for port in 8101 8102; do
  $BIN/kvpick-bench backend --listen 127.0.0.1:$port & PIDS+=($!)
done
printf 'endpoints:\n  - address: 127.0.0.1:8101\n  - address: 127.0.0.1:8102\n' > "$WORK/pool.yaml"
# The full request path: body parse, chat/completion tokenization with the shipped
# tokenizer, prefix lookup, GIE's default profile over scraped metrics.
RUST_LOG=warn $BIN/kvpick serve --bind-address 127.0.0.1 --endpoints-file "$WORK/pool.yaml" \
  --tokenizer assets/tokenizer & KVPICK=$!; PIDS+=($KVPICK)

# Envoy alone: the shipped config without the ext_proc filter, on other ports.
python3 - "$WORK" <<'PY'
import re, sys
work = sys.argv[1]
config = open("deploy/envoy/envoy.yaml").read()
start = config.index("                  - name: envoy.filters.http.ext_proc\n")
end = config.index("                  - name: envoy.filters.http.router\n")
plain = config[:start] + config[end:]
plain = plain.replace("port_value: 8081", "port_value: 8082").replace("port_value: 9901", "port_value: 9902")
open(f"{work}/envoy-plain.yaml", "w").write(plain)
PY
.venv/bin/envoy -c deploy/envoy/envoy.yaml --disable-hot-restart --concurrency 1 -l error \
  >"$WORK/envoy-kvpick.log" 2>&1 & PIDS+=($!)
.venv/bin/envoy -c "$WORK/envoy-plain.yaml" --disable-hot-restart --concurrency 1 -l error \
  >"$WORK/envoy-plain.log" 2>&1 & PIDS+=($!)
for admin in 9901 9902; do
  for _ in $(seq 100); do curl -sf "http://127.0.0.1:$admin/ready" >/dev/null && break; sleep 0.1; done
done
# Envoy routes through kvpick once its health check has seen kvpick ready.
for _ in $(seq 100); do
  curl -sf localhost:9901/clusters | grep -q "^kvpick::127.0.0.1:9002::health_flags::healthy" && break
  sleep 0.1
done

cpu_ticks() { awk '{print $14 + $15}' "/proc/$KVPICK/stat"; }
TICK=$(getconf CLK_TCK)
run() { $BIN/kvpick-bench load --url "http://127.0.0.1:$1/v1/completions" --concurrency "$CONCURRENCY" --requests "$REQUESTS" --warmup 300 --body-bytes 8192; }
echo "round,setup,p50_ms,p99_ms,rps,errors,kvpick_cpu_us_per_request"
for r in $(seq "$ROUNDS"); do
  before=$(cpu_ticks)
  a=$(run 8081)
  after=$(cpu_ticks)
  b=$(run 8082)
  python3 - "$r" "$a" "$b" "$before" "$after" "$TICK" "$REQUESTS" <<'PY'
import json, sys
r, a, b, before, after, tick, n = sys.argv[1:]
a, b = json.loads(a), json.loads(b)
# Warm-up requests also cost CPU: divide by everything sent in the window.
cpu_us = (int(after) - int(before)) / int(tick) * 1e6 / (int(n) + 300)
for name, rep, cpu in (("envoy+kvpick", a, f"{cpu_us:.1f}"), ("envoy-alone", b, "")):
    l = rep["latency"]
    print(f'{r},{name},{l["p50_ms"]:.3f},{l["p99_ms"]:.3f},{rep["requests_per_second"]:.0f},{rep["errors"]},{cpu}')
PY
done
# Every request of the kvpick runs must have been picked by kvpick (not failed open).
picked=$(grep -c ' picked=127.0.0.1:810' "$WORK/envoy-kvpick.log" || true)
unpicked=$(grep -c ' picked=- ' "$WORK/envoy-kvpick.log" || true)
echo "# kvpick-routed requests: $picked, not routed by kvpick: $unpicked"
