"""Workload settings and the inference-perf config they become.

The workload is inference-perf's `shared_prefix` data: `groups` system prompts of `system_len`
tokens, each shared by `prompts_per_group` prompts that add a `question_len`-token question and
ask for `output_len` tokens, realised offline with the tokenizer in assets/tokenizer. Arrivals
are Poisson (seeded, see bench/ipf_seeded.py) over a ladder of rates, one stage per rate.
"""

from dataclasses import dataclass, field, asdict
import math


@dataclass
class Workload:
    """One benchmark workload (the same for every system)."""

    name: str = "shared-prefix"
    groups: int = 45
    prompts_per_group: int = 5
    system_len: int = 2000
    question_len: int = 200
    output_len: int = 64
    rates: list = field(default_factory=lambda: [4.0, 8.0, 12.0, 16.0])
    stage_seconds: int = 30
    seed: int = 42
    api: str = "completion"

    def validate(self):
        """Rejects settings inference-perf or the fleet sizing cannot use."""
        for key in ("groups", "prompts_per_group", "system_len", "question_len", "output_len", "stage_seconds"):
            if getattr(self, key) < 1:
                raise ValueError(f"workload {key} must be at least 1, got {getattr(self, key)}")
        if not self.rates or any(r <= 0 for r in self.rates):
            raise ValueError(f"workload rates must be positive, got {self.rates}")
        if self.api not in ("completion", "chat"):
            raise ValueError(f"workload api must be completion or chat, got {self.api}")
        return self

    def requests_per_stage(self):
        """Expected requests of each stage (rate × duration)."""
        return [r * self.stage_seconds for r in self.rates]

    def to_dict(self):
        return asdict(self)


def blocks_per_pod(workload, block_size, fraction=1 / 3, headroom_requests=1):
    """KV blocks per pod so that one pod holds `fraction` of the shared prefixes.

    The shared working set is groups × system_len tokens. On top of the prefix share, a pod
    needs room for a request it runs on a group it does not cache (prefix, question and
    output); `headroom_requests` of those are added, so that one cold request does not flush
    the pod's whole share. More headroom would let a pod keep most prefixes and hide the
    placement problem the benchmark is about.
    The +1 is vLLM's null block, which kvpick-sim counts in --num-gpu-blocks as vLLM does.
    """
    if block_size < 1:
        raise ValueError("block_size must be at least 1")
    prefix_blocks = math.ceil(workload.groups * workload.system_len / block_size)
    share = math.ceil(prefix_blocks * fraction)
    per_request = math.ceil(
        (workload.system_len + workload.question_len + workload.output_len) / block_size
    )
    return share + headroom_requests * per_request + 1


def max_concurrency(workload):
    """inference-perf's per-worker slot count: above the run's request count.

    NOTE: inference-perf takes a slot before it waits for a request's send time, so with
    fewer slots than requests it delays sends under overload and hides the server's queue.
    """
    return int(sum(workload.requests_per_stage())) + 100


def inference_perf_config(workload, base_url, model, tokenizer_dir, out_dir, streaming=True):
    """The inference-perf 0.7.0 config (a dict, dumped as YAML) for one system."""
    workload.validate()
    return {
        "api": {"type": workload.api, "streaming": streaming},
        "data": {
            "type": "shared_prefix",
            "shared_prefix": {
                "num_groups": workload.groups,
                "num_prompts_per_group": workload.prompts_per_group,
                "system_prompt_len": workload.system_len,
                "question_len": workload.question_len,
                "output_len": workload.output_len,
                "seed": workload.seed,
            },
        },
        "load": {
            "type": "poisson",
            "stages": [{"rate": r, "duration": workload.stage_seconds} for r in workload.rates],
            "interval": 1.0,
            # One worker process: the machine has two cores, and the servers under test need them.
            "num_workers": 1,
            "worker_max_concurrency": max_concurrency(workload),
            "base_seed": workload.seed,
            "request_timeout": 300.0,
        },
        "server": {"type": "vllm", "model_name": model, "base_url": base_url, "ignore_eos": True},
        "tokenizer": {"pretrained_model_name_or_path": str(tokenizer_dir)},
        "report": {
            "request_lifecycle": {
                "summary": True,
                "per_stage": True,
                "per_request": True,
                # Timings and usage only: the prompts are megabytes over a run.
                "per_request_fields": {
                    "request": False,
                    "response": False,
                    "info": True,
                    "response_chunks": False,
                    "computed_metrics": True,
                },
            },
        },
        "storage": {"local_storage": {"path": str(out_dir)}},
    }
