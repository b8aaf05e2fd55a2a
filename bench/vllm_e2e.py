"""Conformance of kvpick against two real vLLM engines (issue 17; scripts/vllm-e2e.sh runs
this with the vLLM venv's Python). Prints PASS/FAIL per check, a summary line, and exits 1 on
any failure; every process it started is stopped by PID on the way out, failures included.

What "the engine reported" means here: the driver subscribes to each engine's ZMQ KV events
itself (bench/vllme2e/events.py) and compares kvpick's /debug views with that, plus the
engines' own /metrics counters, /tokenize and the ids they ran (`return_token_ids`).
"""

import argparse
import hashlib
import json
import os
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from kvbench.procs import Procs, wait_until  # noqa: E402
from vllme2e import checks  # noqa: E402
from vllme2e.compare import compare  # noqa: E402
from vllme2e.events import EventWatcher  # noqa: E402
from vllme2e.stack import Engine, Envoy, Kvpick, SimEngine, build_model, wait_engines  # noqa: E402


class Run:
    """Everything the checks reach: engines, kvpick, the two Envoys, the event watcher."""


def parse():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repo", default=os.path.dirname(HERE))
    p.add_argument("--cache", required=True, help="where the model is built (outside the repository)")
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--kvpick", required=True)
    p.add_argument("--envoy", required=True)
    p.add_argument("--num-blocks", type=int, default=64, help="--num-gpu-blocks-override per engine")
    p.add_argument("--max-model-len", type=int, default=1536)
    p.add_argument("--compare", action="store_true", help="also run the kvpick-vs-round-robin comparison")
    p.add_argument("--compare-only", action="store_true", help="only the comparison")
    p.add_argument("--run-dir", required=True, help="logs, configs and the run's captures")
    p.add_argument("--sim-bin", help="run the same checks on two kvpick-sim processes instead of vLLM")
    a = p.parse_args()
    a.python = sys.executable
    return a


def model_dir(args):
    """The tiny model, one per tokenizer (its files' hash in the folder name)."""
    h = hashlib.sha256()
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        path = os.path.join(args.tokenizer, f)
        if os.path.exists(path):
            with open(path, "rb") as fh:
                h.update(fh.read())
    return os.path.join(args.cache, f"model-qwentok-{h.hexdigest()[:12]}")


def save_capture(run):
    """The run's decoded KV events per engine (hashes as strings) and the engines' /metrics."""
    with open(os.path.join(run.run_dir, "kv-events.jsonl"), "w") as f:
        for pod, seq, ts, events in list(run.watcher.log):
            f.write(json.dumps({"pod": pod, "seq": seq, "ts": ts, "events": events},
                               default=str) + "\n")
    for e in run.engines:
        try:
            with open(os.path.join(run.run_dir, f"metrics-{e.name}.txt"), "w") as f:
                f.write(e.metrics())
        except Exception:  # noqa: BLE001 - an engine killed by a failed check has none
            pass


def main():
    args = parse()
    os.makedirs(args.run_dir, exist_ok=True)
    args.model_dir = model_dir(args)
    t0 = time.monotonic()
    if not args.sim_bin:
        build_model(args.tokenizer, args.model_dir, args.python)
    procs = Procs(os.path.join(args.run_dir, "logs"))
    run = Run()
    run.procs, run.run_dir, run.results = procs, args.run_dir, checks.Results()
    run.watcher = None
    run.info = {}

    def on_signal(signum, _frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    timings = {}
    try:
        if args.sim_bin:
            run.engines = [SimEngine("sim-a", args), SimEngine("sim-b", args)]
        else:
            cpus = sorted(os.sched_getaffinity(0))
            run.engines = [Engine(n, args, cpus[i % len(cpus)]) for i, n in enumerate(("vllm-a", "vllm-b"))]
        # Subscribed before the engines exist: a PUB drops what it sends before a subscriber joins.
        run.watcher = EventWatcher({e.address: e.events for e in run.engines})
        run.watcher.start()
        for e in run.engines:
            e.start(procs)
        wait_engines(run.engines, procs)
        timings["engines_ready_s"] = round(time.monotonic() - t0, 1)
        run.kvpick = Kvpick(args, run.engines, args.run_dir)
        run.kvpick.start(procs)
        wait_until("kvpick subscribed to both engines",
                   lambda: all((p["kv_events"] or {}).get("connected") and p["ready"]
                               for p in run.kvpick.pods().values()), procs, timeout=60)
        run.envoy = Envoy(args, run.engines, args.run_dir, run.kvpick, "envoy-kvpick")
        run.envoy.start(procs)
        run.envoy_rr = Envoy(args, run.engines, args.run_dir, None, "envoy-round-robin")
        run.envoy_rr.start(procs)
        timings["stack_ready_s"] = round(time.monotonic() - t0, 1)
        print(f"stack up in {timings['stack_ready_s']} s: engines {[e.address for e in run.engines]}, "
              f"Envoy :{run.envoy.port} (kvpick) / :{run.envoy_rr.port} (round robin), logs {args.run_dir}",
              flush=True)
        if not args.compare_only:
            steps = [
                ("probe", lambda: checks.probe(run)),
                ("tokenization", lambda: checks.tokenization(run)),
                ("routing-completions", lambda: checks.routing(run, "completions")),
                ("routing-chat", lambda: checks.routing(run, "chat")),
                ("view", lambda: checks.view_matches(run, "after routing")),
                ("reset", lambda: checks.reset_announce(run)),
                ("eviction", lambda: checks.eviction(run)),
                ("view-evicted", lambda: checks.view_matches(run, "after evictions")),
                ("restart", lambda: checks.restart(run)),
                ("view-restarted", lambda: checks.view_matches(run, "after the restart")),
            ]
            for name, step in steps:
                s0 = time.monotonic()
                try:
                    step()
                except Exception as e:  # noqa: BLE001 - a step that breaks is a failed check
                    run.results.check(f"{name}: ran to completion", False, repr(e))
                timings[f"{name}_s"] = round(time.monotonic() - s0, 1)
        if args.compare or args.compare_only:
            s0 = time.monotonic()
            try:
                compare(run)
            except Exception as e:  # noqa: BLE001
                run.results.check("compare: ran to completion", False, repr(e))
            timings["compare_s"] = round(time.monotonic() - s0, 1)
        kv = run.kvpick.metrics()
        errors = [line for line in kv.splitlines()
                  if line.startswith(("kvpick_kv_events_connection_errors_total", "kvpick_kv_events_skipped_total"))]
        print("kvpick KV-event error/skip counters:", errors or "none", flush=True)
        save_capture(run)
    finally:
        if run.watcher is not None:
            run.watcher.close()
        procs.stop_all(grace=10)
    timings["total_s"] = round(time.monotonic() - t0, 1)
    failed = run.results.failed()
    passed = len(run.results.rows) - len(failed)
    print("\n== summary")
    for name, ok, _ in run.results.rows:
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    print("timings:", json.dumps(timings))
    if run.info:
        print("findings:", json.dumps(run.info))
    print(f"{passed} passed, {len(failed)} failed")
    return 1 if failed or not run.results.rows else 0


if __name__ == "__main__":
    sys.exit(main())
