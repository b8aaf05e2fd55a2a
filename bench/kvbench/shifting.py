"""Shifting prefix popularity: which group each request of a `shifting` run asks about.

Why our own: inference-perf 0.7.0's shared_prefix data cycles through its prompts evenly, so
every group is equally popular for the whole run. Here a hot set of groups gets `hot_share` of
the requests (the rest spread over the other groups) and the hot set changes halfway through
every stage: phase 2·stage in the first half, 2·stage + 1 in the second, each phase's hot set
the next disjoint slice of the groups (wrapping). A router that learned where the old hot
prefixes live must notice the new ones.

Pure and deterministic per (seed, stage, index), so bench/test_kvbench.py checks it and the
same request gets the same group in every system's run (bench/ipf_seeded.py applies it).
"""

import random


def hot_size(groups, hot_fraction):
    """Groups in one hot set."""
    return max(1, round(groups * hot_fraction))


def hot_set(phase, groups, hot_fraction):
    """The hot groups of one phase: the phase-th disjoint slice of the groups (wrapping)."""
    size = hot_size(groups, hot_fraction)
    slices = groups // size
    start = (phase % slices) * size
    return list(range(start, start + size))


def phase_of(stage, index, stage_requests):
    """0-based phase of request `index` of `stage`: the hot set changes at the stage's half."""
    n = stage_requests[stage] if stage < len(stage_requests) else 0
    return 2 * stage + (1 if index >= n / 2 else 0)


def group_for(stage, index, spec):
    """The group request `index` of `stage` asks about, under `spec`
    (workload.shifting_spec)."""
    groups = spec["groups"]
    hot = hot_set(phase_of(stage, index, spec["stage_requests"]), groups, spec["hot_fraction"])
    rng = random.Random(f"{spec['seed']}/{stage}/{index}")
    if rng.random() < spec["hot_share"] or len(hot) == groups:
        return hot[rng.randrange(len(hot))]
    cold = [g for g in range(groups) if g not in set(hot)]
    return cold[rng.randrange(len(cold))]


def prompt_index(stage, index, spec, prompt_groups):
    """An index into inference-perf's (shuffled) prompt list whose prompt belongs to the group
    `group_for` chose; the prompt within the group is drawn the same deterministic way."""
    group = group_for(stage, index, spec)
    members = [i for i, g in enumerate(prompt_groups) if g == group]
    if not members:
        raise ValueError(f"no prompt of group {group} among {len(prompt_groups)} prompts")
    rng = random.Random(f"{spec['seed']}/{stage}/{index}/prompt")
    return members[rng.randrange(len(members))]
