"""kvpick's side-by-side benchmark harness (scripts/compare.sh): workloads, processes,
systems under test, statistics and reports. Pure-Python helpers are importable without the
benchmark venv so that their unit tests (bench/test_kvbench.py) run anywhere."""
