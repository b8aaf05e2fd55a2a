"""Workload settings and the inference-perf config they become.

Kinds (`--workload`), all realised offline with the tokenizer in assets/tokenizer, Poisson
arrivals (seeded, see bench/ipf_seeded.py) over a ladder of rates, one stage per rate:
- `shared-prefix`: inference-perf's `shared_prefix` data: `groups` system prompts of
  `system_len` tokens, each shared by `prompts_per_group` prompts that add a
  `question_len`-token question and ask for `output_len` tokens;
- `multi-turn`: inference-perf's `conversation_replay` data: `conversations` chats, each
  opening with a `shared_len`-token prompt common to all and a `system_len`-token prompt of
  its own, then `turns` turns; every turn sends the whole conversation so far (system prompt,
  earlier questions and the answers the server gave) plus a new `question_len`-token
  question. After `turns` turns the chat starts over from its system prompt;
- `no-sharing`: inference-perf's `random` data: every prompt is `system_len + question_len`
  random tokens, nothing shared, the control where no router should win;
- `shifting`: `shared-prefix` data where a hot set of groups (`hot_fraction` of them) gets
  `hot_share` of the requests, and the hot set changes halfway through every stage
  (bench/kvbench/shifting.py, applied by bench/ipf_seeded.py).
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
    kind: str = "shared-prefix"
    # multi-turn
    conversations: int = 48
    turns: int = 6
    shared_len: int = 200
    # shifting
    hot_fraction: float = 0.25
    hot_share: float = 0.9

    def validate(self):
        """Rejects settings inference-perf or the fleet sizing cannot use."""
        for key in ("groups", "prompts_per_group", "system_len", "question_len", "output_len", "stage_seconds"):
            if getattr(self, key) < 1:
                raise ValueError(f"workload {key} must be at least 1, got {getattr(self, key)}")
        if not self.rates or any(r <= 0 for r in self.rates):
            raise ValueError(f"workload rates must be positive, got {self.rates}")
        if self.api not in ("completion", "chat"):
            raise ValueError(f"workload api must be completion or chat, got {self.api}")
        if self.kind not in KINDS:
            raise ValueError(f"workload kind must be one of {KINDS}, got {self.kind}")
        if self.kind == "multi-turn":
            if self.conversations < 1 or self.turns < 1 or self.shared_len < 0:
                raise ValueError("multi-turn needs conversations >= 1, turns >= 1, shared_len >= 0")
            if self.api != "completion":
                raise ValueError("inference-perf 0.7.0's multi-turn data speaks the completions API only")
        if self.kind == "no-sharing" and self.api != "completion":
            raise ValueError("inference-perf 0.7.0's random data speaks the completions API only")
        if self.kind == "shifting":
            if not 0 < self.hot_fraction <= 0.5:
                raise ValueError(f"hot_fraction must be in (0, 0.5] (two disjoint hot sets), got {self.hot_fraction}")
            if not 0 <= self.hot_share <= 1:
                raise ValueError(f"hot_share must be in [0, 1], got {self.hot_share}")
            if max(1, round(self.groups * self.hot_fraction)) * 2 > self.groups:
                raise ValueError("shifting needs at least two disjoint hot sets of groups")
        return self

    def stage_requests(self):
        """Requests inference-perf sends in each stage: int(rate × duration), as its load
        generator counts them (loadgen/load_generator.py, run_stage)."""
        return [int(r * self.stage_seconds) for r in self.rates]

    def working_set_tokens(self):
        """The tokens a router can reuse, which the KV capacity is sized against: the groups'
        system prompts; for multi-turn the shared prompt plus every conversation at its
        longest (its own prompt and all its turns); for no-sharing one prompt per group."""
        if self.kind == "multi-turn":
            per_conversation = self.system_len + self.turns * (self.question_len + self.output_len)
            return self.shared_len + self.conversations * per_conversation
        return self.groups * self.system_len

    def requests_per_stage(self):
        """Expected requests of each stage (rate × duration)."""
        return [r * self.stage_seconds for r in self.rates]

    def to_dict(self):
        return asdict(self)


KINDS = ("shared-prefix", "multi-turn", "no-sharing", "shifting")


def blocks_per_pod(workload, block_size, fraction=1 / 3, headroom_requests=1):
    """KV blocks per pod so that one pod holds `fraction` of the shared prefixes.

    The shared working set is `workload.working_set_tokens()` (groups × system_len tokens
    for shared-prefix data). On top of the prefix share, a pod
    needs room for a request it runs on a group it does not cache (prefix, question and
    output); `headroom_requests` of those are added, so that one cold request does not flush
    the pod's whole share. More headroom would let a pod keep most prefixes and hide the
    placement problem the benchmark is about.
    The +1 is vLLM's null block, which kvpick-sim counts in --num-gpu-blocks as vLLM does.
    """
    if block_size < 1:
        raise ValueError("block_size must be at least 1")
    prefix_blocks = math.ceil(workload.working_set_tokens() / block_size)
    share = math.ceil(prefix_blocks * fraction)
    longest = workload.system_len + workload.question_len + workload.output_len
    if workload.kind == "multi-turn":
        longest = workload.shared_len + workload.system_len + workload.turns * (workload.question_len + workload.output_len)
    per_request = math.ceil(longest / block_size)
    return share + headroom_requests * per_request + 1


def max_concurrency(workload):
    """inference-perf's per-worker slot count: above the run's request count.

    NOTE: inference-perf takes a slot before it waits for a request's send time, so with
    fewer slots than requests it delays sends under overload and hides the server's queue.
    """
    return int(sum(workload.requests_per_stage())) + 100


def _fixed(value, count=None):
    """An inference-perf Distribution that always gives `value`."""
    d = {"type": "fixed", "min": value, "max": value, "mean": float(value), "std_dev": 0.0}
    if count is not None:
        d["total_count"] = count
    return d


def data_config(workload):
    """inference-perf's `data` section for the workload's kind."""
    if workload.kind == "multi-turn":
        return {
            "type": "conversation_replay",
            "conversation_replay": {
                "seed": workload.seed,
                "num_conversations": workload.conversations,
                "shared_system_prompt_len": workload.shared_len,
                "dynamic_system_prompt_len": _fixed(workload.system_len),
                "turns_per_conversation": _fixed(workload.turns),
                "input_tokens_per_turn": _fixed(workload.question_len),
                "output_tokens_per_turn": _fixed(workload.output_len),
                # Room for the longest conversation, so history is never cut (a cut would
                # change every later turn's prefix).
                "max_model_len": 2 * (workload.shared_len + workload.system_len
                                      + workload.turns * (workload.question_len + workload.output_len)) + 512,
            },
        }
    if workload.kind == "no-sharing":
        # The stage's index restarts at 0 each stage, so the largest stage bounds the draws.
        n = max(workload.stage_requests()) + 1
        return {
            "type": "random",
            "input_distribution": _fixed(workload.system_len + workload.question_len, n),
            "output_distribution": _fixed(workload.output_len, n),
        }
    return {
        "type": "shared_prefix",
        "shared_prefix": {
            "num_groups": workload.groups,
            "num_prompts_per_group": workload.prompts_per_group,
            "system_prompt_len": workload.system_len,
            "question_len": workload.question_len,
            "output_len": workload.output_len,
            "seed": workload.seed,
        },
    }


def shifting_spec(workload):
    """What bench/ipf_seeded.py needs to shift the hot groups (None unless `shifting`)."""
    if workload.kind != "shifting":
        return None
    return {
        "groups": workload.groups,
        "stage_requests": workload.stage_requests(),
        "hot_fraction": workload.hot_fraction,
        "hot_share": workload.hot_share,
        "seed": workload.seed,
    }


def inference_perf_config(workload, base_url, model, tokenizer_dir, out_dir, streaming=True):
    """The inference-perf 0.7.0 config (a dict, dumped as YAML) for one system."""
    workload.validate()
    return {
        "api": {"type": workload.api, "streaming": streaming},
        "data": data_config(workload),
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
