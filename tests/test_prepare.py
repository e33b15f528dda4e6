"""`python -m vbatch.prepare`, the install-time build and conversion, run as install.sh runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from test_gguf_file import write_mixed_gguf

from vbatch.models.loader import ResolvedModel, cache_dir


def run_prepare(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "vbatch.prepare", *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=900,
    )


def test_prepare_builds_kernels_and_converts_the_default_model(smollm2: ResolvedModel) -> None:
    done = run_prepare([])
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"cache: {cache_dir()}"
    assert lines[1].startswith(f"model {smollm2.name}: ready in {smollm2.hf_dir} (")
    assert lines[2].startswith("native kernels: ready")


def test_prepare_without_a_compiler_still_converts(tmp_path: Path) -> None:
    model = tmp_path / "tiny.gguf"
    write_mixed_gguf(model, ["Q8_0"])
    cache = tmp_path / "cache"
    done = run_prepare(
        ["--model", str(model)], VBATCH_CACHE_DIR=str(cache), CXX=str(tmp_path / "no-c++")
    )
    assert done.returncode == 0, done.stderr
    assert "native kernels unavailable" in done.stderr
    assert "native kernels: not built" in done.stdout
    assert not list(cache.glob("native/*/built"))
    assert len(list(cache.glob("gguf/*/model.safetensors"))) == 1


def test_prepare_reports_a_missing_model(tmp_path: Path) -> None:
    done = run_prepare(["--model", str(tmp_path / "nope.gguf")])
    assert done.returncode == 1
    assert done.stderr.strip().endswith(
        f"Error: model path {tmp_path / 'nope.gguf'} does not exist"
    )
    assert "Traceback" not in done.stderr
