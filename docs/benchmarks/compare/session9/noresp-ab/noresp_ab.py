"""A/B: kvpick with the response body streamed through ext_proc (the shipped config) against
the same with response_body_mode NONE, in one comparison run (throwaway; not in the repo)."""
import sys
sys.path.insert(0, "/work/main/bench")
import compare
from kvbench import systems

state = {"noresp": False}
orig = systems._envoy_config

def patched(*a, **k):
    cfg = orig(*a, **k)
    if state["noresp"]:
        hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        for f in hcm["http_filters"]:
            if f["name"] == "envoy.filters.http.ext_proc":
                f["typed_config"]["processing_mode"]["response_body_mode"] = "NONE"
    return cfg

systems._envoy_config = patched

def start_noresp(ctx, procs):
    state["noresp"] = True
    try:
        return systems._start_kvpick(ctx, procs, recommended=True)
    finally:
        state["noresp"] = False

systems.SYSTEMS["kvpick-noresp"] = {"start": start_noresp, "flags": "kvpick-recommended, Envoy response_body_mode NONE"}
compare.SYSTEMS["kvpick-noresp"] = systems.SYSTEMS["kvpick-noresp"]
sys.exit(compare.main(sys.argv[1:]))
