#!/usr/bin/env bash
# Quickstart: Envoy + kvpick + two simulated vLLM pods on this machine, on kvpick's embedded
# defaults, then one chat request through Envoy; then a short side-by-side run (kvpick against
# Envoy round robin on a fresh 4-pod simulated fleet, bench/compare.py --mode demo, ~1 min),
# printing its table and where its plots are. Keeps the stack running until Ctrl-C.
#   scripts/demo.sh          build (release), start, send, compare, keep running
#   scripts/demo.sh --once   start, send, check, stop (what the quickstart test runs; no comparison)
# KVPICK_BIN_DIR=dir uses already-built binaries instead of building; KVPICK_DEMO_COMPARE=0
# skips the comparison (it installs inference-perf into .venv-bench/ on first use).
set -euo pipefail
cd "$(dirname "$0")/.."
ONCE=0
[ "${1:-}" = "--once" ] && ONCE=1
scripts/setup-envoy.sh
if [ -n "${KVPICK_BIN_DIR:-}" ]; then
  BIN="$KVPICK_BIN_DIR"
else
  echo "demo: building kvpick (release; the first build takes a few minutes)" >&2
  cargo build --release --quiet --bin kvpick --bin kvpick-sim
  BIN="${CARGO_TARGET_DIR:-target}/release"
fi
RUN=$(mktemp -d)
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$RUN"
}
trap cleanup EXIT INT TERM

wait_for() { # what, command…
  local what=$1; shift
  for _ in $(seq 300); do "$@" >/dev/null 2>&1 && return 0; sleep 0.1; done
  echo "demo: timed out waiting for $what (logs in $RUN)" >&2
  tail -n 20 "$RUN"/*.log >&2 || true
  exit 1
}

# Two simulated vLLM pods: HTTP :8101/:8102, KV events :5557/:5558, replay :6557/:6558.
"$BIN/kvpick-sim" --pods 2 --base-port 8101 --events-base-port 5557 --replay-base-port 6557 \
  --tokenizer assets/tokenizer --time-scale 0.1 >"$RUN/sim.log" 2>&1 &
PIDS+=($!)
# The same endpoints as the `inference-pool` cluster of deploy/envoy/envoy.yaml: Envoy's
# override_host policy sends kvpick's pick only to hosts that cluster knows.
cat >"$RUN/pool.yaml" <<YAML
endpoints:
  - address: 127.0.0.1:8101
    kvEvents: tcp://127.0.0.1:5557
    kvReplay: tcp://127.0.0.1:6557
    labels: { inference.networking.k8s.io/engine-type: vllm }
  - address: 127.0.0.1:8102
    kvEvents: tcp://127.0.0.1:5558
    kvReplay: tcp://127.0.0.1:6558
    labels: { inference.networking.k8s.io/engine-type: vllm }
YAML
"$BIN/kvpick" serve --endpoints-file "$RUN/pool.yaml" --tokenizer assets/tokenizer \
  >"$RUN/kvpick.log" 2>&1 &
PIDS+=($!)
.venv/bin/envoy -c deploy/envoy/envoy.yaml --disable-hot-restart -l warning \
  >"$RUN/envoy.log" 2>&1 &
PIDS+=($!)

wait_for "the simulated pods" curl -sf localhost:8101/health
wait_for "the simulated pods" curl -sf localhost:8102/health
wait_for "kvpick" curl -sf localhost:9091/debug/pods
wait_for "Envoy" curl -sf localhost:9901/ready
# Envoy routes through kvpick once its health check has seen kvpick ready.
wait_for "Envoy's health check of kvpick" \
  sh -c 'curl -sf localhost:9901/clusters | grep -q "^kvpick::127.0.0.1:9002::health_flags::healthy"'

REQUEST='{"model":"sim-model","messages":[{"role":"system","content":"You are the kvpick demo. kvpick routes each request to the pod that already holds its prompt prefix in its KV cache, learned from the pods'"'"' own KV-cache events."},{"role":"user","content":"Which pod holds my prefix?"}],"max_tokens":16}'
echo "demo: POST localhost:8081/v1/chat/completions" >&2
ANSWER=$(curl -sf localhost:8081/v1/chat/completions -H 'content-type: application/json' -d "$REQUEST")
echo "$ANSWER"
sleep 0.2 # the access log line is written when the response completes
ROUTE=$(grep -m1 '/v1/chat/completions' "$RUN/envoy.log" || true)
echo "demo: envoy access log: $ROUTE" >&2
echo "demo: kvpick /debug/pods: $(curl -sf localhost:9091/debug/pods)" >&2
# kvpick names its pick first, then the fallbacks Envoy retries on (--max-fallbacks).
PICKED=$(echo "$ROUTE" | sed -n 's/.* picked=\([^ ,]*\)[, ].*/\1/p')
SERVED=$(echo "$ROUTE" | sed -n 's/.* upstream=\([^ ]*\) .*/\1/p')
case "$PICKED" in
  127.0.0.1:8101 | 127.0.0.1:8102) ;;
  *) echo "demo: the request was not routed by kvpick (picked=$PICKED)" >&2; exit 1 ;;
esac
if [ "$PICKED" != "$SERVED" ]; then
  echo "demo: kvpick picked $PICKED but $SERVED served" >&2; exit 1
fi
echo "demo: kvpick picked $PICKED, and Envoy sent the request there" >&2
# The pod announced the prompt's KV blocks; kvpick's index now knows who holds the prefix.
PREFIX=""
for _ in $(seq 50); do
  PREFIX=$(curl -sf "localhost:9091/debug/prefix?path=/v1/chat/completions" -d "$REQUEST" || true)
  echo "$PREFIX" | python3 -c 'import json,sys; d=json.load(sys.stdin); sys.exit(0 if any(p["matched_blocks"] > 0 and p["address"] == sys.argv[1] for p in d["pods"]) else 1)' "$PICKED" 2>/dev/null && break
  sleep 0.1
done
echo "demo: kvpick /debug/prefix for the same request: $PREFIX" >&2
echo "$PREFIX" | python3 -c 'import json,sys; d=json.load(sys.stdin); sys.exit(0 if any(p["matched_blocks"] > 0 and p["address"] == sys.argv[1] for p in d["pods"]) else 1)' "$PICKED" || {
  echo "demo: kvpick's index does not show $PICKED holding the prefix" >&2; exit 1; }
case "$ANSWER" in
  *'"chat.completion"'*) ;;
  *) echo "demo: unexpected answer" >&2; exit 1 ;;
esac
if [ "$ONCE" = 1 ]; then
  echo "demo: ok" >&2
  exit 0
fi
if [ "${KVPICK_DEMO_COMPARE:-1}" != 0 ]; then
  echo "demo: side-by-side: kvpick vs Envoy round robin, the same seeded load on a fresh 4-pod fleet each (~1 min)" >&2
  if scripts/setup-bench-venv.sh && nice -n 5 .venv-bench/bin/python bench/compare.py --mode demo \
      --bin-dir "$BIN" --out target/compare/demo; then
    echo "demo: plots: $PWD/target/compare/demo/ttft_cdf.png (and ttft_p90_vs_rate.png, output_tps_vs_rate.png); the full comparison: scripts/compare.sh" >&2
  else
    echo "demo: the comparison failed (above; per-system logs in target/compare/demo/*/logs); the stack is still up" >&2
  fi
fi
echo "demo: running; try: curl -s localhost:8081/v1/chat/completions -H 'content-type: application/json' -d '{\"model\":\"sim-model\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}'" >&2
echo "demo: logs in $RUN; Ctrl-C stops everything" >&2
wait
