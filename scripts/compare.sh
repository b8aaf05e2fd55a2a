#!/usr/bin/env bash
# The side-by-side benchmark (docs/benchmarks.md, "Side-by-side"): the same seeded
# inference-perf workload through Envoy round robin, Envoy + kvpick (GIE default and
# recommended profiles), smg cache_aware and vllm-router cache_aware / kv_aware, each in front
# of a fresh kvpick-sim fleet. Writes target/compare/<mode>/{results.csv,summary.json,
# table.md,*.png}.
# Usage: scripts/compare.sh [--quick] [bench/compare.py options, e.g. --systems a,b --pods 4,
#   --workload shared-prefix|multi-turn|no-sharing|shifting, --heterogeneous, --replicas N,
#   --cache-fraction F, --rates a,b,c, --stage-seconds S, --out DIR]
# --quick (≤ 3 min): 4 pods, 2 rates × 5 s, round robin, kvpick, smg and vllm-router cache_aware.
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=default
if [ "${1:-}" = "--quick" ]; then MODE=quick; shift; fi
scripts/setup-envoy.sh
scripts/setup-bench-venv.sh
# Release builds of only what runs: the debug simulator would be the bottleneck, not the routers.
cargo build --release --locked --quiet -p kvpick --bin kvpick -p kvpick-sim --bin kvpick-sim
exec .venv-bench/bin/python bench/compare.py --mode "$MODE" "$@"
