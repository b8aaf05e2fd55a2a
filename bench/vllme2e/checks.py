"""The conformance checks. Each records PASS or FAIL through `Results.check` with the figures
it compared, so every one of them can fail and says why."""

import os
import threading
import time

from kvbench.procs import wait_until

from .stack import BLOCK_SIZE, MODEL, cached_tokens, post_json, send
from .text import block_hashes, common_prefix, words

# How long kvpick counts a routed request's blocks as speculatively held (its default
# speculative TTL is 2 s): comparisons of its index with the engines wait this out.
SPECULATION_SECONDS = 2.5


class Results:
    def __init__(self):
        self.rows = []

    def check(self, name, ok, detail=""):
        self.rows.append((name, bool(ok), detail))
        print(f"{'PASS' if ok else 'FAIL'}  {name}" + (f"  ({detail})" if detail else ""), flush=True)
        return ok

    def failed(self):
        return [r for r in self.rows if not r[1]]


def completion(prompt, max_tokens=2, **extra):
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}


def chat(messages, max_tokens=2, **extra):
    return {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}


def engine_ids(engine, path, body):
    """The engine's own /tokenize of a request body."""
    if path == "/v1/completions":
        req = {"model": MODEL, "prompt": body["prompt"]}
    else:
        req = {"model": MODEL, "messages": body["messages"], "add_generation_prompt": True}
        if "tools" in body:
            req["tools"] = body["tools"]
    status, out, _ = post_json(f"{engine.url}/tokenize", req)
    if status != 200:
        raise RuntimeError(f"{engine.name} /tokenize answered {status}: {out}")
    return out["tokens"]


def direct(engine, path, body):
    status, out, _ = post_json(f"{engine.url}{path}", body)
    if status != 200:
        raise RuntimeError(f"{engine.name} {path} answered {status}: {out}")
    return out


def save(run, name, text):
    with open(os.path.join(run.run_dir, name), "w") as f:
        f.write(text)


def settle(run, extra=0.0):
    """Waits until no KV-event batch arrived for 1 s and speculation expired."""
    time.sleep(SPECULATION_SECONDS + extra)
    wait_until("KV events quiet", lambda: run.watcher.quiet_for(1.0), run.procs, timeout=30)


def held(run, engine, hashes):
    return run.watcher.snapshot()[engine.address].held_prefix(hashes)


def view_matches(run, label):
    """kvpick's /debug/pods and /debug/prefix against the blocks each engine announced."""
    settle(run)
    deadline = time.monotonic() + 15
    while True:
        views = run.watcher.snapshot()
        pods = run.kvpick.pods()
        problems = []
        counts = []
        for e in run.engines:
            mine, theirs = len(views[e.address].refs), pods[e.address]["index_blocks"]
            counts.append(f"{e.name}: engine {mine} / kvpick {theirs}")
            if mine != theirs:
                problems.append(f"{e.name} holds {mine} blocks, kvpick counts {theirs}")
        chains = 0
        for e in run.engines:
            for leaf in views[e.address].leaves():
                chain = views[e.address].chain(leaf)
                if chain is None:
                    continue
                hashes, tokens = chain
                chains += 1
                kv = run.kvpick.prefix_tokens(tokens)
                for other in run.engines:
                    want = views[other.address].held_prefix(hashes)
                    if kv.get(other.address) != want:
                        problems.append(f"chain of {len(hashes)} blocks from {e.name}: {other.name} holds "
                                        f"{want}, kvpick says {kv.get(other.address)}")
        if not problems or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    run.results.check(f"kvpick's view equals the engines' KV events ({label})", not problems,
                      "; ".join(counts) + f"; {chains} chains compared"
                      + (": " + "; ".join(problems[:4]) if problems else ""))


def routing(run, kind):
    """Repeats of a long shared prefix go to the pod that holds it, and its hits rise."""
    seed = 100 if kind == "completions" else 200
    prefix = words(seed, 420)
    if kind == "completions":
        path = "/v1/completions"
        bodies = [completion(f"{prefix}\nQuestion {i}: {words(seed + i + 1, 12)}?") for i in range(5)]
    else:
        path = "/v1/chat/completions"
        bodies = [chat([{"role": "system", "content": prefix},
                        {"role": "user", "content": f"Question {i}: {words(seed + i + 1, 12)}?"}])
                  for i in range(5)]
    ids = [engine_ids(run.engines[0], path, b) for b in bodies]
    shared = min(common_prefix(ids[0], x) for x in ids[1:])
    shared_blocks = shared // BLOCK_SIZE
    prefix_hashes = block_hashes(ids[0], BLOCK_SIZE)[:shared_blocks]
    first = send(run.envoy, path, bodies[0])
    holder = next((e for e in run.engines if e.address == first["upstream"]), None)
    if not run.results.check(f"{kind}: first request answered through Envoy and kvpick",
                             first["status"] == 200 and holder is not None,
                             f"status {first['status']}, upstream {first['upstream']!r}"):
        return
    other = next(e for e in run.engines if e is not holder)
    wait_until("the holder's blocks announced",
               lambda: held(run, holder, prefix_hashes) == shared_blocks, run.procs, timeout=20)
    settle(run)
    run.results.check(f"{kind}: the engines' events say {holder.name} holds the {shared_blocks}-block prefix",
                      held(run, holder, prefix_hashes) == shared_blocks and held(run, other, prefix_hashes) == 0,
                      f"{holder.name} {held(run, holder, prefix_hashes)}, {other.name} {held(run, other, prefix_hashes)}")
    hits0 = {e.name: e.hits() for e in run.engines}
    rest = [send(run.envoy, path, b) for b in bodies[1:]]
    hits1 = {e.name: e.hits() for e in run.engines}
    to_holder = sum(r["upstream"] == holder.address and r["status"] == 200 for r in rest)
    run.results.check(f"{kind}: repeats of the shared prefix go to its holder",
                      to_holder == len(rest), f"{to_holder}/{len(rest)} to {holder.name}")
    want = len(rest) * shared_blocks * BLOCK_SIZE
    got = hits1[holder.name] - hits0[holder.name]
    run.results.check(f"{kind}: {holder.name}'s vllm:prefix_cache_hits_total rises by the shared blocks",
                      got >= want and hits1[other.name] == hits0[other.name],
                      f"{holder.name} +{got:.0f} (want >= {want}), {other.name} +{hits1[other.name] - hits0[other.name]:.0f}")
    cached = [cached_tokens(r["body"]) for r in rest]
    run.results.check(f"{kind}: each repeat's usage.cached_tokens covers the shared prefix",
                      all(c is not None and c >= shared_blocks * BLOCK_SIZE for c in cached),
                      f"cached_tokens {cached}, shared {shared_blocks * BLOCK_SIZE}")


TOKENIZE_CASES = [
    ("/v1/completions", completion("The quick brown fox jumps over the lazy dog.")),
    ("/v1/completions", completion("Grüße aus München! 안녕하세요 你好 👨‍👩‍👧‍👦 e\u0301cole\n\n\tcode()  ")),
    ("/v1/completions", completion("text<|endoftext|>more <|im_start|>user\nhi<|im_end|>")),
    ("/v1/chat/completions", chat([{"role": "system", "content": "You are terse."},
                                   {"role": "user", "content": "  What is 2+2?  "}])),
    ("/v1/chat/completions", chat([{"role": "user", "content": "No system message here."}])),
    ("/v1/chat/completions", chat([{"role": "user", "content": [
        {"type": "text", "text": "first part"}, {"type": "text", "text": "second part"}]}])),
    ("/v1/chat/completions", chat(
        [{"role": "system", "content": "Use tools."},
         {"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": None, "tool_calls": [
             {"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
         {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}],
        tools=[{"type": "function", "function": {
            "name": "get_weather", "description": "Current weather.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}}],
        tool_choice="none")),
]


def tokenization(run):
    """kvpick's token ids equal the engine's /tokenize and the ids the engine ran."""
    engine = run.engines[0]
    for i, (path, body) in enumerate(TOKENIZE_CASES):
        ours, _ = run.kvpick.token_ids(path, body)
        theirs = engine_ids(engine, path, body)
        ran = direct(engine, path, {**body, "max_tokens": 1, "return_token_ids": True})
        choice = (ran.get("choices") or [{}])[0]
        ran_ids = ran.get("prompt_token_ids") or choice.get("prompt_token_ids")
        kind = "completion" if path == "/v1/completions" else "chat"
        ok = ours == theirs and (ran_ids is None or ran_ids == theirs)
        first_diff = common_prefix(ours or [], theirs)
        run.results.check(f"tokens: {kind} case {i} equal the engine's /tokenize", ok,
                          f"{len(theirs)} ids" + ("" if ran_ids is None else ", = the ids it ran")
                          + ("" if ok else f"; kvpick {len(ours or [])} ids, first difference at {first_diff}"))


def probe(run):
    """The engine's answers, saved for comparing the simulator's shapes with (probe-*.json)."""
    import json

    from kvbench.procs import http_get

    e = run.engines[0]
    out = {
        "models": json.loads(http_get(f"{e.url}/v1/models")[1]),
        "tokenize_prompt": post_json(f"{e.url}/tokenize", {"model": MODEL, "prompt": "Hello world"})[1],
        "tokenize_chat": post_json(f"{e.url}/tokenize", {"model": MODEL, "add_generation_prompt": True,
                                                          "messages": [{"role": "user", "content": "Hi"}]})[1],
        "completion": direct(e, "/v1/completions", completion("Hello world", max_tokens=2, return_token_ids=True)),
        "chat": direct(e, "/v1/chat/completions", chat([{"role": "user", "content": "Hi"}], max_tokens=2,
                                                        return_token_ids=True)),
        "bad_request": post_json(f"{e.url}/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}),
        "unknown_model": post_json(f"{e.url}/v1/completions", {"model": "nope", "prompt": "x"}),
    }
    with open(os.path.join(run.run_dir, f"probe-{'sim' if e.name.startswith('sim') else 'vllm'}.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)


def reset_announce(run):
    """POST /reset_prefix_cache: when does the engine announce it, and does kvpick follow?
    vLLM queues AllBlocksCleared and publishes it with its next step's batch, so an idle
    engine says nothing until the next request (the simulator must do the same). The batches
    are saved (reset-capture.jsonl) for the simulator's golden test."""
    import json

    b = run.engines[1]
    n0 = len(run.watcher.log)
    status, out, _ = post_json(f"{b.url}/reset_prefix_cache", {})
    if status != 200:
        raise RuntimeError(f"{b.name} /reset_prefix_cache answered {status}: {out}")
    time.sleep(1.5)
    idle = [x for x in run.watcher.log[n0:] if x[0] == b.address]
    run.results.check("reset: an idle engine announces its prefix-cache reset only with its next step",
                      not idle, f"{len(idle)} batches published before the next request")
    prompt = words(800, 100)
    ids = engine_ids(b, "/v1/completions", completion(prompt))
    direct(b, "/v1/completions", completion(prompt, max_tokens=1))
    wait_until("the reset announced", lambda: any(x[0] == b.address for x in run.watcher.log[n0:]),
               run.procs, timeout=10)
    batches = [x for x in run.watcher.log[n0:] if x[0] == b.address]
    types = [e.get("type") for e in batches[0][3]]
    run.results.check("reset: AllBlocksCleared leads the next step's batch, before its stores",
                      types[:1] == ["AllBlocksCleared"] and all(t == "BlockStored" for t in types[1:]),
                      f"first batch after the reset: {types}")
    save(run, "reset-capture.jsonl", "".join(
        json.dumps({"seq": seq, "events": ev, "prompt": prompt, "prompt_token_ids": ids}, default=str) + "\n"
        for _, seq, _, ev in batches))
    view_matches(run, "after a prefix-cache reset")


def eviction(run):
    """After the engine evicts a prefix, kvpick stops sending that prefix to it."""
    a, b = run.engines
    prefix = words(300, 400)
    half = words(300, 200)
    ids = engine_ids(a, "/v1/completions", completion(prefix + "\nQ: x"))
    half_ids = engine_ids(a, "/v1/completions", completion(half))
    hashes = block_hashes(ids, BLOCK_SIZE)
    n_half = min(len(block_hashes(half_ids, BLOCK_SIZE)), common_prefix(ids, half_ids) // BLOCK_SIZE)
    # A holds the whole prefix, B its first half: a kvpick that kept A's entries after the
    # eviction would prefer A (the longer match), the right one prefers B.
    direct(a, "/v1/completions", completion(prefix + "\nQ: warm", max_tokens=1))
    direct(b, "/v1/completions", completion(half, max_tokens=1))
    full = len(hashes) - 1  # the last block of the warm-up prompt differs from the repeats'
    wait_until("A holds the prefix", lambda: held(run, a, hashes) >= full, run.procs, timeout=20)
    settle(run)
    before = run.kvpick.prefix_tokens(ids)
    run.results.check("eviction: before, kvpick sees the whole prefix on A and half on B",
                      before.get(a.address, 0) >= full and before.get(b.address) == n_half,
                      f"kvpick {a.name} {before.get(a.address)}, {b.name} {before.get(b.address)}; want >= {full}, {n_half}")
    floods = 0
    removed_before = sum(1 for p, _, _, ev in run.watcher.log if p == a.address
                         for e in ev if isinstance(e, dict) and e.get("type") == "BlockRemoved")
    while held(run, a, hashes) > 0 and floods < 10:
        direct(a, "/v1/completions", completion(words(400 + floods, 900), max_tokens=1))
        floods += 1
        time.sleep(0.3)
    removed = sum(1 for p, _, _, ev in run.watcher.log if p == a.address
                  for e in ev if isinstance(e, dict) and e.get("type") == "BlockRemoved") - removed_before
    run.results.check("eviction: the engine evicted the prefix (BlockRemoved events)",
                      held(run, a, hashes) == 0, f"{floods} flood prompts, {removed} BlockRemoved events")
    settle(run)
    after = run.kvpick.prefix_tokens(ids)
    run.results.check("eviction: kvpick's view of A lost the prefix, B's kept its half",
                      after.get(a.address) == 0 and after.get(b.address) == n_half,
                      f"kvpick {a.name} {after.get(a.address)}, {b.name} {after.get(b.address)}")
    rs = [send(run.envoy, "/v1/completions", completion(f"{prefix}\nQ: after {i}")) for i in range(4)]
    to_b = sum(r["status"] == 200 and r["upstream"] == b.address for r in rs)
    run.results.check("eviction: the evicted prefix goes to the pod that still holds part of it",
                      to_b == len(rs), f"{to_b}/{len(rs)} to {b.name}, upstreams {[r['upstream'] for r in rs]}")


class Load(threading.Thread):
    """Sequential requests through Envoy until stopped, each recorded with its start time."""

    def __init__(self, run, seed):
        super().__init__(daemon=True)
        self.run_, self.seed = run, seed
        self.stop = threading.Event()
        self.records = []

    def run(self):
        i = 0
        while not self.stop.is_set():
            body = completion(f"{words(self.seed + i % 6, 120)}\nQ: load {i}", max_tokens=2)
            t0 = time.monotonic()
            try:
                r = send(self.run_.envoy, "/v1/completions", body, timeout=60)
            except Exception as e:  # noqa: BLE001 - a lost request is what is being measured
                r = {"status": None, "upstream": "", "error": repr(e)}
            r["start"], r["end"] = t0, time.monotonic()
            r.pop("body", None)
            self.records.append(r)
            i += 1
            # A steady trickle, not a flood: it must not starve the restarting engine of CPU.
            self.stop.wait(0.2)


def restart(run):
    """Killing an engine: kvpick serves through the other, clears the dead one's entries, and
    takes it back after its restart; every request gets an answer."""
    a, b = run.engines
    prefix = words(500, 300)
    ids = engine_ids(a, "/v1/completions", completion(prefix + "\nQ: x"))
    hashes = block_hashes(ids, BLOCK_SIZE)
    half_ids = engine_ids(a, "/v1/completions", completion(words(500, 150)))
    n_half = common_prefix(ids, half_ids) // BLOCK_SIZE
    direct(a, "/v1/completions", completion(prefix + "\nQ: warm", max_tokens=1))
    direct(b, "/v1/completions", completion(words(500, 150), max_tokens=1))
    wait_until("A holds the prefix", lambda: held(run, a, hashes) >= len(hashes) - 1, run.procs, timeout=20)
    load = Load(run, 600)
    load.start()
    try:
        time.sleep(3)
        clears_before = run.kvpick.pods()[a.address]["kv_events"]["clears"]
        save(run, "metrics-before-kill.txt", a.metrics())
        t_kill = time.monotonic()
        a.kill(run.procs)
        run.watcher.forget(a.address)
        down_at = None
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and down_at is None:
            if run.kvpick.pods()[a.address]["down"]:
                down_at = time.monotonic()
            time.sleep(0.05)
        p = run.kvpick.pods()[a.address]
        run.results.check("restart: kvpick marks the killed engine down (out of the candidates)",
                          down_at is not None,
                          f"down after {None if down_at is None else round(down_at - t_kill, 2)} s "
                          f"({p.get('down_reason')}); entries kept while down: {p['index_blocks']}")
        time.sleep(2)
        t_restart = time.monotonic()
        a.start(run.procs)
        # The engine is back at /health before kvpick reads its new process_start_time_seconds
        # and its seq restarting at 0: from the first answer on, kvpick must hold nothing of the
        # dead process's cache.
        cleared_at = None
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            run.procs.check_alive()
            if cleared_at is None and run.kvpick.pods()[a.address]["index_blocks"] == 0:
                cleared_at = time.monotonic()
            if a.healthy():
                break
            time.sleep(0.5)
        else:
            raise TimeoutError(f"{a.name} not healthy within 300 s of its restart")
        t_healthy = time.monotonic()
        save(run, "metrics-after-restart.txt", a.metrics())
        wait_until("kvpick takes the engine back",
                   lambda: (lambda p: p["ready"] and not p["down"] and (p["kv_events"] or {}).get("connected"))(
                       run.kvpick.pods()[a.address]), run.procs, timeout=60)
        t_back = time.monotonic()
        time.sleep(2)
    finally:
        load.stop.set()
        load.join(timeout=120)
    recs = load.records
    down_at = down_at or t_kill
    unanswered = [r for r in recs if r["status"] is None]
    # Sent before kvpick could know (kill → marked down): they may have reached the dying
    # engine, whose sockets still accept for a moment; Envoy does not retry a request the
    # engine may have started (deploy/envoy/envoy.yaml), so these can fail with 503.
    window = [r for r in recs if r["start"] < down_at and r["end"] > t_kill]
    after = [r for r in recs if r["start"] >= down_at]
    bad_after = [r for r in after if r["status"] != 200]
    down = [r for r in recs if r["start"] >= down_at and r["end"] <= t_healthy]
    # Picked for an engine that did not answer (Envoy retried them on the fallback).
    retried = [r for r in after if r.get("attempts") not in ("", "1")]
    run.results.check("restart: every request through Envoy got an answer", not unanswered and recs,
                      f"{len(recs)} requests, {len(unanswered)} unanswered; in the {down_at - t_kill:.2f} s "
                      f"before kvpick noticed: {[(r['status'], r['upstream']) for r in window]}")
    run.results.check("restart: every request sent after kvpick marked the engine down succeeded",
                      not bad_after and after,
                      f"{len(after)} requests, {len(bad_after)} not 200 {[r['status'] for r in bad_after][:5]}")
    run.results.check("restart: until it answered again, the other engine served everything",
                      down and all(r["upstream"] == b.address for r in down),
                      f"{len(down)} requests, upstreams {sorted({r['upstream'] for r in down})}")
    print(f"INFO  restart: {len(retried)} requests after the kill were picked for an engine that did not "
          f"answer and retried by Envoy on the fallback (kvpick counts a pod up again as soon as its "
          f"KV-event stream reconnects; vLLM binds that before its HTTP server)", flush=True)
    run.info["restart_retried_on_fallback"] = len(retried)
    run.info["restart_window_failures"] = sum(r["status"] != 200 for r in window)
    settle(run)
    p = run.kvpick.pods()[a.address]
    engine_now = len(run.watcher.snapshot()[a.address].refs)
    run.results.check("restart: kvpick cleared the restarted engine's entries",
                      p["index_blocks"] == engine_now and p["kv_events"]["clears"] > clears_before,
                      f"kvpick {p['index_blocks']} entries, the engine announced {engine_now} since; clears "
                      f"{clears_before} -> {p['kv_events']['clears']}; entries were 0 "
                      f"{'before' if cleared_at is not None and cleared_at < t_healthy else 'only after'} /health answered")
    # B's half may have been evicted by the load it served alone: announce it again (a
    # kvpick that kept the dead engine's entries would still prefer A, with the whole prefix).
    direct(b, "/v1/completions", completion(words(500, 150), max_tokens=1))
    settle(run)
    now = run.kvpick.prefix_tokens(ids)
    run.results.check("restart: kvpick holds nothing stale for the restarted engine",
                      now.get(a.address) == 0 and now.get(b.address) == n_half,
                      f"kvpick {a.name} {now.get(a.address)}, {b.name} {now.get(b.address)} (want 0, {n_half})")
    r = send(run.envoy, "/v1/completions", completion(f"{prefix}\nQ: after restart"))
    run.results.check("restart: the prefix the dead engine held now goes to the live holder",
                      r["status"] == 200 and r["upstream"] == b.address, f"upstream {r['upstream']}")
    served_a = 0
    for i in range(12):
        r = send(run.envoy, "/v1/completions", completion(f"{words(700 + i, 80)}\nQ: fresh {i}"))
        served_a += r["upstream"] == a.address
        if served_a:
            break
    run.results.check("restart: the restarted engine serves again", served_a > 0,
                      f"restart to healthy {t_healthy - t_restart:.0f} s, to kvpick ready {t_back - t_healthy:.1f} s")
