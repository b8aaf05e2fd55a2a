#!/usr/bin/env bash
# Kept for existing callers: the venv setup (Envoy and pyzmq) is scripts/setup-venv.sh.
set -euo pipefail
exec "$(dirname "$0")/setup-venv.sh"
