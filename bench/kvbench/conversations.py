"""The order in which the multi-turn workload's conversations take their turns.

Why: inference-perf 0.7.0's conversation_replay sends request i to conversation i mod C, so
the conversations take turns in a fixed cycle. Behind a strict round robin that cycle alone
decides placement: with C a multiple of the pod count every conversation lands on the same
pod every turn (a perfect, accidental affinity; measured: round robin level with kvpick),
otherwise it never does. Real chats arrive in no fixed order, so every round (C requests)
here visits the conversations in a fresh seeded permutation: each still takes exactly one
turn per round, after its previous turn (inference-perf's session lock keeps that order).

Pure and deterministic per (seed, stage, round), so bench/test_kvbench.py checks it and every
system gets the same order (bench/ipf_seeded.py applies it).
"""

import random


def shuffled_index(index, conversations, seed, stage=0):
    """The data index inference-perf should load for send number `index`: the same round
    (index // conversations), the conversation at position index % conversations of that
    round's permutation."""
    if conversations < 1:
        raise ValueError("conversations must be at least 1")
    rnd, pos = divmod(index, conversations)
    order = list(range(conversations))
    random.Random(f"{seed}/{stage}/{rnd}").shuffle(order)
    return rnd * conversations + order[pos]
