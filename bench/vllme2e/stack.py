"""Starting the stack on free loopback ports: the tiny model, two vLLM CPU engines with prefix
caching and KV events (PUB + replay), kvpick with a static endpoints file naming both, and
Envoy twice from deploy/envoy/envoy.yaml (with kvpick's ext_proc, and without it: the
round-robin baseline). Every process is started through kvbench's Procs (own session, log
file, stopped by PID)."""

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request

import yaml

from kvbench.procs import free_ports, http_get, wait_until

MODEL = "tiny"
BLOCK_SIZE = 32
UPSTREAM_HEADER = "x-e2e-upstream-host"
ATTEMPTS_HEADER = "x-e2e-upstream-attempts"


def build_model(tokenizer_dir, out_dir, python):
    """The tiny random-weight Llama of ../shared/fixtures (build_model.py's recipe: vocab of
    the tokenizer rounded up to 64, hidden 128, 2 layers, 4 heads of head_dim 32 — the CPU
    minimum — bf16, seed 0), built offline with transformers. Reused when present."""
    done = os.path.join(out_dir, "model.safetensors")
    if os.path.exists(done):
        return
    script = r'''
import os, shutil, sys
os.environ["HF_HUB_OFFLINE"] = "1"; os.environ["TRANSFORMERS_OFFLINE"] = "1"
import torch
from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM
tok_dir, out = sys.argv[1], sys.argv[2]
tmp = out + ".tmp"
shutil.rmtree(tmp, ignore_errors=True); os.makedirs(tmp)
tok = AutoTokenizer.from_pretrained(tok_dir)
vocab = (len(tok) + 63) // 64 * 64
eot, im_end = tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|im_end|>")
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096,
                  rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True,
                  bos_token_id=eot, eos_token_id=im_end, pad_token_id=eot, torch_dtype="bfloat16")
LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
GenerationConfig(bos_token_id=eot, eos_token_id=[im_end, eot], pad_token_id=eot).save_pretrained(tmp)
for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    if os.path.exists(os.path.join(tok_dir, f)):
        shutil.copy(os.path.join(tok_dir, f), os.path.join(tmp, f))
shutil.rmtree(out, ignore_errors=True); os.rename(tmp, out)
print("model", out, "vocab", vocab)
'''
    subprocess.run([python, "-c", script, tokenizer_dir, out_dir], check=True)


def post_json(url, body, timeout=120.0, headers=None):
    """(status, parsed body or text, response headers); HTTP errors are answers, not raises."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST",
                                 headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw, status, hdrs = r.read(), r.status, dict(r.headers)
    except urllib.error.HTTPError as e:
        raw, status, hdrs = e.read(), e.code, dict(e.headers)
    text = raw.decode("utf-8", "replace")
    try:
        return status, json.loads(text), {k.lower(): v for k, v in hdrs.items()}
    except ValueError:
        return status, text, {k.lower(): v for k, v in hdrs.items()}


def metric_sum(text, name):
    """Sum of every sample of `name` in a Prometheus text page."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


class Engine:
    """One vLLM engine: its ports and how to (re)start and kill it."""

    def __init__(self, name, args, cpu=None):
        self.name = name
        self.cpu = cpu
        self.args = args
        self.port, self.zpub, self.zreplay = free_ports(3)
        self.address = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.address}"
        self.events = f"tcp://127.0.0.1:{self.zpub}"
        self.replay = f"tcp://127.0.0.1:{self.zreplay}"
        self.child = None
        self.starts = 0

    def argv(self):
        kv = {
            "enable_kv_cache_events": True, "publisher": "zmq",
            "endpoint": f"tcp://*:{self.zpub}", "replay_endpoint": f"tcp://*:{self.zreplay}",
            "topic": f"kv@{self.address}@{MODEL}",
        }
        a = self.args
        return [
            a.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", a.model_dir, "--served-model-name", MODEL,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--block-size", str(BLOCK_SIZE), "--enable-prefix-caching",
            "--prefix-caching-hash-algo", "sha256",
            "--num-gpu-blocks-override", str(a.num_blocks),
            "--max-model-len", str(a.max_model_len), "--max-num-seqs", "8", "--seed", "0",
            "--enable-prompt-tokens-details",
            "--kv-events-config", json.dumps(kv),
        ]

    def start(self, procs):
        env = {
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
            # POST /reset_prefix_cache (the comparison starts each system on cold caches).
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_CACHE_ROOT": os.path.join(self.args.cache, "vllm-cache"),
        }
        if self.cpu is not None:
            # NOTE: left to "auto", every engine binds its OpenMP threads to the same first
            # core; one core each keeps two engines (and a restart under load) from
            # starving each other on a small machine.
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(self.cpu)
        self.starts += 1
        self.child = procs.start(f"{self.name}-{self.starts}", self.argv(), env=env)

    def healthy(self):
        try:
            return http_get(f"{self.url}/health")[0] == 200
        except Exception:  # noqa: BLE001 - not up yet
            return False

    def kill(self, procs):
        """SIGKILL the engine's whole process group (API server and engine core)."""
        os.killpg(self.child.pid, signal.SIGKILL)
        self.child.wait()
        procs.forget(self.child)

    def metrics(self):
        return http_get(f"{self.url}/metrics")[1]

    def hits(self):
        return metric_sum(self.metrics(), "vllm:prefix_cache_hits_total")

    def queries(self):
        return metric_sum(self.metrics(), "vllm:prefix_cache_queries_total")


class SimEngine(Engine):
    """kvpick-sim standing in for one engine (one pod per process, so one can be killed), with
    the real engine's settings: the same checks then show where the simulator differs."""

    def argv(self):
        a = self.args
        return [
            a.sim_bin, "--pods", "1", "--base-port", str(self.port),
            "--events-base-port", str(self.zpub), "--replay-base-port", str(self.zreplay),
            "--model", MODEL, "--block-size", str(BLOCK_SIZE), "--num-gpu-blocks", str(a.num_blocks),
            "--max-num-seqs", "8", "--max-model-len", str(a.max_model_len),
            "--prefix-caching-hash-algo", "sha256", "--tokenizer", a.tokenizer, "--time-scale", "0.1",
        ]

    def start(self, procs):
        self.starts += 1
        self.child = procs.start(f"{self.name}-{self.starts}", self.argv(), env={"RUST_LOG": "warn"})


def wait_engines(engines, procs, timeout=300):
    for e in engines:
        wait_until(f"vLLM {e.name} /health", e.healthy, procs, timeout=timeout, interval=1.0)


class Kvpick:
    def __init__(self, args, engines, run_dir):
        self.args = args
        self.grpc, self.health, self.metrics_port, self.debug = free_ports(4)
        self.pool = os.path.join(run_dir, "pool.yaml")
        with open(self.pool, "w") as f:
            f.write("endpoints:\n")
            for e in engines:
                f.write(f"  - address: {e.address}\n    kvEvents: {e.events}\n"
                        f"    kvReplay: {e.replay}\n"
                        "    labels: { inference.networking.k8s.io/engine-type: vllm }\n")

    def start(self, procs):
        argv = [
            self.args.kvpick, "serve", "--bind-address", "127.0.0.1", "--endpoints-file", self.pool,
            "--tokenizer", f"{MODEL}={self.args.tokenizer}",
            "--grpc-port", str(self.grpc), "--grpc-health-port", str(self.health),
            "--metrics-port", str(self.metrics_port), "--debug-port", str(self.debug),
        ]
        procs.start("kvpick", argv, env={"RUST_LOG": "kvpick=info,warn"})
        wait_until("kvpick /debug/pods", lambda: http_get(self.url("/debug/pods"))[0] == 200, procs)

    def url(self, path):
        return f"http://127.0.0.1:{self.debug}{path}"

    def pods(self):
        return {p["address"]: p for p in json.loads(http_get(self.url("/debug/pods"))[1])["pods"]}

    def prefix_tokens(self, token_ids):
        status, body, _ = post_json(self.url("/debug/prefix"), {"model": MODEL, "token_ids": token_ids})
        if status != 200:
            raise RuntimeError(f"/debug/prefix answered {status}: {body}")
        return {p["address"]: p["matched_blocks"] for p in body["pods"]}

    def token_ids(self, path, body):
        status, out, _ = post_json(self.url(f"/debug/prefix?tokens=1&path={path}"), body)
        if status != 200:
            raise RuntimeError(f"/debug/prefix answered {status}: {out}")
        return out.get("token_ids"), {p["address"]: p["matched_blocks"] for p in out["pods"]}

    def metrics(self):
        return http_get(f"http://127.0.0.1:{self.metrics_port}/metrics")[1]


class Envoy:
    """The shipped Envoy config on free ports; `kvpick=None` drops its ext_proc filter (then
    every request takes the round-robin fallback cluster). Responses carry the upstream host
    that served and the number of upstream attempts."""

    def __init__(self, args, engines, run_dir, kvpick, name):
        self.args, self.name = args, name
        self.port, self.admin = free_ports(2)
        with open(os.path.join(args.repo, "deploy/envoy/envoy.yaml")) as f:
            cfg = yaml.safe_load(f)
        cfg["admin"]["address"]["socket_address"]["port_value"] = self.admin
        listener = cfg["static_resources"]["listeners"][0]
        listener["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": self.port}
        hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
        if kvpick is None:
            # Both of kvpick's ext_proc filters: the routing one and `kvpick-observe`.
            hcm["http_filters"] = [
                f for f in hcm["http_filters"] if not f["typed_config"]["@type"].endswith(".ExternalProcessor")
            ]
        vhost = hcm["route_config"]["virtual_hosts"][0]
        vhost["response_headers_to_add"] = [
            {"header": {"key": UPSTREAM_HEADER, "value": "%UPSTREAM_HOST%"}},
            {"header": {"key": ATTEMPTS_HEADER, "value": "%UPSTREAM_REQUEST_ATTEMPT_COUNT%"}},
        ]
        eps = [{"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": e.port}}}}
               for e in engines]
        for c in cfg["static_resources"]["clusters"]:
            if c["name"] in ("inference-pool", "inference-pool-fallback"):
                c["load_assignment"]["endpoints"] = [{"lb_endpoints": [dict(x) for x in eps]}]
            elif c["name"] == "kvpick" and kvpick is not None:
                ep = c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
                ep["address"]["socket_address"]["port_value"] = kvpick.grpc
                ep["health_check_config"]["port_value"] = kvpick.health
        self.kvpick = kvpick
        self.config = os.path.join(run_dir, f"{name}.yaml")
        with open(self.config, "w") as f:
            yaml.safe_dump(cfg, f)

    def start(self, procs):
        procs.start(self.name, [self.args.envoy, "-c", self.config, "--disable-hot-restart",
                                "--concurrency", "1", "-l", "warning"])
        wait_until(f"{self.name} ready", lambda: http_get(f"http://127.0.0.1:{self.admin}/ready")[0] == 200, procs)
        if self.kvpick is not None:
            needle = f"kvpick::127.0.0.1:{self.kvpick.grpc}::health_flags::healthy"
            wait_until("kvpick healthy in Envoy",
                       lambda: needle in http_get(f"http://127.0.0.1:{self.admin}/clusters")[1], procs)

    def url(self, path):
        return f"http://127.0.0.1:{self.port}{path}"


def send(envoy, path, body, timeout=120.0):
    """One request through Envoy: (status, body, upstream host that served, attempts)."""
    t0 = time.monotonic()
    status, out, headers = post_json(envoy.url(path), body, timeout=timeout)
    return {
        "status": status, "body": out, "upstream": headers.get(UPSTREAM_HEADER, ""),
        "attempts": headers.get(ATTEMPTS_HEADER, ""), "seconds": time.monotonic() - t0,
    }


def cached_tokens(body):
    if not isinstance(body, dict):
        return None
    details = (body.get("usage") or {}).get("prompt_tokens_details") or {}
    return details.get("cached_tokens")
