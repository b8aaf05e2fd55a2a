"""What one /metrics scrape costs a vLLM API server, whole page against by name.

vLLM renders its exposition with prometheus_client on the API server's event loop. kvpick
asks for the metrics it reads by name (`/metrics/?name[]=…`, src/scrape/by_name.rs), which
prometheus_client's restricted registry answers by collecting and rendering only the
collectors that own those names. This prices both renders with the families of a real vLLM
0.32 page (../shared/fixtures/vllm-0.32-kv-events/metrics-load.txt; each family its own
collector, as vLLM registers its metrics, and a live process collector) and, when fastapi and
prometheus-fastapi-instrumentator are installed, checks vLLM's routing: the instrumentator's
`/metrics` route ignores the query, the prometheus_client app mounted behind `/metrics/`
answers by name (vllm/entrypoints/serve/instrumentator/metrics.py).

Run: .venv-bench/bin/python bench/vllm_metrics_cost.py  (prometheus_client from PyPI)
"""

import os
import re
import sys
import time

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "..", "..", "shared", "fixtures", "vllm-0.32-kv-events", "metrics-load.txt")
# EngineKind::Vllm.read_names() (src/scrape/engine.rs).
NAMES = [
    "vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc", "process_start_time_seconds", "vllm:cache_config_info",
    "vllm:lora_requests_info",
]


class Family(Collector):
    """One family of the real page, as its own collector."""

    def __init__(self, family):
        self.family = family

    def collect(self):
        return [self.family]

    def describe(self):
        return [self.family]


def registry_of(text):
    registry = CollectorRegistry(auto_describe=True)
    for family in text_string_to_metric_families(text):
        if family.name.startswith("process_"):
            continue  # a live process collector below, as vLLM's default registry has
        try:
            registry.register(Family(family))
        except ValueError:
            pass  # a `_created` series the parser also gave as its own family
    # Reads /proc on every collect (the whole page and by name both ask for its start time).
    ProcessCollector(registry=registry)
    return registry


def cpu_per_render(render, n=500):
    start = time.process_time()
    for _ in range(n):
        render()
    return (time.process_time() - start) / n


def check_routing(registry):
    try:
        from fastapi import FastAPI
        from fastapi.testclient import TestClient
        from prometheus_client import make_asgi_app
        from prometheus_fastapi_instrumentator import Instrumentator
        from starlette.routing import Mount
    except ImportError as missing:
        print(f"routing: not checked ({missing.name} not installed)")
        return
    app = FastAPI()
    # As vLLM's attach_router does.
    Instrumentator(excluded_handlers=["/metrics"], registry=registry).add().instrument(app).expose(app)
    route = Mount("/metrics", make_asgi_app(registry=registry))
    route.path_regex = re.compile("^/metrics(?P<path>.*)$")
    app.routes.append(route)
    client = TestClient(app)
    query = "&".join(f"name%5B%5D={n.replace(':', '%3A')}" for n in NAMES)
    whole = client.get(f"/metrics?{query}")
    named = client.get(f"/metrics/?{query}")
    families = sorted(set(re.findall(r"^# TYPE (\S+)", named.text, re.M)))
    print(f"routing: /metrics?name[]=… {whole.status_code}, {len(whole.content)} bytes (the whole page); "
          f"/metrics/?name[]=… {named.status_code}, {len(named.content)} bytes: {', '.join(families)}")
    assert named.status_code == 200 and "vllm:num_requests_waiting" in families, named.text


def main():
    registry = registry_of(open(FIXTURE).read())
    whole = generate_latest(registry)
    named = generate_latest(registry.restricted_registry(NAMES))
    print(f"page: whole {len(whole)} bytes, by name {len(named)} bytes")
    for label, render in (("whole", lambda: generate_latest(registry)),
                          ("by name", lambda: generate_latest(registry.restricted_registry(NAMES)))):
        print(f"{label}: {cpu_per_render(render) * 1e6:.0f} µs of CPU per render")
    check_routing(registry)


if __name__ == "__main__":
    sys.exit(main())
