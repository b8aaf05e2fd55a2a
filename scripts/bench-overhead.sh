#!/usr/bin/env bash
# What kvpick adds to a request: Envoy+kvpick vs Envoy alone, same two backends (instant
# responders, so only the proxy path is timed). Runs the setups alternately (A B A B …) so
# machine drift hits all alike, and reads kvpick's CPU time from /proc around each kvpick run.
#
# Usage:
#   scripts/bench-overhead.sh [rounds] [requests-per-round] [concurrency]
#       8 KB completion bodies, closed loop at a fixed concurrency (issue 2's figures).
#   scripts/bench-overhead.sh chat [rounds] [requests] [sizes] [variants] [paces]
#       chat bodies (issue 16): sizes in bytes (default "8192 225280 409600"), variants
#       "warm" (95% of the text shared with earlier requests) and/or "cold" (nothing shared),
#       paces "rate:N" (open loop, N req/s) and/or "conc:N" (closed loop, N workers);
#       default "rate:20 rate:100 conc:1". Prints added p50/p99 per row and, per kvpick run,
#       the mean time of each request stage (kvpick_request_stage_seconds) and kvpick's
#       peak resident memory during the run (VmHWM, reset before each run) against its
#       resident memory before it.
# KVPICK_BINS="a b": A/B several kvpick binaries in one run (each behind its own Envoy; rows
# are named kvpick0, kvpick1, … in that order). Default: this tree's release build.
# ENVOY_RESPONSES="observe routing": per kvpick of KVPICK_BINS (same order), where its Envoy
# sends the response: `observe` (the shipped config: the `kvpick-observe` filter in
# observability_mode) or `routing` (one filter: the routing filter sends the response too,
# FULL_DUPLEX_STREAMED, as before session 15) or `none` (the routing filter alone: kvpick never
# sees the response; what the observing stream costs). Default: observe for every kvpick.
# ENVOY_REQUEST_BODY="full-duplex buffered": per kvpick (same order), how its Envoy's routing
# filter sends the request body: `full-duplex` (the shipped FULL_DUPLEX_STREAMED: kvpick streams
# the body back) or `buffered` (BUFFERED: Envoy holds the body, kvpick answers it with the pick
# and no body bytes, one more round trip for the headers). Default: full-duplex for every kvpick.
# Each kvpick run also prints its CPU per request by thread group (ext-proc lanes, their
# blocking pools, the shared runtime's workers, …), its Envoy's CPU per request (warm-up
# included) and Envoy's view of its requests (medians, from an access log every Envoy here
# writes): first request byte to upstream, and the routing ext_proc call's turnaround (headers
# message sent to kvpick's answer), beside Envoy alone's.
# PODS=sim: the two backends are simulated vLLM pods (`kvpick-sim`, instant: --time-scale 0)
# that publish KV events over ZMQ, and kvpick subscribes to them, as in production: its
# routing records are the speculative ones a pod's events confirm, and its CPU includes taking
# in the events. The setups (Envoy alone, each kvpick) get workloads of their own seeds, so no
# setup's prompts are already cached by another's run, and the pods' caches are emptied
# before each run. Each kvpick run also prints the KV-event batches kvpick applied per
# request. Default: PODS=instant (`kvpick-bench backend`, no events).
# SKIP_BUILD=1: use the release binaries as they are.
# STREAM=K: every request asks for a streamed answer and the backends stream it like vLLM
# (K token events of ~150 B, a usage event, [DONE]; each its own write), so with the shipped
# FULL_DUPLEX_STREAMED response mode each request is ~K+4 ext-proc messages each way. Each
# kvpick run then also prints the ext-proc messages per request (Envoy's stream_msgs_sent)
# and kvpick's CPU per message. STREAM_GAP_US (default 300): microseconds between events, so
# Envoy reads each on its own, as with a model server's decode steps.
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=overhead
if [ "${1:-}" = chat ]; then MODE=chat; shift; fi
ROUNDS="${1:-3}"; REQUESTS="${2:-3000}"
if [ $MODE = chat ]; then
  SIZES="${3:-8192 225280 409600}"; VARIANTS="${4:-warm cold}"; PACES="${5:-rate:20 rate:100 conc:1}"
else
  SIZES=8192; VARIANTS=fixed; PACES="conc:${3:-8}"
fi
scripts/setup-envoy.sh
PODS="${PODS:-instant}"
case $PODS in
  instant) ;;
  sim) [ -z "${STREAM:-}" ] || { echo "bench-overhead: STREAM is for PODS=instant" >&2; exit 2; } ;;
  *) echo "bench-overhead: PODS must be instant or sim, not $PODS" >&2; exit 2 ;;
esac
[ -n "${SKIP_BUILD:-}" ] || cargo build --release --quiet --bin kvpick --bin kvpick-bench --bin kvpick-sim
BIN="${CARGO_TARGET_DIR:-target}/release"
read -r -a KVPICKS <<<"${KVPICK_BINS:-$BIN/kvpick}"
WORK=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT

if [ "$PODS" = sim ]; then
  # Room for ~20 cold 220 KB prompts per pod before a pod evicts (each eviction is a
  # BlockRemoved event kvpick applies, as on a full GPU); prompts up to 256k tokens (a 400 KB
  # body of the bench's prose is ~142k tokens).
  $BIN/kvpick-sim --pods 2 --base-port 8101 --events-base-port 5557 --replay-base-port 6557 \
    --model bench-model --time-scale 0 --num-gpu-blocks 100000 --max-model-len 262144 \
    --tokenizer assets/tokenizer >"$WORK/sim.log" 2>&1 & PIDS+=($!)
  printf 'endpoints:\n' > "$WORK/pool.yaml"
  for i in 0 1; do
    printf '  - address: 127.0.0.1:%d\n    kvEvents: tcp://127.0.0.1:%d\n    kvReplay: tcp://127.0.0.1:%d\n' \
      $((8101 + i)) $((5557 + i)) $((6557 + i)) >> "$WORK/pool.yaml"
  done
  for port in 8101 8102; do
    for _ in $(seq 300); do curl -sf "127.0.0.1:$port/health" >/dev/null && break; sleep 0.1; done
    curl -sf "127.0.0.1:$port/health" >/dev/null || { echo "bench-overhead: the simulated pods did not start" >&2; tail "$WORK/sim.log" >&2; exit 1; }
  done
else
  for port in 8101 8102; do
    $BIN/kvpick-bench backend --listen 127.0.0.1:$port --stream-chunks "${STREAM:-0}" \
      --chunk-gap-us "${STREAM_GAP_US:-300}" & PIDS+=($!)
  done
  printf 'endpoints:\n  - address: 127.0.0.1:8101\n  - address: 127.0.0.1:8102\n' > "$WORK/pool.yaml"
fi

# Envoy configs: the shipped one per kvpick (kvpick i on ports 9002+100i…, Envoy listening
# on 8081+100i) and the shipped one without the ext_proc filter (Envoy alone, 8080).
python3 - "$WORK" "${#KVPICKS[@]}" "${ENVOY_RESPONSES:-}" "${ENVOY_REQUEST_BODY:-}" <<'PY'
import sys
work, n, responses, request_bodies = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(), sys.argv[4].split()
config = open("deploy/envoy/envoy.yaml").read()
def route_only(c):
    start = c.index("                  - name: kvpick-observe\n")
    end = c.index("                  - name: envoy.filters.http.router\n")
    return c[:start] + c[end:]
def one_filter(c):
    c = route_only(c)
    for mode, value in (("response_header_mode", "SEND"), ("response_body_mode", "FULL_DUPLEX_STREAMED"),
                        ("response_trailer_mode", "SEND")):
        old = {"response_header_mode": "SKIP", "response_body_mode": "NONE", "response_trailer_mode": "SKIP"}[mode]
        assert f"{mode}: {old}" in c, mode
        c = c.replace(f"{mode}: {old}", f"{mode}: {value}", 1)
    return c
def timing_log(c, name):
    # Per request, Envoy's view of where its time went (medians printed after each run):
    # from the request's first byte to the upstream's first byte, and how long the routing
    # ext_proc call took from its headers message to kvpick's answer (Envoy's filter state).
    anchor = "                access_log:\n"
    assert anchor in c
    entry = (anchor
        + "                  - name: envoy.access_loggers.file\n"
        + "                    typed_config:\n"
        + '                      "@type": type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog\n'
        + f"                      path: {work}/timing-{name}.log\n"
        + "                      log_format:\n"
        + "                        text_format_source:\n"
        + '                          inline_string: "%COMMON_DURATION(DS_RX_BEG:US_TX_BEG:us)% '
        + '%FILTER_STATE(envoy.filters.http.ext_proc:FIELD:request_header_latency_us)% '
        + '%FILTER_STATE(envoy.filters.http.ext_proc:FIELD:request_body_total_latency_us)%\\n"\n')
    return c.replace(anchor, entry, 1)
for i in range(n):
    layout = responses[i] if i < len(responses) else "observe"
    assert layout in ("observe", "routing", "none"), layout
    c = {"routing": one_filter, "none": route_only}.get(layout, lambda c: c)(config)
    request_body = request_bodies[i] if i < len(request_bodies) else "full-duplex"
    assert request_body in ("full-duplex", "buffered"), request_body
    if request_body == "buffered":
        old = "request_body_mode: FULL_DUPLEX_STREAMED"
        assert c.count(old) == 1
        c = c.replace(old, "request_body_mode: BUFFERED")
    for port in (8081, 9901, 9002, 9003):
        c = c.replace(f"port_value: {port}", f"port_value: {port + 100 * i}")
    open(f"{work}/envoy-kvpick{i}.yaml", "w").write(timing_log(c, f"kvpick{i}"))
start = config.index("                  - name: envoy.filters.http.ext_proc\n")
end = config.index("                  - name: envoy.filters.http.router\n")
plain = config[:start] + config[end:]
plain = plain.replace("port_value: 8081", "port_value: 8080").replace("port_value: 9901", "port_value: 9900")
open(f"{work}/envoy-alone.yaml", "w").write(timing_log(plain, "alone"))
PY
KVPICK_PIDS=(); ENVOY_PIDS=()
for i in "${!KVPICKS[@]}"; do
  o=$((100 * i))
  # The full request path: body parse, chat/completion tokenization with the shipped
  # tokenizer, prefix lookup, GIE's default profile over scraped metrics.
  RUST_LOG=error "${KVPICKS[$i]}" serve --bind-address 127.0.0.1 --endpoints-file "$WORK/pool.yaml" \
    --tokenizer assets/tokenizer --grpc-port $((9002 + o)) --grpc-health-port $((9003 + o)) \
    --metrics-port $((9090 + o)) --debug-port $((9091 + o)) & KVPICK_PIDS+=($!); PIDS+=($!)
  .venv/bin/envoy -c "$WORK/envoy-kvpick$i.yaml" --disable-hot-restart --concurrency 1 -l error --file-flush-interval-msec 100 \
    --base-id $((10 + i)) >"$WORK/envoy-kvpick$i.log" 2>&1 & ENVOY_PIDS+=($!); PIDS+=($!)
done
.venv/bin/envoy -c "$WORK/envoy-alone.yaml" --disable-hot-restart --concurrency 1 -l error --file-flush-interval-msec 100 \
  --base-id 9 >"$WORK/envoy-alone.log" 2>&1 & PIDS+=($!)
for i in "${!KVPICKS[@]}"; do
  admin=$((9901 + 100 * i)); grpc=$((9002 + 100 * i))
  for _ in $(seq 100); do curl -sf "http://127.0.0.1:$admin/ready" >/dev/null && break; sleep 0.1; done
  # Envoy routes through kvpick once its health check has seen kvpick ready.
  for _ in $(seq 100); do
    curl -sf "localhost:$admin/clusters" | grep -q "^kvpick::127.0.0.1:$grpc::health_flags::healthy" && break
    sleep 0.1
  done
done
for _ in $(seq 100); do curl -sf "http://127.0.0.1:9900/ready" >/dev/null && break; sleep 0.1; done

# Prime each kvpick with new text until its tokenizer builds its BPE merge table (a one-time
# ~0.3 s of CPU on a thread of its own, started after 4,096 word-cache misses), and wait for
# the build to end: otherwise it lands in the first measured run's CPU.
for i in "${!KVPICKS[@]}"; do
  $BIN/kvpick-bench load --url "http://127.0.0.1:$((8081 + 100 * i))/v1/chat/completions" \
    --requests 5 --warmup 0 --body-bytes 225280 --chat --shared 0 --concurrency 1 --seed 999 >/dev/null
done
for pid in "${KVPICK_PIDS[@]}"; do
  for _ in $(seq 300); do grep -qx kvpick-merges /proc/"$pid"/task/*/comm 2>/dev/null || break; sleep 0.1; done
done

# kvpick's own CPU when idle (scrapes, reloads), per second: subtracted from each run's CPU
# (at 20 req/s it would otherwise add ~0.3 ms to every request).
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
IDLE=()
for pid in "${KVPICK_PIDS[@]}"; do IDLE+=("$(ticks "$pid")"); done
sleep 5
for i in "${!KVPICK_PIDS[@]}"; do
  IDLE[$i]=$(python3 -c "print(($(ticks "${KVPICK_PIDS[$i]}") - ${IDLE[$i]}) / 100 / 5)")
  echo "# kvpick$i idle CPU: ${IDLE[$i]} s/s"
done
# Context switches of all kvpick's threads (voluntary: it waited, e.g. a worker parking;
# involuntary: preempted), summed, as "voluntary involuntary".
switches() { cat /proc/"$1"/task/*/status 2>/dev/null | awk '/^voluntary_ctxt/ {v += $2} /^nonvoluntary_ctxt/ {n += $2} END {print v + 0, n + 0}'; }
# CPU ticks of each thread of a process ("tid name ticks" lines).
threads() {
  for t in /proc/"$1"/task/*/stat; do cat "$t" 2>/dev/null; done |
    sed -E 's/^([0-9]+) \(([^)]*)\) /\1 \2 /' | awk '{print $1, $2, $14 + $15}'
}
routed() { curl -sf "http://127.0.0.1:$1/metrics" | awk '/^inference_objective_request_total\{/ {n += $NF} END {print n + 0}'; }
# ext-proc messages Envoy sent to kvpick (one per request/response headers, body chunk, trailers).
messages() { curl -sf "http://127.0.0.1:$1/stats" | awk -F': ' '/ext_proc\.stream_msgs_sent:/ {n += $2} END {print n + 0}'; }
stages() { curl -sf "http://127.0.0.1:$1/metrics" | grep '^kvpick_request_stage_seconds_\(sum\|count\)' || true; }
applied() { curl -sf "http://127.0.0.1:$1/metrics" | awk '/^kvpick_kv_events_applied_total/ {n += $NF} END {printf "%d", n}'; }
# The workload's seed for a setup (0: Envoy alone, i + 1: kvpick i). With simulated pods each
# setup gets text of its own: the pods keep what earlier runs cached, and kvpick learns of it.
seed_of() { if [ "$PODS" = sim ]; then echo $(($1 + 100000 * $2)); else echo "$1"; fi; }
# With simulated pods, every run starts from empty caches: otherwise a later run would find
# fuller caches and take in more evictions than the one before it. The pods announce the
# reset (AllBlocksCleared); the pause lets every kvpick apply it before its CPU is read.
empty_pods() {
  [ "$PODS" = sim ] || return 0
  for port in 8101 8102; do curl -sf -X POST "127.0.0.1:$port/reset_prefix_cache" >/dev/null; done
  sleep 0.3
}
# Envoy's timing log (see timing_log above): its length now, and the medians of the lines
# written since a given length (to upstream; and the routing ext_proc call's turnaround).
logged() { stat -c %s "$WORK/timing-$1.log" 2>/dev/null || echo 0; }
timing() {
  tail -c +$(($2 + 1)) "$WORK/timing-$1.log" 2>/dev/null | python3 -c '
import statistics, sys
rows = [line.split() for line in sys.stdin if line.strip()]
def median(i):
    values = [float(r[i]) for r in rows if len(r) > i and r[i] != "-"]
    return f"{statistics.median(values):.0f}" if values else "-"
print(median(0))
if any(len(r) > 1 and r[1] != "-" for r in rows):
    print(f"; ext_proc headers to kvpick answer {median(1)}")
# BUFFERED request bodies: the body is a second call (headers continued, then the pick).
if any(len(r) > 2 and r[2] not in ("-", "0") for r in rows):
    print(f", held body to kvpick answer {median(2)}")'
}
run() { # port path size variant pace seed [cpu-pid]
  local args=(--url "http://127.0.0.1:$1$2" --requests "$REQUESTS" --body-bytes "$3" --seed "$6")
  case $4 in
    warm) args+=(--chat --shared 0.95 --warmup 50) ;;
    cold) args+=(--chat --shared 0 --warmup 20) ;;
    fixed) args+=(--warmup 300) ;;
  esac
  case $5 in
    rate:*) args+=(--rate "${5#rate:}") ;;
    conc:*) args+=(--concurrency "${5#conc:}") ;;
  esac
  [ -n "${7:-}" ] && args+=(--cpu-pid "$7")
  [ -n "${STREAM:-}" ] && args+=(--stream)
  $BIN/kvpick-bench load "${args[@]}"
}
echo "round,bytes,variant,pace,setup,p50_ms,p99_ms,added_p50_ms,added_p99_ms,rps,errors,kvpick_cpu_us_per_request"
seed=1
for r in $(seq "$ROUNDS"); do
  for size in $SIZES; do for variant in $VARIANTS; do for pace in $PACES; do
    path=/v1/chat/completions; [ "$variant" = fixed ] && path=/v1/completions
    seed=$((seed + 1))
    empty_pods
    alone_from=$(logged alone)
    alone=$(run 8080 $path "$size" "$variant" "$pace" "$(seed_of $seed 0)")
    for i in "${!KVPICKS[@]}"; do
      metrics=$((9090 + 100 * i))
      empty_pods
      before=$(stages $metrics); routed_before=$(routed $metrics); applied_before=$(applied $metrics)
      pid=${KVPICK_PIDS[$i]}
      rss_before=$(awk '/^VmRSS/ {print $2}' "/proc/$pid/status")
      echo 5 >"/proc/$pid/clear_refs" 2>/dev/null || true # resets VmHWM to the current RSS
      read -r vol_before invol_before < <(switches "$pid")
      msgs_before=$(messages $((9901 + 100 * i)))
      read -r user_before sys_before < <(awk '{print $14, $15}' "/proc/$pid/stat")
      threads_before=$(threads "$pid"); faults_before=$(awk '{print $10}' "/proc/$pid/stat")
      envoy_before=$(ticks "${ENVOY_PIDS[$i]}")
      from=$(logged "kvpick$i")
      a=$(run $((8081 + 100 * i)) $path "$size" "$variant" "$pace" "$(seed_of $seed $((i + 1)))" "${KVPICK_PIDS[$i]}")
      after=$(stages $metrics); routed_after=$(routed $metrics); applied_after=$(applied $metrics)
      hwm=$(awk '/^VmHWM/ {print $2}' "/proc/$pid/status")
      read -r vol_after invol_after < <(switches "$pid")
      msgs_after=$(messages $((9901 + 100 * i)))
      read -r user_after sys_after < <(awk '{print $14, $15}' "/proc/$pid/stat")
      threads_after=$(threads "$pid"); faults_after=$(awk '{print $10}' "/proc/$pid/stat")
      envoy_after=$(ticks "${ENVOY_PIDS[$i]}")
      # After the counters are read, so the wait adds no idle time to them.
      sleep 0.5 # Envoy writes its access logs out every 100 ms (--file-flush-interval-msec)
      echo "#   kvpick$i Envoy's view, median µs: first request byte to upstream $(timing "kvpick$i" "$from" | tr '\n' ' ')(Envoy alone: $(timing alone "$alone_from"))"
      case $variant in warm) warmup=50 ;; cold) warmup=20 ;; *) warmup=300 ;; esac
      sent=$((REQUESTS + warmup))
      echo "#   kvpick$i context switches per request: $(python3 -c "print(f'{($vol_after - $vol_before) / $sent:.1f} voluntary, {($invol_after - $invol_before) / $sent:.1f} involuntary')")"
      echo "#   kvpick$i CPU per request (warm-up and idle included): $(python3 -c "print(f'user {($user_after - $user_before) * 1e4 / $sent:.0f} µs, system {($sys_after - $sys_before) * 1e4 / $sent:.0f} µs')")"
      # Per thread group (a name's trailing digits dropped: ext-proc-0 and ext-proc-1 are one).
      echo "#   kvpick$i CPU per request by thread: $(python3 -c '
import re, sys
def parse(text):
    return {tid: (name, int(t)) for tid, name, t in (l.split() for l in text.splitlines() if l)}
before, after, sent, total = parse(sys.argv[1]), parse(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
parts = {}
for tid, (name, ticks) in after.items():
    group = re.sub(r"-?[0-9]+$", "", name)
    parts[group] = parts.get(group, 0) + ticks - before.get(tid, (name, 0))[1]
parts["threads that exited"] = total - sum(parts.values())
print(", ".join(f"{k} {v * 1e4 / sent:.0f} µs" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]) if v))
' "$threads_before" "$threads_after" "$sent" "$((user_after + sys_after - user_before - sys_before))")"
      echo "#   kvpick$i page faults per request (minor: fresh or returned pages touched): $(python3 -c "print(f'{($faults_after - $faults_before) / $sent:.1f}')")"
      echo "#   kvpick$i its Envoy's CPU per request (warm-up included): $(python3 -c "print(f'{($envoy_after - $envoy_before) * 1e4 / $sent:.0f} µs')")"
      echo "#   kvpick$i ext-proc messages per request (Envoy to kvpick): $(python3 -c "print(f'{($msgs_after - $msgs_before) / $sent:.1f}')")"
      [ "$PODS" = sim ] && echo "#   kvpick$i KV events applied per request: $(python3 -c "print(f'{($applied_after - $applied_before) / $sent:.1f}')")"
      cached=$(curl -sf "http://127.0.0.1:$metrics/metrics" | awk '/^kvpick_tokenize_prefix_cache_bytes/ {n += $NF} END {printf "%d", n / 1048576}')
      echo "#   kvpick$i memory: peak RSS $((hwm / 1024)) MiB during the run, $((rss_before / 1024)) MiB before it; prefix token cache after it ${cached} MiB"
      python3 - "$r" "$size" "$variant" "$pace" "kvpick$i" "$a" "$alone" "$before" "$after" \
        "${IDLE[$i]}" "$((routed_after - routed_before))" "$((msgs_after - msgs_before))" <<'PY'
import json, sys
r, size, variant, pace, name, a, b, before, after, idle, routed, msgs = sys.argv[1:]
a, b = json.loads(a), json.loads(b)
la, lb = a["latency"], b["latency"]
def row(setup, rep, added, cpu):
    l = rep["latency"]
    print(f'{r},{size},{variant},{pace},{setup},{l["p50_ms"]:.3f},{l["p99_ms"]:.3f},{added},{rep["requests_per_second"]:.0f},{rep["errors"]},{cpu}')
n = la["count"] + a["errors"]
cpu = a["cpu_us_per_request"] - float(idle) * a["seconds"] * 1e6 / max(n, 1)
row(f"envoy+{name}", a, f'{la["p50_ms"] - lb["p50_ms"]:.3f},{la["p99_ms"] - lb["p99_ms"]:.3f}', f'{cpu:.1f}')
# Warm-up included: every request sent must have been picked by kvpick (none failed open).
sent = n + {"warm": 50, "cold": 20, "fixed": 300}[variant]
if int(routed) != sent:
    print(f"# WARNING {name}: {routed} of {sent} requests were picked by kvpick")
if name == "kvpick0":
    row("envoy-alone", b, ",", "")
# Per message: the run's CPU (warm-up excluded) over the messages of the counted requests
# (the messages counted include the warm-up's; scaled to the counted share).
if int(msgs) > 0:
    per_request = int(msgs) / sent
    print(f"#   {name} kvpick CPU µs per ext-proc message: {cpu / per_request:.1f} ({per_request:.1f} messages/request)")
def parse(text):
    out = {}
    for line in text.splitlines():
        key, value = line.rsplit(" ", 1)
        out[key] = float(value)
    return out
b0, a0 = parse(before), parse(after)
parts = []
for key, total in a0.items():
    if "_sum{" not in key:
        continue
    count_key = key.replace("_sum{", "_count{")
    n = a0.get(count_key, 0) - b0.get(count_key, 0)
    if n > 0:
        stage = key.split('stage="')[1].split('"')[0]
        parts.append(f"{stage}={(total - b0.get(key, 0)) / n * 1e6:.0f}")
if parts:
    print(f"#   {name} stage µs/request: " + " ".join(parts))
PY
    done
  done; done; done
done
echo "# every kvpick run's requests were all picked by kvpick unless a WARNING says otherwise"
