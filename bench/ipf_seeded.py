"""inference-perf with seeded arrivals.

Why: inference-perf 0.7.0's Poisson load timer draws its gaps from `np.random.default_rng()`
without a seed (inference_perf/loadgen/load_timer.py), so two runs never send the same
arrival pattern and systems cannot be compared on the same workload. This wrapper makes every
unseeded `default_rng()` call draw from a fixed seed sequence (KVPICK_BENCH_SEED), then runs
inference-perf's own CLI unchanged. Calls that pass a seed (the shared_prefix data generator,
the workers' seeding) are untouched. The timer runs in the main process and creates its
generators in a fixed order (one per stage, one per simulated second), so the same config
gives the same send times.

With KVPICK_BENCH_SHIFTING (a JSON spec from kvbench.workload.shifting_spec) it also makes the
shared_prefix data's popularity shift (bench/kvbench/shifting.py): each request's prompt is
chosen by its stage and index instead of cycling evenly through the prompts. inference-perf
forks its worker from this process (Linux), so the patch reaches the worker that loads the data.

And it works around an inference-perf 0.7.0 bug in `conversation_replay` (the multi-turn
workload): at each stage after the first, the generator re-primes its sessions with
`_new_session(context=system_prompt)` but no `system_prompt`, and a session without one
sends only the current turn's text, so every conversation of stage 2 onwards lost its system
prompt and its history (measured: ~100-token prompts, nothing cached). The patch makes a
session primed with a context keep it as its system prompt, as the first stage's sessions do.
Its conversations also take their turns in a seeded random order per round instead of a
fixed cycle (bench/kvbench/conversations.py), and the tokenizer is loaded once per process.
"""

import itertools
import json
import os
import sys

import numpy as np

# Kept on numpy itself so that installing twice (tests) never wraps the wrapper.
if not hasattr(np.random, "_kvpick_unseeded_default_rng"):
    np.random._kvpick_unseeded_default_rng = np.random.default_rng
_original = np.random._kvpick_unseeded_default_rng


def install():
    """Route unseeded default_rng() calls through a fixed seed sequence, restarted from
    KVPICK_BENCH_SEED."""
    seeds = itertools.count(int(os.environ.get("KVPICK_BENCH_SEED", "1")) * 1_000_003)

    def seeded_default_rng(seed=None):
        return _original(next(seeds) if seed is None else seed)

    np.random.default_rng = seeded_default_rng


def install_shifting(spec):
    """Route shared_prefix's lazy loads through shifting.prompt_index."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from kvbench import shifting
    from inference_perf.datagen.synthetic.shared_prefix_datagen import SharedPrefixDataGenerator

    original = SharedPrefixDataGenerator.load_lazy_data
    if getattr(original, "_kvpick_shifting", False):
        return

    def load_lazy_data(self, data):
        stage = getattr(data, "stage_id", None) or 0
        index = shifting.prompt_index(stage, data.data_index, spec, self.prompt_groups)
        return original(self, data.model_copy(update={"data_index": index}))

    load_lazy_data._kvpick_shifting = True
    SharedPrefixDataGenerator.load_lazy_data = load_lazy_data


def install_session_fix():
    """Re-primed conversation_replay sessions keep their system prompt (see above)."""
    from inference_perf.datagen.replay.conversation_replay_datagen import ConversationReplayDataGenerator

    original = ConversationReplayDataGenerator._new_session
    if getattr(original, "_kvpick_fixed", False):
        return

    def _new_session(self, user_session_id, context, system_prompt=""):
        return original(self, user_session_id, context, system_prompt or context)

    _new_session._kvpick_fixed = True
    ConversationReplayDataGenerator._new_session = _new_session


def install_conversation_shuffle():
    """Each round of conversation_replay visits its conversations in a seeded random order
    (bench/kvbench/conversations.py says why)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from kvbench import conversations
    from inference_perf.datagen.replay.conversation_replay_datagen import ConversationReplayDataGenerator

    original = ConversationReplayDataGenerator.load_lazy_data
    if getattr(original, "_kvpick_shuffled", False):
        return

    def load_lazy_data(self, data):
        stage = getattr(data, "stage_id", None) or 0
        index = conversations.shuffled_index(data.data_index, len(self.blueprints), self.cr_config.seed, stage)
        return original(self, data.model_copy(update={"data_index": index}))

    load_lazy_data._kvpick_shuffled = True
    ConversationReplayDataGenerator.load_lazy_data = load_lazy_data


def install_tokenizer_cache():
    """One tokenizer load per process instead of three.

    Why: inference-perf 0.7.0 loads the same tokenizer for the data generator, the client and
    the report (utils/custom_tokenizer.py), ~2-4 s each on the shared 2-core machine, before
    and after every system's run. The loaded tokenizer is only ever used from one thread at a
    time (the asyncio loop; the worker is a forked copy)."""
    from inference_perf.utils import custom_tokenizer

    original = custom_tokenizer._load_tokenizer_with_deadline
    if getattr(original, "_kvpick_cached", False):
        return
    cache = {}

    def load(config):
        key = (config.pretrained_model_name_or_path, config.token, config.trust_remote_code)
        if key not in cache:
            cache[key] = original(config)
        return cache[key]

    load._kvpick_cached = True
    custom_tokenizer._load_tokenizer_with_deadline = load


if __name__ == "__main__":
    install()
    install_session_fix()
    install_conversation_shuffle()
    install_tokenizer_cache()
    if os.environ.get("KVPICK_BENCH_SHIFTING"):
        install_shifting(json.loads(os.environ["KVPICK_BENCH_SHIFTING"]))
    from inference_perf import main_cli

    sys.argv[0] = "inference-perf"
    sys.exit(main_cli())
