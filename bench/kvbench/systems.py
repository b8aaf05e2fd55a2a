"""The systems under test and how each is started in front of a fresh kvpick-sim fleet.

Every system gets the same pods and the same workload; what differs is the router:
- `round-robin`: the shipped Envoy config (deploy/envoy/envoy.yaml) without its ext_proc
  filter, so every request takes the round-robin `inference-pool-fallback` cluster;
- `kvpick-default` / `kvpick-recommended`: the shipped Envoy config with kvpick beside it
  (GIE's default profile, and `--recommended-profile`), fed by the pods' KV events;
- `smg-cache-aware`: PyPI sglang-router's `smg launch --policy cache_aware`;
- `vllm-router-cache-aware` / `vllm-router-kv-aware`: PyPI vllm-router, the latter fed by
  the pods' KV events (block size 16, the model name via --kv-event-model). Its pods publish
  on the empty topic, vLLM's own default (`kv_events_topic` below): vllm-router 0.1.17's
  static `--kv-event-source` subscribes with topic "" and drops every message whose topic
  frame is not exactly "", so on the simulator's default llm-d topic `kv@<ip:port>@<model>`
  its index stayed empty (docs/benchmarks.md, "Side-by-side").
Peers run with their documented defaults for the policy (flags in `SYSTEMS`). A system's
optional `kv_events_topic` is the topic its fleet publishes on (kvpick-sim
--kv-events-topic); without one the simulator's default is used.

kvpick logs at `warn` (its log is in the run's logs/ folder); KVPICK_BENCH_RUST_LOG sets
another filter, e.g. `warn,kvpick::extproc::stream=debug` for every pick.

Router replicas (`ctx.replicas` > 1): N kvpick processes behind the one Envoy (its `kvpick`
ext_proc cluster gets N hosts, round robin, each health-checked); N smg / vllm-router
processes behind an Envoy round-robin front (the same Envoy config as `round-robin`, its pool
being the routers). Each replica sees its share of the traffic only: kvpick replicas share the
pods' KV events (each subscribes to every pod) and exchange their routing records and
in-flight counts (`--replica-exchange-port`, `--replica-peers`), smg / vllm-router replicas
each learn from their own share.
"""

import copy
import os

from .procs import http_get, wait_until


class Fleet:
    """A running kvpick-sim process: its pods' HTTP, KV-event and replay endpoints."""

    def __init__(self, pods, base_port, events_base, replay_base, model):
        self.model = model
        self.http = [f"127.0.0.1:{base_port + i}" for i in range(pods)]
        self.events = [f"tcp://127.0.0.1:{events_base + i}" for i in range(pods)]
        self.replay = [f"tcp://127.0.0.1:{replay_base + i}" for i in range(pods)]

    def urls(self):
        return [f"http://{h}" for h in self.http]


def _one_filter(hcm):
    """The one-filter layout (`--envoy-responses routing`): no `kvpick-observe`, and the routing
    ext_proc filter sends the response too, its body FULL_DUPLEX_STREAMED."""
    hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] != "kvpick-observe"]
    for f in hcm["http_filters"]:
        if f["name"] == "envoy.filters.http.ext_proc":
            mode = f["typed_config"]["processing_mode"]
            mode.update(response_header_mode="SEND", response_body_mode="FULL_DUPLEX_STREAMED",
                        response_trailer_mode="SEND")


def _envoy_config(repo, listen, admin, pods, kvpick=None, responses="observe"):
    """deploy/envoy/envoy.yaml listening on `listen`, its pool clusters being `pods`
    (host:port), with ext_proc to the kvpick replicas `kvpick` ([(grpc, health) ports]) or,
    when None, without ext_proc (plain round robin)."""
    import yaml  # the benchmark venv's PyYAML (an inference-perf dependency)

    with open(os.path.join(repo, "deploy/envoy/envoy.yaml")) as f:
        cfg = yaml.safe_load(f)
    cfg["admin"]["address"]["socket_address"]["port_value"] = admin
    listener = cfg["static_resources"]["listeners"][0]
    listener["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": listen}
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    if kvpick is None:
        # Both of kvpick's ext_proc filters: the routing one and `kvpick-observe`.
        hcm["http_filters"] = [
            f for f in hcm["http_filters"] if not f["typed_config"]["@type"].endswith(".ExternalProcessor")
        ]
    if kvpick is not None and responses == "routing":
        _one_filter(hcm)
    if kvpick is not None and responses == "observe-no-body":
        for f in hcm["http_filters"]:
            if f["name"] == "kvpick-observe":
                f["typed_config"]["processing_mode"]["response_body_mode"] = "NONE"
    endpoints = [
        {"endpoint": {"address": {"socket_address": {"address": h.split(":")[0], "port_value": int(h.split(":")[1])}}}}
        for h in pods
    ]
    for cluster in cfg["static_resources"]["clusters"]:
        if cluster["name"] in ("inference-pool", "inference-pool-fallback"):
            cluster["load_assignment"]["endpoints"] = [{"lb_endpoints": copy.deepcopy(endpoints)}]
        elif cluster["name"] == "kvpick" and kvpick is not None:
            group = cluster["load_assignment"]["endpoints"][0]
            template = group["lb_endpoints"][0]
            group["lb_endpoints"] = []
            for grpc, health in kvpick:
                ep = copy.deepcopy(template)
                ep["endpoint"]["address"]["socket_address"]["port_value"] = grpc
                ep["endpoint"]["health_check_config"]["port_value"] = health
                group["lb_endpoints"].append(ep)
    return cfg


def _start_envoy(ctx, procs, kvpick=None, upstreams=None):
    """Envoy in front of `upstreams` (default: the pods), with ext_proc to `kvpick`."""
    import yaml

    listen, admin = ctx.ports(2)
    cfg = _envoy_config(ctx.repo, listen, admin, upstreams or ctx.fleet.http, kvpick,
                        getattr(ctx, "envoy_responses", "observe"))
    path = os.path.join(ctx.run_dir, "envoy.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    procs.start(
        "envoy",
        [ctx.envoy, "-c", path, "--disable-hot-restart", "--concurrency", "1", "-l", "warning"],
    )
    wait_until("envoy", lambda: http_get(f"http://127.0.0.1:{admin}/ready")[0] == 200, procs)
    for grpc, _ in kvpick or []:
        # Envoy routes through a kvpick once its health check has seen it ready.
        needle = f"kvpick::127.0.0.1:{grpc}::health_flags::healthy"
        wait_until(
            "kvpick healthy in envoy",
            lambda needle=needle: needle in http_get(f"http://127.0.0.1:{admin}/clusters")[1],
            procs,
        )
    return f"http://127.0.0.1:{listen}"


def _replicated(ctx, procs, start_one):
    """One router, or `ctx.replicas` of them behind an Envoy round-robin front."""
    n = getattr(ctx, "replicas", 1)
    if n <= 1:
        return start_one(0)
    urls = [start_one(i) for i in range(n)]
    return _start_envoy(ctx, procs, upstreams=[u.split("://", 1)[1] for u in urls])


def _start_kvpick(ctx, procs, recommended, config_file=None, extra_args=()):
    n = getattr(ctx, "replicas", 1)
    # Active-active replicas tell each other their routing records and in-flight counts
    # through the replica exchange (README, Kubernetes: HA modes), as a deployment would.
    exchange = ctx.ports(n) if n > 1 else []
    replicas = [
        _start_kvpick_process(ctx, procs, recommended, i, config_file, exchange, extra_args) for i in range(n)
    ]
    return _start_envoy(ctx, procs, replicas)


def add_kvpick_config(name, path):
    """Registers `kvpick-NAME`: kvpick with the EndpointPickerConfig at `path` (`--config-file`),
    for A/B runs of scorer parameters against the shipped profiles in one comparison."""
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"--kvpick-config {name}={path}: no such file")
    SYSTEMS[f"kvpick-{name}"] = {
        "start": lambda ctx, procs: _start_kvpick(ctx, procs, recommended=False, config_file=path),
        "flags": f"Envoy + kvpick serve --config-file {os.path.basename(path)} --tokenizer assets/tokenizer, KV events + replay",
    }
    return f"kvpick-{name}"


# Flags the harness sets itself on every kvpick it starts; a variant may not override them.
_HARNESS_FLAGS = (
    "--bind-address", "--endpoints-file", "--grpc-port", "--grpc-health-port", "--metrics-port",
    "--debug-port", "--replica-exchange-port", "--replica-peers",
)


def add_kvpick_flags(name, flags):
    """Registers `kvpick-NAME`: kvpick with these extra `serve` flags (a shell-quoted string,
    e.g. `--recommended-profile --scrape-interval 200ms`), for A/B runs of flags in one
    comparison. The profile is whatever the flags choose (GIE's default without any)."""
    import shlex

    argv = shlex.split(flags)
    if not argv:
        raise ValueError(f"--kvpick-flags {name}=: no flags")
    taken = [a for a in argv if a.split("=", 1)[0] in _HARNESS_FLAGS]
    if taken:
        raise ValueError(f"--kvpick-flags {name}: the harness sets {', '.join(taken)} itself")
    SYSTEMS[f"kvpick-{name}"] = {
        "start": lambda ctx, procs: _start_kvpick(ctx, procs, recommended=False, extra_args=argv),
        "flags": f"Envoy + kvpick serve {flags} --tokenizer assets/tokenizer, KV events + replay",
    }
    return f"kvpick-{name}"


def _start_kvpick_process(ctx, procs, recommended, index, config_file=None, exchange=(), extra_args=()):
    grpc, health, metrics, debug = ctx.ports(4)
    pool = os.path.join(ctx.run_dir, "pool.yaml")
    with open(pool, "w") as f:
        f.write("endpoints:\n")
        for h, ev, rp in zip(ctx.fleet.http, ctx.fleet.events, ctx.fleet.replay):
            f.write(f"  - address: {h}\n    kvEvents: {ev}\n    kvReplay: {rp}\n")
    argv = [
        ctx.kvpick, "serve", "--bind-address", "127.0.0.1", "--endpoints-file", pool,
        "--tokenizer", os.path.join(ctx.repo, "assets/tokenizer"),
        "--grpc-port", str(grpc), "--grpc-health-port", str(health),
        "--metrics-port", str(metrics), "--debug-port", str(debug),
    ]
    if recommended:
        argv.append("--recommended-profile")
    if config_file:
        argv += ["--config-file", config_file]
    argv += list(extra_args)
    if exchange:
        peers = [f"127.0.0.1:{p}" for i, p in enumerate(exchange) if i != index]
        argv += ["--replica-exchange-port", str(exchange[index]), "--replica-peers", ",".join(peers)]
    procs.start("kvpick" if index == 0 else f"kvpick-{index}", argv, env={"RUST_LOG": os.environ.get("KVPICK_BENCH_RUST_LOG", "warn")})

    def subscribed():
        # Every pod's KV-event stream connected before traffic (a PUB drops what is sent
        # before a subscriber joins).
        import json

        pods = json.loads(http_get(f"http://127.0.0.1:{debug}/debug/pods")[1])
        items = pods if isinstance(pods, list) else pods.get("pods", [])
        return len(items) == len(ctx.fleet.http) and all(
            p.get("ready") and (p.get("kv_events") or {}).get("connected") for p in items
        )

    wait_until("kvpick subscribed to every pod", subscribed, procs, timeout=30)
    return grpc, health


def _start_smg(ctx, procs):
    return _replicated(ctx, procs, lambda i: _start_smg_process(ctx, procs, i))


def _start_smg_process(ctx, procs, index):
    (port, prom) = ctx.ports(2)
    argv = [
        os.path.join(ctx.venv_bin, "smg"), "launch", "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *ctx.fleet.urls(), "--policy", "cache_aware",
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom),
        "--log-level", "warn",
    ]
    procs.start("smg" if index == 0 else f"smg-{index}", argv)
    wait_until("smg", lambda: http_get(f"http://127.0.0.1:{port}/health")[0] == 200, procs, timeout=60)
    return f"http://127.0.0.1:{port}"


def _start_vllm_router(ctx, procs, policy):
    return _replicated(ctx, procs, lambda i: _start_vllm_router_process(ctx, procs, policy, i))


def vllm_router_argv(venv_bin, fleet, policy, port, prom, block_size):
    """vllm-router's command line for `policy` in front of `fleet`."""
    argv = [
        os.path.join(venv_bin, "vllm-router"), "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *fleet.urls(), "--policy", policy,
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom),
        "--log-level", "warning",
    ]
    if policy == "kv_aware":
        # One static source per worker (0.1.17 has no topic flag: these subscribe to the
        # empty topic, which the fleet publishes on for this system, see fleet_topic()).
        for url, ev, rp in zip(fleet.urls(), fleet.events, fleet.replay):
            argv += ["--kv-event-source", f"{url}={ev}", "--kv-event-replay-source", f"{url}={rp}"]
        argv += ["--kv-event-block-size", str(block_size), "--kv-event-model", fleet.model]
    return argv


def _start_vllm_router_process(ctx, procs, policy, index):
    (port, prom) = ctx.ports(2)
    argv = vllm_router_argv(ctx.venv_bin, ctx.fleet, policy, port, prom, ctx.block_size)
    # Read after the load (compare.py): kv_aware's index lookups, hit or miss.
    ctx.router_metrics.append(f"http://127.0.0.1:{prom}/metrics")
    procs.start("vllm-router" if index == 0 else f"vllm-router-{index}", argv)
    wait_until("vllm-router", lambda: http_get(f"http://127.0.0.1:{port}/health")[0] == 200, procs, timeout=60)
    return f"http://127.0.0.1:{port}"


SYSTEMS = {
    "round-robin": {
        "start": lambda ctx, procs: _start_envoy(ctx, procs),
        "flags": "Envoy 1.40 (deploy/envoy/envoy.yaml without ext_proc): ROUND_ROBIN over the pods",
    },
    "kvpick-default": {
        "start": lambda ctx, procs: _start_kvpick(ctx, procs, recommended=False),
        "flags": "Envoy + kvpick serve --tokenizer assets/tokenizer (GIE default profile), KV events + replay",
    },
    "kvpick-recommended": {
        "start": lambda ctx, procs: _start_kvpick(ctx, procs, recommended=True),
        "flags": "Envoy + kvpick serve --recommended-profile --tokenizer assets/tokenizer, KV events + replay",
    },
    "smg-cache-aware": {
        "start": _start_smg,
        "flags": "smg launch --policy cache_aware (defaults: cache-threshold 0.3, balance thresholds 64/1.5)",
    },
    "vllm-router-cache-aware": {
        "start": lambda ctx, procs: _start_vllm_router(ctx, procs, "cache_aware"),
        "flags": "vllm-router --policy cache_aware (defaults)",
    },
    "vllm-router-kv-aware": {
        "start": lambda ctx, procs: _start_vllm_router(ctx, procs, "kv_aware"),
        "flags": "vllm-router --policy kv_aware --kv-event-source/--kv-event-replay-source per pod "
        "--kv-event-block-size 16 --kv-event-model sim-model; pods publish on the empty topic "
        "(vLLM's default; kvpick-sim --kv-events-topic '')",
        # vllm-router 0.1.17's static sources only accept the empty topic (vLLM's default).
        "kv_events_topic": "",
    },
}


def fleet_topic(name):
    """The KV-event topic template system `name`'s pods publish on, or None for the
    simulator's default (`kv@<ip:port>@<model>`)."""
    return SYSTEMS[name].get("kv_events_topic")
