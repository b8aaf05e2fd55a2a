"""Statistics over inference-perf's reports and the pods' own counters.

Everything here is pure (no I/O beyond what it is handed), so bench/test_kvbench.py checks
it on known inputs.
"""

import math


def percentile(values, q):
    """The q-th percentile (0..100) with linear interpolation (numpy's default), or None."""
    xs = sorted(v for v in values if v is not None and not math.isnan(v))
    if not xs:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} outside 0..100")
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def mean(values):
    xs = [v for v in values if v is not None]
    return sum(xs) / len(xs) if xs else None


def cdf(values):
    """(sorted values, cumulative fraction at each) for plotting a step CDF."""
    xs = sorted(v for v in values if v is not None)
    n = len(xs)
    return xs, [(i + 1) / n for i in range(n)]


def parse_prometheus(text):
    """{(name, frozenset(labels)): value} from Prometheus text exposition; bad lines skipped."""
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            head, value = line.rsplit(" ", 1)
            val = float(value)
        except ValueError:
            continue
        labels = frozenset()
        name = head
        if "{" in head and head.endswith("}"):
            name, rest = head.split("{", 1)
            pairs = []
            for part in rest[:-1].split(","):
                if "=" in part:
                    k, v = part.split("=", 1)
                    pairs.append((k.strip(), v.strip().strip('"')))
            labels = frozenset(pairs)
        out[(name, labels)] = val
    return out


def metric_sum(parsed, name):
    """Sum of every series of `name`."""
    return sum(v for (n, _), v in parsed.items() if n == name)


def pod_counters(metrics_text):
    """The engine-side counters of one pod's /metrics."""
    parsed = parse_prometheus(metrics_text)
    return {
        "prefix_hits": metric_sum(parsed, "vllm:prefix_cache_hits_total"),
        "prefix_queries": metric_sum(parsed, "vllm:prefix_cache_queries_total"),
        # vLLM observes e2e latency once per finished request.
        "finished": metric_sum(parsed, "vllm:e2e_request_latency_seconds_count"),
        "preemptions": metric_sum(parsed, "vllm:num_preemptions_total"),
        # Gauges (meaningless in a delta; the pods' time series reads them).
        "waiting": metric_sum(parsed, "vllm:num_requests_waiting"),
        "running": metric_sum(parsed, "vllm:num_requests_running"),
    }


def kv_lookups(metrics_text):
    """vllm-router's KV-index lookups by result ({"hit": n, "miss": n, ...}) from its /metrics
    (`vllm_router_kv_placement_lookups_total`); empty when it made none."""
    out = {}
    for (name, labels), value in parse_prometheus(metrics_text).items():
        if name == "vllm_router_kv_placement_lookups_total":
            result = dict(labels).get("result", "")
            out[result] = out.get(result, 0) + int(value)
    return out


def fleet_summary(per_pod):
    """Hit rate over the fleet (Σ hits / Σ queries) and the load balance of finished requests."""
    hits = sum(p["prefix_hits"] for p in per_pod)
    queries = sum(p["prefix_queries"] for p in per_pod)
    finished = [int(p["finished"]) for p in per_pod]
    total = sum(finished)
    return {
        "engine_hit_rate": hits / queries if queries else None,
        "prefix_hits": hits,
        "prefix_queries": queries,
        "requests_per_pod": finished,
        # max/mean: 1.0 is perfectly even, pods × 1.0 is everything on one pod.
        "load_imbalance": (max(finished) / (total / len(finished))) if total else None,
        "preemptions": sum(p["preemptions"] for p in per_pod),
    }


def prefix_key(workload_kind):
    """The request-log field that names a request's prefix: its conversation in multi-turn
    runs (their short shared preamble would make them all one), its group's first block
    otherwise."""
    return "head_long" if workload_kind == "multi-turn" else "head"


def is_full_prefill(record):
    """Whether a request found less than half its prompt cached (a request-log dict)."""
    return record["cached_tokens"] * 2 < record["prompt_tokens"]


def placement_summary(records, key="head"):
    """Where each prefix went, from kvpick-sim's --request-log lines (dicts), in arrival order.

    `key` names the prefix: "head" (the first block: a shared-prefix group) or "head_long"
    (the first 256 tokens: a conversation behind a short shared preamble).
    - copies_per_prefix: distinct pods that served each prefix seen at least twice, averaged;
      1.0 is every prefix on one pod, more is copies (each a prefill and the cache it takes).
    - prefix_moves: requests served on another pod than their prefix's previous request.
    - repeat_misses: requests whose prefix was served before, that still found less than half
      of their prompt cached (a prefix that was evicted, or sent where it was not held).
    - behind_prefill: requests that arrived at a pod where another request had not reached its
      first token yet (they queued behind a prefill); behind_prefill_avoidable: of those, the
      ones that arrived while some pod of the run had no request before its first token
      (a placement that queued where it need not have).
    - piled: requests that reached a pod within PILE_WINDOW_S of two earlier ones to the same
      pod (the third and later of a burst sent to one pod: picks that did not see each
      other, docs/benchmarks.md session 35).
    """
    records = sorted(records, key=lambda r: r["arrived"])
    pods, last, moves, repeat_misses, repeats = {}, {}, 0, 0, 0
    for r in records:
        prefix = r[key]
        if prefix in last:
            repeats += 1
            if last[prefix] != r["pod"]:
                moves += 1
            if is_full_prefill(r):
                repeat_misses += 1
        last[prefix] = r["pod"]
        pods.setdefault(prefix, set()).add(r["pod"])
    behind, avoidable = _behind_prefill(records)
    counts = {p: 0 for p in pods}
    for r in records:
        counts[r[key]] += 1
    shared = [len(pods[p]) for p in pods if counts[p] >= 2]
    return {
        "prefixes": len(pods),
        "copies_per_prefix": sum(shared) / len(shared) if shared else None,
        "prefix_moves": moves,
        "repeat_requests": repeats,
        "repeat_misses": repeat_misses,
        "behind_prefill": behind,
        "behind_prefill_avoidable": avoidable,
        "piled": _piled(records),
    }


# A burst's requests arrive within a few milliseconds (inference-perf releases the sends it
# fell behind on together); 20 ms is shorter than any prefill here.
PILE_WINDOW_S = 0.02


def _piled(records):
    """Requests (sorted by arrival) that reached a pod within PILE_WINDOW_S of two earlier
    ones to the same pod."""
    recent = {}  # pod -> its last two arrivals
    piled = 0
    for r in records:
        last = recent.setdefault(r["pod"], [])
        if len(last) == 2 and r["arrived"] - last[0] <= PILE_WINDOW_S:
            piled += 1
        recent[r["pod"]] = (last + [r["arrived"]])[-2:]
    return piled


def _behind_prefill(records):
    """(requests queued behind another's prefill on their pod, of which avoidable), over
    records sorted by arrival; records without `first_token_s` (failed) count as done."""
    fleet = {r["pod"] for r in records}
    pending = {}  # pod -> first-token instants of its requests still prefilling
    behind = avoidable = 0
    for r in records:
        at = r["arrived"]
        for pod in pending:
            pending[pod] = [t for t in pending[pod] if t > at]
        if pending.get(r["pod"]):
            behind += 1
            if any(not pending.get(pod) for pod in fleet):
                avoidable += 1
        ttft = r.get("first_token_s")
        if ttft is not None:
            pending.setdefault(r["pod"], []).append(at + ttft)
    return behind, avoidable


def stage_pod_times(records, stage_counts):
    """Per stage, from kvpick-sim's --request-log lines: the pods' own time to first token
    (arrival at the pod to first token: the router's path and the client excluded) and the
    floor, the least TTFT any router could have given each request (kvpick-sim's `floor_s`:
    every block seen before still cached, an idle pod of the fastest speed).

    Stages run one after the other, so the records sorted by arrival split by the stages'
    request counts, as `split_by_stage` splits inference-perf's entries. When the log does
    not hold exactly one line per request (a failed request never reached its first token),
    that split would mix stages: every stage is None then. A stage's floor figures are None
    when a line has no floor (an older simulator, or its seen set was full).
    """
    if sum(stage_counts) != len(records):
        return [None for _ in stage_counts]
    ordered = sorted(records, key=lambda r: r["arrived"])
    out, i = [], 0
    for n in stage_counts:
        stage = ordered[i : i + n]
        i += n
        pod = [r["first_token_s"] for r in stage]
        floors = [r.get("floor_s") for r in stage]
        known = bool(floors) and all(f is not None for f in floors)
        out.append({
            "pod_ttft_mean": mean(pod),
            "pod_ttft_p90": percentile(pod, 90),
            "floor_mean": mean(floors) if known else None,
            "floor_p90": percentile(floors, 90) if known else None,
        })
    return out


def counters_delta(after, before):
    """Per-pod counters accumulated between two scrapes."""
    return [{k: a[k] - b.get(k, 0.0) for k in a} for a, b in zip(after, before)]


def request_ttft(entry):
    """TTFT of one inference-perf per-request entry: first output token time − start."""
    info = entry.get("info") or {}
    times = (info.get("response_metrics") or {}).get("output_token_times") or []
    start = entry.get("start_time")
    if not times or start is None:
        return None
    return times[0] - start


def request_cached_tokens(entry):
    """(prompt tokens, cached tokens) the server reported in the response's usage."""
    usage = ((entry.get("info") or {}).get("response_metrics") or {}).get("server_usage") or {}
    prompt = usage.get("prompt_tokens") or 0
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return prompt, cached


def split_by_stage(entries, stage_counts):
    """Per-request entries split into stages.

    inference-perf's per-request report does not name the stage; stages run one after the
    other (each finishes before the next starts sending), so sorted by send time the first
    `stage_counts[0]` entries are stage 0, and so on.
    """
    ordered = sorted(entries, key=lambda e: e.get("start_time") or 0.0)
    out, i = [], 0
    for n in stage_counts:
        out.append(ordered[i : i + n])
        i += n
    return out


def _lat(stage, key, stat):
    value = (((stage.get("successes") or {}).get("latency") or {}).get(key) or {}).get(stat)
    return value


def stage_row(system, rate, stage, requests):
    """One CSV row: a system at one rate, from its stage report and per-request entries."""
    successes = (stage.get("successes") or {}).get("count") or 0
    failures = (stage.get("failures") or {}).get("count") or 0
    throughput = (stage.get("successes") or {}).get("throughput") or {}
    ttfts = [t for t in (request_ttft(e) for e in requests) if t is not None]
    prompt = sum(request_cached_tokens(e)[0] for e in requests)
    cached = sum(request_cached_tokens(e)[1] for e in requests)
    load = stage.get("load_summary") or {}
    return {
        "system": system,
        "rate": rate,
        "achieved_rate": load.get("achieved_rate"),
        "requests": successes + failures,
        "failures": failures,
        "ttft_mean": _lat(stage, "time_to_first_token", "mean"),
        "ttft_p50": _lat(stage, "time_to_first_token", "median"),
        "ttft_p90": _lat(stage, "time_to_first_token", "p90"),
        "ttft_p99": _lat(stage, "time_to_first_token", "p99"),
        "itl_mean": _lat(stage, "inter_token_latency", "mean"),
        "itl_p90": _lat(stage, "inter_token_latency", "p90"),
        "e2e_mean": _lat(stage, "request_latency", "mean"),
        "e2e_p90": _lat(stage, "request_latency", "p90"),
        "output_tok_s": throughput.get("output_tokens_per_sec"),
        "requests_per_s": throughput.get("requests_per_sec"),
        "response_hit_rate": cached / prompt if prompt else None,
        "ttft_per_request": ttfts,
    }
