"""Side-by-side benchmark: the same seeded inference-perf workload through each router in
front of a fresh kvpick-sim fleet (scripts/compare.sh runs this; docs/benchmarks.md).

For each system in turn: start kvpick-sim (N pods, block size 16, KV capacity so one pod
holds about a third of the shared prefixes), start the system, run inference-perf (Poisson
arrivals over a rate ladder, streaming), read its reports and the pods' own counters, stop
everything it started (by PID). Writes results.csv, summary.json, table.md and PNG plots.
"""

import argparse
import json
import os
import re
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kvbench import report  # noqa: E402
from kvbench.procs import Procs, free_port_run, free_ports, http_get, wait_until  # noqa: E402
from kvbench.stats import counters_delta, fleet_summary, kv_lookups, placement_summary, pod_counters, prefix_key, split_by_stage, stage_pod_times, stage_row  # noqa: E402
from kvbench.systems import SYSTEMS, Fleet, add_kvpick_config, add_kvpick_flags, fleet_topic  # noqa: E402
from kvbench.workload import KINDS, Workload, blocks_per_pod, inference_perf_config, shifting_spec  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# kvpick-sim's --request-log in each system's run directory: which pod served each request.
REQUEST_LOG = "requests.jsonl"

# Settings per mode. time_scale multiplies the simulator's A100-style step costs (so 4.0 runs
# every step 4x slower than an A100 would): it brings the saturation point of the fleet down
# to rates a Python client on two shared cores can offer without becoming the bottleneck.
MODES = {
    "default": dict(
        pods=8, time_scale=4.0,
        workload=Workload(groups=45, prompts_per_group=5, system_len=2000, question_len=200,
                          output_len=64, rates=[6.0, 12.0, 18.0, 24.0], stage_seconds=30),
        systems=list(SYSTEMS),
    ),
    # ≤ 3 minutes: every inference-perf run costs ~15 s of start-up whatever its length, so
    # quick runs the four systems that answer the question (round robin, kvpick, the two
    # approximate routers); kvpick-default and vllm-router kv_aware only in the default run.
    "quick": dict(
        pods=4, time_scale=4.0,
        workload=Workload(groups=14, prompts_per_group=4, system_len=1000, question_len=100,
                          output_len=32, rates=[4.0, 8.0], stage_seconds=5),
        systems=["round-robin", "kvpick-recommended", "smg-cache-aware", "vllm-router-cache-aware"],
    ),
    # scripts/demo.sh's comparison: ~1 minute, kvpick against round robin only, one stage at
    # a rate where round robin queues.
    "demo": dict(
        pods=4, time_scale=4.0,
        workload=Workload(groups=14, prompts_per_group=4, system_len=1000, question_len=100,
                          output_len=32, rates=[10.0], stage_seconds=8),
        systems=["round-robin", "kvpick-recommended"],
    ),
    # The CI smoke run (crates/kvpick-bench/tests/compare_smoke.rs): seconds, three systems,
    # full caches (the two pods together hold 60% of the groups' prefixes, so prefixes are
    # evicted and a router's memory of where it sent them goes stale). NOTE: 10 s (80
    # requests), not 5: in 40 the first pass over the 28 prompts is a third of the run, and
    # both routers' hit rates moved by ±2 requests from run to run on a loaded machine.
    "smoke": dict(
        pods=2, time_scale=1.0, cache_fraction=0.3,
        workload=Workload(groups=7, prompts_per_group=4, system_len=512, question_len=32,
                          output_len=8, rates=[8.0], stage_seconds=10),
        systems=["round-robin", "kvpick-recommended", "smg-cache-aware"],
    ),
}


# What each workload kind changes from the mode's shared-prefix shape (--workload).
KIND_SETTINGS = {
    "default": {
        "multi-turn": dict(conversations=90, turns=8, shared_len=200, system_len=1000),
        "shifting": dict(hot_fraction=0.25, hot_share=0.9),
    },
    "quick": {
        "multi-turn": dict(conversations=16, turns=4, shared_len=100, system_len=500),
    },
    "smoke": {
        "multi-turn": dict(conversations=8, turns=3, shared_len=64, system_len=256),
    },
}


def heterogeneous_overrides(pods, blocks):
    """`--heterogeneous`: pod 0 runs every step twice as slowly (an older GPU), pod 1 has half
    the KV blocks of the others (a smaller one). kvpick-sim's --pod-override syntax."""
    if pods < 2:
        raise ValueError("--heterogeneous needs at least 2 pods")
    return ["0:slowdown=2.0", f"1:blocks={max(2, blocks // 2)}"]


class Ctx:
    """What a system's start function needs."""

    def __init__(self, args, fleet, run_dir, block_size):
        self.repo = REPO
        self.fleet = fleet
        self.run_dir = run_dir
        self.block_size = block_size
        self.kvpick = os.path.join(args.bin_dir, "kvpick")
        self.envoy = args.envoy
        self.venv_bin = os.path.dirname(sys.executable)
        self.replicas = args.replicas
        self.envoy_responses = args.envoy_responses
        # /metrics of routers whose own counters the summary reports (vllm-router).
        self.router_metrics = []

    def ports(self, n):
        return free_ports(n)


def scrape(fleet):
    return [pod_counters(http_get(f"{u}/metrics")[1]) for u in fleet.urls()]


def sim_argv(args, base, events, replay, blocks, topic=None, request_log=None):
    """kvpick-sim's command line: args.pods pods from these base ports, `blocks` KV blocks
    each, publishing on `topic` (a --kv-events-topic template; None: the simulator's default),
    writing a line per request to `request_log` (a path; None: no log)."""
    argv = [
        os.path.join(args.bin_dir, "kvpick-sim"), "--pods", str(args.pods), "--base-port", str(base),
        "--events-base-port", str(events), "--replay-base-port", str(replay),
        "--block-size", str(args.block_size), "--num-gpu-blocks", str(blocks),
        "--time-scale", str(args.time_scale), "--prefix-caching-hash-algo", "sha256_cbor",
        "--tokenizer", os.path.join(REPO, "assets/tokenizer"), "--model", args.model,
    ]
    if topic is not None:
        argv += ["--kv-events-topic", topic]
    if request_log is not None:
        argv += ["--request-log", request_log]
    overrides = list(args.pod_override or [])
    if args.heterogeneous:
        overrides = heterogeneous_overrides(args.pods, blocks) + overrides
    for o in overrides:
        argv += ["--pod-override", o]
    return argv


def start_fleet(args, procs, workload, run_dir, topic=None):
    n = args.pods
    base = free_port_run(n, start=21000)
    events = free_port_run(n, start=base + n + 10)
    replay = free_port_run(n, start=events + n + 10)
    blocks = args.num_gpu_blocks or blocks_per_pod(workload, args.block_size, fraction=args.cache_fraction)
    argv = sim_argv(args, base, events, replay, blocks, topic, os.path.join(run_dir, REQUEST_LOG))
    procs.start("kvpick-sim", argv, env={"RUST_LOG": "warn"})
    fleet = Fleet(n, base, events, replay, args.model)
    for u in fleet.urls():
        wait_until(f"pod {u}", lambda u=u: http_get(f"{u}/health")[0] == 200, procs, timeout=30)
    return fleet, blocks


class Progress(threading.Thread):
    """The live progress line, and the pods' counters at each stage's start and end (read
    from inference-perf's log), so the engine-side hit rate is per rate."""

    def __init__(self, label, fleet, log_path, expected):
        super().__init__(daemon=True)
        self.label, self.fleet, self.log_path, self.expected = label, fleet, log_path, expected
        # A log left in the directory by an earlier run (the same --out) holds every stage's
        # lines already: read before inference-perf truncates it, it marked every stage at
        # the first scrape, and each stage's engine counters came out empty.
        try:
            os.remove(log_path)
        except FileNotFoundError:
            pass
        self.stop = threading.Event()
        self.marks = {}
        # (seconds since start, per-pod waiting, per-pod running, per-pod finished), each
        # second: what per-stage totals hide (short-term imbalance, queues building on one pod).
        self.series = []
        self.t0 = time.monotonic()
        self.tty = sys.stderr.isatty()
        self.last_print = 0.0

    def run(self):
        seen = set()
        while not self.stop.is_set():
            try:
                counters = scrape(self.fleet)
            except Exception:  # noqa: BLE001 - the line just skips a beat
                counters = None
            if counters is not None:
                self.series.append((round(time.monotonic() - self.t0, 1),
                                    [int(c["waiting"]) for c in counters],
                                    [int(c["running"]) for c in counters],
                                    [int(c["finished"]) for c in counters]))
                try:
                    with open(self.log_path, errors="replace") as f:
                        text = f.read()
                except OSError:
                    text = ""
                for m in re.finditer(r"Stage (\d+) - run (started|completed)", text):
                    key = (int(m.group(1)), m.group(2))
                    if key not in seen:
                        seen.add(key)
                        self.marks[key] = counters
                done = int(sum(c["finished"] for c in counters))
                stage = max((k[0] for k in seen), default=0)
                line = (
                    f"{self.label}: stage {stage + 1}, {done}/{self.expected} requests finished, "
                    f"{time.monotonic() - self.t0:4.0f}s"
                )
                # A live line on a terminal; one line per 10 s in a log.
                if self.tty:
                    sys.stderr.write("\r" + line + " ")
                elif time.monotonic() - self.last_print >= 10:
                    sys.stderr.write(line + "\n")
                    self.last_print = time.monotonic()
                sys.stderr.flush()
            self.stop.wait(1.0)
        if self.tty:
            sys.stderr.write("\n")


def read_request_log(path):
    """The fleet's request log as dicts, or an error string."""
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()], None
    except (OSError, ValueError) as e:
        return None, f"{path}: {e}"


def placement_from_log(records, workload):
    """stats.placement_summary over the fleet's request log, by `stats.prefix_key`."""
    return placement_summary(records, key=prefix_key(workload.kind))


def run_system(args, name, index, total, workload, out_dir):
    run_dir = os.path.join(out_dir, name)
    os.makedirs(run_dir, exist_ok=True)
    procs = Procs(os.path.join(run_dir, "logs"))
    t0 = time.monotonic()
    phases = {}
    try:
        fleet, blocks = start_fleet(args, procs, workload, run_dir, fleet_topic(name))
        phases["fleet_up"] = round(time.monotonic() - t0, 1)
        ctx = Ctx(args, fleet, run_dir, args.block_size)
        front = SYSTEMS[name]["start"](ctx, procs)
        phases["system_up"] = round(time.monotonic() - t0, 1)
        before = scrape(fleet)
        ipf_out = os.path.join(run_dir, "inference-perf")
        cfg = inference_perf_config(workload, front, args.model, os.path.join(REPO, "assets/tokenizer"), ipf_out)
        headers = args.headers_by_system.get(name)
        if headers:
            cfg["api"]["headers"] = headers
        import yaml

        cfg_path = os.path.join(run_dir, "inference-perf.yaml")
        with open(cfg_path, "w") as f:
            yaml.safe_dump(cfg, f, sort_keys=False)
        log_path = os.path.join(run_dir, "logs", "inference-perf.log")
        expected = int(sum(workload.stage_requests()))
        progress = Progress(f"[{index}/{total} {name}]", fleet, log_path, expected)
        progress.start()
        cpu_before = procs.cpu_seconds()
        ipf = procs.start(
            "inference-perf",
            [sys.executable, os.path.join(REPO, "bench", "ipf_seeded.py"), "--config_file", cfg_path],
            env=ipf_env(workload),
        )
        limit = 120 + 3 * len(workload.rates) * (workload.stage_seconds + 5)
        try:
            code = ipf.wait(timeout=limit)
        finally:
            progress.stop.set()
            progress.join()
        cpu_after = procs.cpu_seconds()
        phases["load_done"] = round(time.monotonic() - t0, 1)
        if code != 0:
            raise RuntimeError(f"inference-perf exited with {code}; see {log_path}")
        write_pod_series(os.path.join(run_dir, "pods-timeseries.csv"), progress.series)
        after = scrape(fleet)
        whole = fleet_summary(counters_delta(after, before))
        records, log_error = read_request_log(os.path.join(run_dir, REQUEST_LOG))
        rows = collect_rows(name, workload, ipf_out, progress.marks, whole, records or [])
        # What each process of the system spent while the load ran: on two shared cores the
        # harness's own CPU limits the rates it can offer, so a router's cost shows here.
        extra = {"cpu_seconds_under_load": {k: round(cpu_after[k] - v, 2) for k, v in cpu_before.items() if k in cpu_after}}
        extra["placement"] = {"error": log_error} if log_error else placement_from_log(records, workload)
        lookups = router_kv_lookups(ctx.router_metrics)
        if lookups:
            extra["router_kv_lookups"] = lookups
        return rows, {"system": name, "flags": SYSTEMS[name]["flags"], "blocks_per_pod": blocks,
                      "phase_seconds": phases, **whole, **extra}
    finally:
        procs.stop_all()


def system_headers(specs):
    """`--system-header SYSTEM:NAME=VALUE` (repeatable) → {system: {name: value}}: request
    headers inference-perf sends to that system only (e.g. latency objectives for one kvpick
    variant, so a run A/Bs them against the same profile without)."""
    out = {}
    for spec in specs or []:
        system, sep1, header = spec.partition(":")
        key, sep2, value = header.partition("=")
        if not (sep1 and sep2 and system and key):
            raise ValueError(f"--system-header wants SYSTEM:NAME=VALUE, got {spec!r}")
        out.setdefault(system, {})[key.strip()] = value.strip()
    return out


def write_pod_series(path, series):
    """The pods' queues each second: `t,waiting_0..n,running_0..n,finished_0..n`."""
    if not series:
        return
    n = len(series[0][1])
    with open(path, "w") as f:
        f.write(",".join(["t"] + [f"{k}_{i}" for k in ("waiting", "running", "finished") for i in range(n)]) + "\n")
        for t, waiting, running, finished in series:
            f.write(",".join(str(v) for v in [t, *waiting, *running, *finished]) + "\n")


def router_kv_lookups(urls):
    """vllm-router kv_aware's KV-index lookups by result, summed over its replicas."""
    total = {}
    for url in urls:
        try:
            status, text = http_get(url)
        except OSError:  # a router that died is reported by its run, not here
            continue
        if status != 200:
            continue
        for result, n in kv_lookups(text).items():
            total[result] = total.get(result, 0) + n
    return total


def ipf_env(workload):
    """inference-perf's environment: offline tokenizer, the arrival seed, the shift spec."""
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "KVPICK_BENCH_SEED": str(workload.seed)}
    spec = shifting_spec(workload)
    env["KVPICK_BENCH_SHIFTING"] = json.dumps(spec) if spec else ""
    return env


def build_workload(mode, kind, rates=None, stage_seconds=None, api=None):
    """The mode's workload shaped for `kind` (KIND_SETTINGS), with the command line's rates and
    API (`completion`, the default, or `chat`: streaming chat completions)."""
    workload = Workload(**MODES[mode]["workload"].to_dict())
    workload.kind = kind
    if api:
        workload.api = api
    for key, value in KIND_SETTINGS.get(mode, {}).get(kind, {}).items():
        setattr(workload, key, value)
    if rates:
        workload.rates = [float(r) for r in rates.split(",")]
    if stage_seconds:
        workload.stage_seconds = stage_seconds
    return workload.validate()


def collect_rows(name, workload, ipf_out, marks, whole, records):
    stages = []
    for i, _ in enumerate(workload.rates):
        with open(os.path.join(ipf_out, f"stage_{i}_lifecycle_metrics.json")) as f:
            stages.append(json.load(f))
    with open(os.path.join(ipf_out, "per_request_lifecycle_metrics.json")) as f:
        per_request = json.load(f)
    counts = [((s.get("successes") or {}).get("count") or 0) + ((s.get("failures") or {}).get("count") or 0) for s in stages]
    rows = []
    pod_times = stage_pod_times(records, counts)
    for i, (rate, stage, reqs) in enumerate(zip(workload.rates, stages, split_by_stage(per_request, counts))):
        row = stage_row(name, rate, stage, reqs)
        row.update(pod_times[i] or {})
        start, end = marks.get((i, "started")), marks.get((i, "completed"))
        if start is not None and end is not None:
            s = fleet_summary(counters_delta(end, start))
        else:
            s = whole
        row.update(engine_hit_rate=s["engine_hit_rate"], load_imbalance=s["load_imbalance"], requests_per_pod=s["requests_per_pod"])
        rows.append(row)
    return rows


def describe(workload):
    """A short name of the workload for plot titles."""
    if workload.kind == "multi-turn":
        return f"multi-turn {workload.conversations} chats x {workload.turns} turns"
    if workload.kind == "no-sharing":
        return f"no sharing, {workload.system_len + workload.question_len}-token prompts"
    shape = f"{workload.groups}x{workload.prompts_per_group} groups"
    if workload.kind == "shifting":
        shape += f", hot set ({workload.hot_share:.0%} of requests) shifts mid-stage"
    return shape


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--mode", choices=list(MODES), default="default")
    p.add_argument("--workload", choices=KINDS, default="shared-prefix",
                   help="shared-prefix (GIE), multi-turn chat, no-sharing control, shifting popularity")
    p.add_argument("--api", choices=["completion", "chat"], default=None,
                   help="the API inference-perf speaks (default completion; chat for shared-prefix and shifting)")
    p.add_argument("--heterogeneous", action="store_true",
                   help="pod 0 twice as slow, pod 1 with half the KV blocks")
    p.add_argument("--pod-override", action="append",
                   help="kvpick-sim --pod-override INDEX:blocks=N,slowdown=F,... (repeatable)")
    p.add_argument("--replicas", type=int, default=1,
                   help="router replicas: N kvpick behind one Envoy, N smg/vllm-router behind an Envoy round-robin front")
    p.add_argument("--systems", help="comma-separated subset of: " + ", ".join(SYSTEMS))
    p.add_argument("--envoy-responses", choices=["observe", "routing", "observe-no-body"], default="observe",
                   help="where kvpick's Envoy sends the response: the shipped `kvpick-observe` "
                        "filter (observability_mode) or the routing filter (one filter, FULL_DUPLEX_STREAMED); observe-no-body: the shipped layout without "
                        "response bodies (measures what the chunks cost; kvpick then sees no first bytes)")
    p.add_argument("--kvpick-config", action="append", default=[], metavar="NAME=FILE",
                   help="add system kvpick-NAME: kvpick with this EndpointPickerConfig (repeatable)")
    p.add_argument("--kvpick-flags", action="append", default=[], metavar="NAME=FLAGS",
                   help="add system kvpick-NAME: kvpick with these extra serve flags, e.g. "
                        "'slow=--recommended-profile --scrape-interval 200ms' (repeatable)")
    p.add_argument("--system-header", action="append", default=[], metavar="SYSTEM:NAME=VALUE",
                   help="a request header inference-perf sends to one system only (repeatable)")
    p.add_argument("--pods", type=int)
    p.add_argument("--time-scale", type=float)
    p.add_argument("--rates", help="comma-separated req/s ladder")
    p.add_argument("--stage-seconds", type=int)
    p.add_argument("--num-gpu-blocks", type=int, help="override the cache-fraction sizing")
    p.add_argument("--cache-fraction", type=float,
                   help="share of the groups' prefixes one pod holds (default 1/3; 1/pods: full caches)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--model", default="sim-model")
    p.add_argument("--bin-dir", default=os.path.join(REPO, "target", "release"))
    p.add_argument("--envoy", default=os.path.join(REPO, ".venv", "bin", "envoy"))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    mode = MODES[args.mode]
    try:
        workload = build_workload(args.mode, args.workload, args.rates, args.stage_seconds, args.api)
    except ValueError as e:
        p.error(str(e))
    if args.replicas < 1:
        p.error("--replicas must be at least 1")
    args.pods = args.pods or mode["pods"]
    if args.cache_fraction is None:
        args.cache_fraction = mode.get("cache_fraction", 1 / 3)
    if not 0 < args.cache_fraction <= 1:
        p.error("--cache-fraction must be in (0, 1]")
    args.time_scale = args.time_scale if args.time_scale is not None else mode["time_scale"]
    for spec in args.kvpick_config:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            p.error(f"--kvpick-config wants NAME=FILE, got {spec!r}")
        try:
            add_kvpick_config(name, path)
        except ValueError as e:
            p.error(str(e))
    for spec in args.kvpick_flags:
        name, sep, flags = spec.partition("=")
        if not sep or not name:
            p.error(f"--kvpick-flags wants NAME=FLAGS, got {spec!r}")
        try:
            add_kvpick_flags(name, flags)
        except ValueError as e:
            p.error(str(e))
    try:
        args.headers_by_system = system_headers(args.system_header)
    except ValueError as e:
        p.error(str(e))
    unknown_headers = set(args.headers_by_system) - set(SYSTEMS)
    if unknown_headers:
        p.error(f"--system-header names unknown systems {sorted(unknown_headers)}")
    systems = args.systems.split(",") if args.systems else mode["systems"]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        p.error(f"unknown systems {unknown}; known: {list(SYSTEMS)}")
    if args.heterogeneous and args.pods < 2:
        p.error("--heterogeneous needs at least 2 pods")
    out_dir = args.out or os.path.join(REPO, "target", "compare", args.mode)
    os.makedirs(out_dir, exist_ok=True)

    t0 = time.monotonic()
    rows, per_system, errors = [], [], {}
    for i, name in enumerate(systems, 1):
        try:
            r, s = run_system(args, name, i, len(systems), workload, out_dir)
            rows += r
            per_system.append(s)
        except Exception as e:  # noqa: BLE001 - one peer failing must not lose the others
            errors[name] = str(e)
            sys.stderr.write(f"\n{name}: FAILED: {e}\n")
    elapsed = time.monotonic() - t0

    summary = {
        "mode": args.mode,
        "command": " ".join(sys.argv),
        "elapsed_seconds": round(elapsed, 1),
        "pods": args.pods,
        "block_size": args.block_size,
        "time_scale": args.time_scale,
        "replicas": args.replicas,
        "pod_overrides": (heterogeneous_overrides(args.pods, per_system[0]["blocks_per_pod"]) if args.heterogeneous and per_system else [])
        + list(args.pod_override or []),
        "workload": workload.to_dict(),
        "systems": per_system,
        "errors": errors,
        "rows": [{k: v for k, v in r.items() if k != "ttft_per_request"} for r in rows],
    }
    report.write_json(os.path.join(out_dir, "summary.json"), summary)
    report.write_csv(os.path.join(out_dir, "results.csv"), rows)
    table = (report.markdown_table(rows, args.time_scale) + report.ttft_split_table(rows)
             + report.placement_table(per_system) + report.cpu_table(per_system))
    with open(os.path.join(out_dir, "table.md"), "w") as f:
        f.write(table)
    plot_paths = []
    if rows:
        title = f"{args.pods} pods, {describe(workload)}, time scale {args.time_scale:g}"
        if args.heterogeneous:
            title += ", heterogeneous"
        if args.replicas > 1:
            title += f", {args.replicas} router replicas"
        plot_paths = report.plots(out_dir, rows, title)
    print(table)
    print(f"results: {out_dir}/results.csv, {out_dir}/summary.json; plots: {', '.join(plot_paths)}")
    print(f"elapsed {elapsed:.0f}s")
    for name, e in errors.items():
        print(f"FAILED {name}: {e}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
