#!/usr/bin/env bash
# What the replica exchange costs (issue 15): two kvpick replicas behind one Envoy, with the
# exchange (each the other's --replica-peers) and without it, same two instant backends, same
# warm chat load (kvpick-bench, open loop). The two setups run side by side and take the load
# in turns (X N X N …), so machine drift hits both alike. Per run it reads, summed over both
# replicas, the CPU time from /proc/<pid>/stat and the exchange's kvpick_replica_* counters.
#
# Usage: scripts/bench-replica-exchange.sh [rounds] [requests] [rate] [body-bytes…]
#   defaults: 2 rounds, 3000 requests a run, 150 req/s, bodies of 2400 and 9600 bytes
#   (about 500 and 2,000 prompt tokens with the shipped tokenizer).
# SKIP_BUILD=1: use the release binaries as they are.
# Ports 28xxx/29xxx, apart from scripts/bench-overhead.sh's.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS="${1:-2}"; REQUESTS="${2:-3000}"; RATE="${3:-150}"; shift $(( $# < 3 ? $# : 3 ))
SIZES="${*:-2400 9600}"
scripts/setup-envoy.sh
[ -n "${SKIP_BUILD:-}" ] || nice -n 10 cargo build --release --quiet --bin kvpick --bin kvpick-bench
BIN="${CARGO_TARGET_DIR:-target}/release"
WORK=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT

for port in 28201 28202; do
  $BIN/kvpick-bench backend --listen 127.0.0.1:$port & PIDS+=($!)
done
printf 'endpoints:\n  - address: 127.0.0.1:28201\n  - address: 127.0.0.1:28202\n' > "$WORK/pool.yaml"

# Setup X (exchange) = replicas 0 and 1, setup N (none) = replicas 2 and 3; replica i on
# gRPC 29002+10i, health +1, metrics +2, debug +3, exchange +4. Envoy X listens on 28081
# (admin 29901), Envoy N on 28082 (admin 29902), each with its two replicas.
python3 - "$WORK" <<'PY'
import sys
work = sys.argv[1]
config = open("deploy/envoy/envoy.yaml").read()
for name, listen, admin, first in (("x", 28081, 29901, 0), ("n", 28082, 29902, 2)):
    c = config.replace("port_value: 9901", f"port_value: {admin}")
    c = c.replace("address: 0.0.0.0, port_value: 8081", f"address: 127.0.0.1, port_value: {listen}")
    g0, g1 = 29002 + 10 * first, 29002 + 10 * (first + 1)
    c = c.replace("port_value: 9002", f"port_value: {g0}").replace("port_value: 9003", f"port_value: {g0 + 1}")
    last = f"                  health_check_config: {{ port_value: {g0 + 1} }}\n"
    assert last in c
    c = c.replace(last, last + (
        "              - endpoint:\n"
        "                  address:\n"
        f"                    socket_address: {{ address: 127.0.0.1, port_value: {g1} }}\n"
        f"                  health_check_config: {{ port_value: {g1 + 1} }}\n"), 1)
    c = c.replace("port_value: 8101", "port_value: 28201").replace("port_value: 8102", "port_value: 28202")
    open(f"{work}/envoy-{name}.yaml", "w").write(c)
PY
KVPICK_PIDS=()
for i in 0 1 2 3; do
  o=$((29002 + 10 * i))
  extra=()
  if [ $i -lt 2 ]; then
    peer=$((29002 + 10 * (1 - i) + 4))
    extra=(--replica-exchange-port $((o + 4)) --replica-peers "127.0.0.1:$peer")
  fi
  RUST_LOG=error $BIN/kvpick serve --bind-address 127.0.0.1 --endpoints-file "$WORK/pool.yaml" \
    --tokenizer assets/tokenizer --grpc-port $o --grpc-health-port $((o + 1)) \
    --metrics-port $((o + 2)) --debug-port $((o + 3)) "${extra[@]}" & KVPICK_PIDS+=($!); PIDS+=($!)
done
base=41
for name in x n; do
  .venv/bin/envoy -c "$WORK/envoy-$name.yaml" --disable-hot-restart --concurrency 1 -l error \
    --base-id $base >"$WORK/envoy-$name.log" 2>&1 & PIDS+=($!)
  base=$((base + 1))
done
for admin in 29901 29902; do
  for _ in $(seq 100); do curl -sf "http://127.0.0.1:$admin/ready" >/dev/null && break; sleep 0.1; done
  for _ in $(seq 100); do
    [ "$(curl -sf "localhost:$admin/clusters" | grep -c '^kvpick::.*::health_flags::healthy')" = 2 ] && break
    sleep 0.1
  done
done

ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
metric() { # metrics-port series-prefix: the sum of its samples
  curl -sf "http://127.0.0.1:$1/metrics" | awk -v s="$2" 'index($0, s) == 1 {n += $NF} END {printf "%.0f\n", n + 0}'
}
snapshot() { # setup: cpu ticks, routed, bytes sent, records sent, blocks looked up — summed over its replicas
  local first=$1 cpu=0 routed=0 bytes=0 records=0 tokens=0
  for i in $first $((first + 1)); do
    m=$((29002 + 10 * i + 2))
    cpu=$((cpu + $(ticks "${KVPICK_PIDS[$i]}")))
    routed=$((routed + $(metric $m 'inference_objective_request_total{')))
    bytes=$((bytes + $(metric $m 'kvpick_replica_bytes_total{direction="sent"}')))
    records=$((records + $(metric $m 'kvpick_replica_records_total{direction="sent"}')))
    tokens=$((tokens + $(metric $m 'kvpick_prefix_lookup_blocks_total')))
  done
  echo "$cpu $routed $bytes $records $tokens"
}
# Idle CPU (scrapes, reloads, the exchange's heartbeats), per second, per setup.
ix0=$(snapshot 0); in0=$(snapshot 2); sleep 5; ix1=$(snapshot 0); in1=$(snapshot 2)
IDLE_X=$(python3 -c "print(($(echo "$ix1" | cut -d' ' -f1) - $(echo "$ix0" | cut -d' ' -f1)) / 100 / 5)")
IDLE_N=$(python3 -c "print(($(echo "$in1" | cut -d' ' -f1) - $(echo "$in0" | cut -d' ' -f1)) / 100 / 5)")
echo "# idle CPU (two replicas): exchange $IDLE_X s/s, none $IDLE_N s/s; load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo "round,body_bytes,setup,blocks_per_request,rps,p50_ms,p99_ms,errors,cpu_us_per_request,cpu_us_per_request_idle_subtracted,exchange_bytes_per_request,records_per_request,exchange_MBps_per_1000rps,cpu_cores_per_1000rps"
seed=1
for r in $(seq "$ROUNDS"); do
  for size in $SIZES; do
    for setup in x n; do
      seed=$((seed + 1))
      if [ $setup = x ]; then first=0; port=28081; idle=$IDLE_X; else first=2; port=28082; idle=$IDLE_N; fi
      before=$(snapshot $first)
      report=$($BIN/kvpick-bench load --url "http://127.0.0.1:$port/v1/chat/completions" --chat \
        --shared 0.95 --body-bytes "$size" --seed $seed --rate "$RATE" --requests "$REQUESTS" --warmup 0)
      after=$(snapshot $first)
      python3 - "$r" "$size" "$setup" "$before" "$after" "$report" "$idle" <<'PY'
import json, sys
r, size, setup, before, after, report, idle = sys.argv[1:]
b, a = [list(map(int, s.split())) for s in (before, after)]
cpu, routed, nbytes, records, tokens = (x - y for x, y in zip(a, b))
rep = json.loads(report)
lat = rep["latency"]
n = max(routed, 1)
cpu_us = cpu / 100 / n * 1e6
cpu_us_idle = (cpu / 100 - float(idle) * rep["seconds"]) / n * 1e6
print(f'{r},{size},{"exchange" if setup == "x" else "none"},{tokens / n:.0f},{rep["requests_per_second"]:.0f},'
      f'{lat["p50_ms"]:.2f},{lat["p99_ms"]:.2f},{rep["errors"]},{cpu_us:.0f},{cpu_us_idle:.0f},'
      f'{nbytes / n:.0f},{records / n:.2f},{nbytes / n * 1000 / 1e6:.3f},{cpu_us_idle * 1000 / 1e6:.3f}')
if routed != rep["latency"]["count"] + rep["errors"]:
    print(f"# WARNING: {routed} routed by kvpick of {rep['latency']['count'] + rep['errors']} sent")
PY
    done
  done
done
echo "# load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
