#!/usr/bin/env bash
# Installs vbatch with its test extra, then runs the default test suite (not slow, not gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test
exec "${PYTHON:-python3}" -m pytest -q "$@"
