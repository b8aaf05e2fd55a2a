"""`--compare`: the same short shared-prefix workload through kvpick and through round robin
(Envoy without ext_proc) on the two real engines, each system starting on cold caches
(POST /reset_prefix_cache, which vLLM announces as AllBlocksCleared). Reported per system:
the repeat requests' usage.cached_tokens and the engines' own prefix-cache counters."""

import json
import os
import threading
import time

from kvbench.procs import wait_until

from .checks import completion, settle
from .stack import cached_tokens, post_json, send
from .text import words

# An odd number of groups: round robin over an interleaved order then moves every group from
# pod to pod (with an even number it would pin each group to one pod by accident). Seven
# ~10-block prefixes are more than one pod's 63 usable blocks, so where a group's prompts land
# also decides what is evicted.
GROUPS, PER_GROUP, PREFIX_WORDS, QUESTION_WORDS = 7, 4, 300, 20


def workload(seed):
    """Interleaved groups (g0q0, g1q0, …, g0q1, …): every group's first prompt is cold, the
    rest repeat its prefix."""
    out = []
    for q in range(PER_GROUP):
        for g in range(GROUPS):
            prefix = words(seed + g, PREFIX_WORDS)
            out.append((g, q, completion(f"{prefix}\nQ{q}: {words(seed * 7 + g * 31 + q, QUESTION_WORDS)}?",
                                         max_tokens=4)))
    return out


def reset(run):
    for e in run.engines:
        status, out, _ = post_json(f"{e.url}/reset_prefix_cache", {})
        if status != 200:
            raise RuntimeError(f"{e.name} /reset_prefix_cache answered {status}: {out}")
        # vLLM publishes the AllBlocksCleared with its next step: one short request (under a
        # block, so it stores nothing) makes that step happen.
        status, out, _ = post_json(f"{e.url}/v1/completions", completion("flush", max_tokens=1))
        if status != 200:
            raise RuntimeError(f"{e.name} flush request answered {status}: {out}")
    wait_until("kvpick's index empty",
               lambda: all(p["index_blocks"] == 0 for p in run.kvpick.pods().values()), run.procs, timeout=30)


def one_system(run, name, envoy, seed):
    reset(run)
    settle(run)
    before = {e.name: (e.hits(), e.queries()) for e in run.engines}
    reqs = workload(seed)
    results = [None] * len(reqs)
    lock = threading.Lock()
    nxt = [0]

    def worker():  # two concurrent clients, as many as there are engines
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= len(reqs):
                return
            results[i] = send(envoy, "/v1/completions", reqs[i][2])

    t0 = time.monotonic()
    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.monotonic() - t0
    after = {e.name: (e.hits(), e.queries()) for e in run.engines}
    repeats = [results[i] for i, (_, q, _) in enumerate(reqs) if q > 0]
    cached = [cached_tokens(r["body"]) or 0 for r in repeats]
    hits = sum(after[n][0] - before[n][0] for n in after)
    queries = sum(after[n][1] - before[n][1] for n in after)
    row = {
        "system": name,
        "requests": len(results),
        "ok": sum(r["status"] == 200 for r in results),
        "seconds": round(seconds, 1),
        "repeat_cached_tokens_mean": round(sum(cached) / len(cached), 1),
        "repeats_with_cache_hit": sum(c > 0 for c in cached),
        "repeats": len(cached),
        "engine_prefix_cache_hits": {n: after[n][0] - before[n][0] for n in after},
        "engine_prefix_cache_queries": {n: after[n][1] - before[n][1] for n in after},
        "engine_hit_rate": round(hits / queries, 3) if queries else None,
        "per_engine_requests": {e.address: sum(r["upstream"] == e.address for r in results) for e in run.engines},
    }
    return row


def compare(run):
    rows = [one_system(run, "round-robin", run.envoy_rr, 900), one_system(run, "kvpick", run.envoy, 900)]
    print("\n== kvpick vs round robin on two real vLLM engines "
          f"({GROUPS} groups x {PER_GROUP} prompts, ~{PREFIX_WORDS}-token shared prefixes, 2 clients)")
    print(f"{'system':<12} {'ok':>7} {'repeat cached_tokens (mean)':>28} {'repeats hit':>12} "
          f"{'engine hits/queries':>20} {'hit rate':>9} {'s':>6}")
    for r in rows:
        h = sum(r["engine_prefix_cache_hits"].values())
        q = sum(r["engine_prefix_cache_queries"].values())
        print(f"{r['system']:<12} {r['ok']:>3}/{r['requests']:<3} {r['repeat_cached_tokens_mean']:>28} "
              f"{r['repeats_with_cache_hit']:>5}/{r['repeats']:<6} {h:>10.0f}/{q:<9.0f} "
              f"{r['engine_hit_rate']:>9} {r['seconds']:>6}")
    with open(os.path.join(run.run_dir, "compare.json"), "w") as f:
        json.dump(rows, f, indent=1)
    rr, kp = rows
    run.results.check("compare: every request of both systems succeeded",
                      rr["ok"] == rr["requests"] and kp["ok"] == kp["requests"],
                      f"round-robin {rr['ok']}/{rr['requests']}, kvpick {kp['ok']}/{kp['requests']}")
    run.results.check("compare: kvpick's repeats find more cached tokens than round robin's",
                      kp["repeat_cached_tokens_mean"] > rr["repeat_cached_tokens_mean"],
                      f"{kp['repeat_cached_tokens_mean']} vs {rr['repeat_cached_tokens_mean']}")
    return rows
