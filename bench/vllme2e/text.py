"""Deterministic prompt text and vLLM 0.32's own block hash (DESIGN §3: sha256 over pickle,
chained on the full digest from H("vllm-none-hash"), the event carrying the low 64 bits)."""

import hashlib
import pickle
import random

# Common words: with a leading space each is one pre-token, so the ids of a word prefix are a
# prefix of the ids of the longer text (block boundaries line up between prompts).
WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force "
    "education foot boy age policy music market sense nation plan college interest death "
    "experience effect class control care field development role effort rate heart drug show "
    "leader light voice wife police mind price report decision son view relationship town "
    "road arm difference value building action model season society tax director position "
    "player record paper space ground form event official matter center couple site project "
    "activity star table need court oil situation cost industry figure street image phone data"
).split()


def words(seed, n):
    rnd = random.Random(seed)
    return " ".join(rnd.choice(WORDS) for _ in range(n))


def _h(obj):
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


NONE_HASH = _h("vllm-none-hash")


def block_hashes(token_ids, block_size):
    """vLLM's published (int) hash of each full block of a prompt without cache_salt."""
    parent, out = NONE_HASH, []
    for b in range(len(token_ids) // block_size):
        parent = _h((parent, tuple(token_ids[b * block_size:(b + 1) * block_size]), None))
        out.append(int.from_bytes(parent[24:], "big"))
    return out


def common_prefix(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
