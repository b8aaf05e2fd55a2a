#!/usr/bin/env bash
# Installs the comparison benchmark's Python side into .venv-bench/ (PyPI, pinned): the load
# generator inference-perf, the peers sglang-router (smg) and vllm-router, and matplotlib for
# the plots. Its own venv because inference-perf needs Python >= 3.12 while .venv/ (Envoy,
# pyzmq) is the machine's python3. Offline-capable at run time: the tokenizer is
# assets/tokenizer and the benchmark runs with HF_HUB_OFFLINE=1. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
INFERENCE_PERF_VERSION="${INFERENCE_PERF_VERSION:-0.7.0}"
SGLANG_ROUTER_VERSION="${SGLANG_ROUTER_VERSION:-0.3.2}"
VLLM_ROUTER_VERSION="${VLLM_ROUTER_VERSION:-0.1.17}"
MATPLOTLIB_VERSION="${MATPLOTLIB_VERSION:-3.11.2}"
PINS=("inference-perf==${INFERENCE_PERF_VERSION}" "sglang-router==${SGLANG_ROUTER_VERSION}"
      "vllm-router==${VLLM_ROUTER_VERSION}" "matplotlib==${MATPLOTLIB_VERSION}")

find_python() {
  for candidate in python3.13 python3.12 "$HOME/.pyenv/versions/3.12.1/bin/python3.12" python3; do
    if command -v "$candidate" >/dev/null 2>&1 &&
       "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      echo "$candidate"; return 0
    fi
  done
  for candidate in "$HOME"/.pyenv/versions/3.1[2-9]*/bin/python3; do
    [ -x "$candidate" ] && { echo "$candidate"; return 0; }
  done
  return 1
}

if [ ! -x .venv-bench/bin/python ]; then
  PY=$(find_python) || { echo "setup-bench-venv: inference-perf needs Python >= 3.12 and none was found" >&2; exit 1; }
  "$PY" -m venv .venv-bench
fi
if ! .venv-bench/bin/python - "${PINS[@]}" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
for pin in sys.argv[1:]:
    name, want = pin.split("==")
    if version(name) != want:
        sys.exit(1)
PY
then
  echo "setup-bench-venv: installing ${PINS[*]} into .venv-bench" >&2
  # NOTE: --no-compile: byte-compiling every module of transformers, pandas, pyarrow… took
  # about a minute of the install; Python compiles (and caches) the few it imports instead.
  .venv-bench/bin/pip install --quiet --disable-pip-version-check --no-compile "${PINS[@]}"
fi
