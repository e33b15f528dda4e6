#!/usr/bin/env bash
# Installs vbatch with its test extra, then runs the default test suite (not slow, not gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test
# NOTE: two workers, a file's tests on one (its module fixtures start once): most tests wait on
# a spawned core's start-up, which a second worker overlaps. VBATCH_TEST_WORKERS=0 runs serially.
exec "${PYTHON:-python3}" -m pytest -q -n "${VBATCH_TEST_WORKERS:-2}" --dist loadfile "$@"
