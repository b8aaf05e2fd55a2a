"""inference-perf with seeded arrivals.

Why: inference-perf 0.7.0's Poisson load timer draws its gaps from `np.random.default_rng()`
without a seed (inference_perf/loadgen/load_timer.py), so two runs never send the same
arrival pattern and systems cannot be compared on the same workload. This wrapper makes every
unseeded `default_rng()` call draw from a fixed seed sequence (KVPICK_BENCH_SEED), then runs
inference-perf's own CLI unchanged. Calls that pass a seed (the shared_prefix data generator,
the workers' seeding) are untouched. The timer runs in the main process and creates its
generators in a fixed order (one per stage, one per simulated second), so the same config
gives the same send times.
"""

import itertools
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


if __name__ == "__main__":
    install()
    from inference_perf import main_cli

    sys.argv[0] = "inference-perf"
    sys.exit(main_cli())
