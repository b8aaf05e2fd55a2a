"""Every full prefill of a `bench/compare.py` run, and why kvpick made it.

Reads each system's `requests.jsonl` (the pods' request logs) in a run directory and lists
the requests that found less than half their prompt cached, in arrival order:
- `first`: no pod had served the request's prefix before in the run (every router pays these);
- `copy`: another pod had (the pods that had are listed);
- `again`: only the same pod had (its blocks were evicted since).
A prefix is what the comparison's own tables count (`kvbench.stats.prefix_key`: a
conversation in multi-turn runs, a group otherwise; the kind is read from the run's
`summary.json`). The time is seconds since the run's first request.

For a kvpick system run with `KVPICK_BENCH_RUST_LOG=warn,kvpick::scheduling::placement=debug`,
each copy also gets the decision kvpick logged for it: the first logged decision within
0.5 s of the request's arrival whose cheapest candidate is the pod the request went to and
where another candidate held some of the prompt. Each candidate is shown as
`pod:cost/ttft/decode/holdup/cached/backlog/awaiting` (ms, tokens, requests), the picked pod first.

Usage: python3 bench/copies.py RUN_DIR [--from SECONDS]
Standard library only (and bench/kvbench)."""

import argparse
import datetime
import json
import os
import re
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kvbench.stats import is_full_prefill, prefix_key  # noqa: E402

MATCH_WINDOW_S = 0.5

_CANDIDATE = re.compile(
    r"(?P<addr>\S+) cost=(?P<cost>\S+) ttft=(?P<ttft>\S+) decode=(?P<decode>\S+) evict=\S+ holdup=(?P<holdup>\S+) "
    r"cached=(?P<cached>\S+) backlog=(?P<backlog>\S+) awaiting=(?P<awaiting>\S+)"
)


def load_requests(system_dir):
    """The run's requests in arrival order."""
    with open(os.path.join(system_dir, "requests.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows.sort(key=lambda r: r["arrived"])
    return rows


def workload_kind(system_dir):
    """The run's workload kind, from the `summary.json` beside the system's directory (None
    when there is none)."""
    path = os.path.join(os.path.dirname(os.path.normpath(system_dir)), "summary.json")
    try:
        with open(path) as f:
            return json.load(f)["workload"]["kind"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def full_prefills(rows, key="head"):
    """(index, request, kind, pods that served its prefix before) of every full prefill;
    `key` names the prefix's field."""
    served = {}
    out = []
    for i, r in enumerate(rows):
        before = served.setdefault(r[key], set())
        if is_full_prefill(r):
            elsewhere = sorted(before - {r["pod"]})
            kind = "copy" if elsewhere else "again" if before else "first"
            out.append((i, r, kind, elsewhere))
        before.add(r["pod"])
    return out


def pod_addresses(system_dir):
    """Pod index -> address, from the run's pool file (the order the pods were started in)."""
    path = os.path.join(system_dir, "pool.yaml")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        addresses = re.findall(r"^\s*- address:\s*(\S+)", f.read(), re.MULTILINE)
    return {i: a for i, a in enumerate(addresses)}


def parse_decision(line):
    """(epoch seconds, [candidate dicts]) of a `placement costs` log line, or None."""
    if "placement costs" not in line or "candidates=" not in line:
        return None
    stamp = line.split(" ", 1)[0].rstrip("Z")
    try:
        at = datetime.datetime.fromisoformat(stamp).replace(tzinfo=datetime.timezone.utc).timestamp()
    except ValueError:
        return None
    candidates = [m.groupdict() for m in _CANDIDATE.finditer(line.split("candidates=", 1)[1])]
    for c in candidates:
        for key in ("cost", "ttft", "decode", "holdup", "cached", "backlog", "awaiting"):
            c[key] = float(c[key])
    return (at, candidates) if candidates else None


def load_decisions(system_dir):
    path = os.path.join(system_dir, "logs", "kvpick.log")
    if not os.path.exists(path):
        return []
    with open(path, errors="replace") as f:
        return [d for d in map(parse_decision, f) if d is not None]


def decision_for(request, address, decisions, used):
    """The logged decision that placed a copy of `request` on `address` (see the module doc)."""
    for k, (at, candidates) in enumerate(decisions):
        if k in used or at < request["arrived"] - 0.05:
            continue
        if at > request["arrived"] + MATCH_WINDOW_S:
            break
        cheapest = min(candidates, key=lambda c: c["cost"])
        held_elsewhere = any(c["cached"] > 0 and c["addr"] != address for c in candidates)
        if cheapest["addr"] == address and held_elsewhere:
            used.add(k)
            return candidates
    return None


def describe(candidates, address, names):
    def one(c):
        return (f"{names.get(c['addr'], c['addr'])}:{c['cost']:.0f}/{c['ttft']:.0f}/{c['decode']:.0f}/{c['holdup']:.0f}/"
                f"{c['cached']:.0f}/{c['backlog']:.0f}/{c['awaiting']:.0f}")
    picked = [c for c in candidates if c["addr"] == address]
    others = sorted((c for c in candidates if c["addr"] != address), key=lambda c: c["cost"])
    return " ".join(one(c) for c in picked + others)


def report(system_dir, since=0.0, out=sys.stdout):
    rows = load_requests(system_dir)
    if not rows:
        return
    t0 = rows[0]["arrived"]
    addresses = pod_addresses(system_dir)
    names = {a: str(i) for i, a in addresses.items()}
    decisions = load_decisions(system_dir)
    used = set()
    key = prefix_key(workload_kind(system_dir))
    prefills = [p for p in full_prefills(rows, key) if p[1]["arrived"] - t0 >= since]
    copies = sum(1 for p in prefills if p[2] == "copy")
    print(f"{os.path.basename(os.path.normpath(system_dir))}: {len(prefills)} full prefills, "
          f"{copies} copies", file=out)
    for _, r, kind, before in prefills:
        line = (f"  t={r['arrived'] - t0:7.2f} pod {r['pod']} prefix {r[key][:6]} {kind:5s} "
                f"ttft {r['first_token_s'] * 1000:4.0f} ms")
        if kind == "copy":
            line += f" (held on {','.join(map(str, before))})"
            address = addresses.get(r["pod"])
            candidates = decision_for(r, address, decisions, used) if address and decisions else None
            if candidates:
                line += "\n      " + describe(candidates, address, names)
        print(line, file=out)


def main():
    # Piped into `head`: stop quietly.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", help="a bench/compare.py --out directory, or one system's directory in it")
    p.add_argument("--from", dest="since", type=float, default=0.0,
                   help="only full prefills this many seconds after the run's first request")
    args = p.parse_args()
    if os.path.exists(os.path.join(args.run_dir, "requests.jsonl")):
        systems = [args.run_dir]
    else:
        systems = sorted(os.path.join(args.run_dir, d) for d in os.listdir(args.run_dir)
                         if os.path.exists(os.path.join(args.run_dir, d, "requests.jsonl")))
    if not systems:
        p.error(f"no requests.jsonl under {args.run_dir}")
    for system in systems:
        report(system, args.since)


if __name__ == "__main__":
    main()
