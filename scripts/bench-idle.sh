#!/usr/bin/env bash
# What an idle kvpick costs beside a fleet: scrapes every --scrape-interval, KV-event streams
# and housekeeping, no requests. Starts `kvpick-sim --pods N` once, then each kvpick binary of
# KVPICK_BINS in turn (A B A B …, so machine drift hits all alike) on that fleet, and reads
# the binary's CPU time over a window: `perf stat -e task-clock` when perf is installed (exact),
# else /proc/PID/stat (10 ms ticks), and the simulator's over the same window (/proc). Prints
# one line per run.
#
# Usage: scripts/bench-idle.sh [pods] [seconds] [rounds] [extra kvpick serve flags…]
#   defaults: 8 pods, 15 s windows, 3 rounds; e.g. `scripts/bench-idle.sh 8 15 3
#   --scrape-interval 10s` prices everything but the scrapes.
# KVPICK_BINS="dirA dirB": directories holding a `kvpick` binary (default: target/release).
# The simulator is this tree's release build (built if missing).
set -euo pipefail
cd "$(dirname "$0")/.."
PODS=${1:-8}
SECONDS_PER_RUN=${2:-15}
ROUNDS=${3:-3}
shift $(($# < 3 ? $# : 3))
EXTRA=("$@")
BINS=${KVPICK_BINS:-target/release}
if [ ! -x target/release/kvpick-sim ] || [ "$BINS" = target/release ]; then
  cargo build --release --locked --quiet -p kvpick --bin kvpick -p kvpick-sim --bin kvpick-sim
fi
RUN=$(mktemp -d)
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$RUN"
}
trap cleanup EXIT

# Free loopback ports: the pods' HTTP, events and replay ports (three runs of PODS), and
# kvpick's gRPC, health and metrics ports; a block below the kernel's ephemeral range, so
# no outgoing connection takes one meanwhile.
ports() {
  python3 - "$1" <<'PY'
import random, socket, sys
n = int(sys.argv[1])
low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
for _ in range(200):
    base = random.randrange(10000, max(10001, low - n))
    socks = []
    try:
        for p in range(base, base + n):
            t = socket.socket(); t.bind(("127.0.0.1", p)); socks.append(t)
    except (OSError, OverflowError):
        continue
    finally:
        for t in socks: t.close()
    print(base); break
PY
}
BASE=$(ports $((PODS * 3 + 3)))
if [ -z "$BASE" ]; then
  echo "bench-idle: no block of $((PODS * 3 + 3)) free ports found" >&2
  exit 1
fi
HTTP=$BASE
EVENTS=$((BASE + PODS))
REPLAY=$((BASE + 2 * PODS))
GRPC=$((BASE + 3 * PODS))
target/release/kvpick-sim --pods "$PODS" --base-port "$HTTP" --events-base-port "$EVENTS" \
  --replay-base-port "$REPLAY" --tokenizer assets/tokenizer >"$RUN/sim.log" 2>&1 &
PIDS+=($!)
SIM=$!
{
  echo "endpoints:"
  for ((i = 0; i < PODS; i++)); do
    echo "  - address: 127.0.0.1:$((HTTP + i))"
    echo "    kvEvents: tcp://127.0.0.1:$((EVENTS + i))"
    echo "    kvReplay: tcp://127.0.0.1:$((REPLAY + i))"
  done
} >"$RUN/pool.yaml"
for ((i = 0; i < 100; i++)); do
  curl -sf "127.0.0.1:$((HTTP + PODS - 1))/health" >/dev/null && break
  sleep 0.1
done

cpu_ms() { # CPU time of PID over SECONDS_PER_RUN, in ms
  if command -v perf >/dev/null && perf stat -e task-clock -p "$1" -- true >/dev/null 2>&1; then
    perf stat -x, -e task-clock -p "$1" -- sleep "$SECONDS_PER_RUN" 2>&1 >/dev/null |
      awk -F, '/task-clock/ { printf "%.1f", $1 }'
  else
    local tck a b
    tck=$(getconf CLK_TCK)
    a=$(awk '{ print $14 + $15 }' "/proc/$1/stat")
    sleep "$SECONDS_PER_RUN"
    b=$(awk '{ print $14 + $15 }' "/proc/$1/stat")
    echo "$(((b - a) * 1000 / tck))"
  fi
}

echo "bench-idle: $PODS pods, ${SECONDS_PER_RUN} s windows, $ROUNDS rounds, flags: ${EXTRA[*]:-none}"
for ((round = 1; round <= ROUNDS; round++)); do
  for bin in $BINS; do
    "$bin/kvpick" serve --endpoints-file "$RUN/pool.yaml" --tokenizer assets/tokenizer \
      --grpc-port "$GRPC" --grpc-health-port $((GRPC + 1)) --metrics-port $((GRPC + 2)) \
      "${EXTRA[@]}" >"$RUN/kvpick.log" 2>&1 &
    pid=$!
    PIDS+=("$pid")
    for ((i = 0; i < 100; i++)); do
      curl -sf "127.0.0.1:$((GRPC + 2))/metrics" >/dev/null && break
      sleep 0.1
    done
    sleep 2 # every pod scraped and subscribed
    sim_before=$(awk '{ print $14 + $15 }' "/proc/$SIM/stat")
    ms=$(cpu_ms "$pid")
    sim_ms=$((($(awk '{ print $14 + $15 }' "/proc/$SIM/stat") - sim_before) * 1000 / $(getconf CLK_TCK)))
    scrapes=$(curl -sf "127.0.0.1:$((GRPC + 2))/metrics" |
      awk '/^kvpick_scrape_duration_seconds_count/ { n += $2 } END { print n + 0 }')
    kill "$pid"
    wait "$pid" 2>/dev/null || true
    echo "round $round $bin: kvpick CPU $ms ms in ${SECONDS_PER_RUN} s ($scrapes scrapes since start); the simulated pods $sim_ms ms"
  done
done
