"""The conformance run against real vLLM engines (scripts/vllm-e2e.sh, bench/vllm_e2e.py):
starting the stack (stack.py), watching the engines' own KV events (events.py), the checks
(checks.py) and the kvpick-vs-round-robin comparison (compare.py)."""
