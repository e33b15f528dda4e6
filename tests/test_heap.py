"""The engine core's heap keeps what a step frees for the next step (engine/heap.py), measured in
fresh processes by their minor page faults."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vbatch.client.core_client import EngineCoreClient
from vbatch.config import EngineConfig
from vbatch.engine.heap import keep_freed_memory, user_set_thresholds

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="glibc's malloc on Linux"
)

# NOTE: a step in small: blocks of 8 MB live together and freed together, 20 rounds; returns the
# pages touched per round and the minor faults of rounds 2 on, per round.
_STEPS = r"""
import ctypes, json, resource, sys
from vbatch.engine.heap import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else False
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
libc.memset.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)
small = libc.malloc(1 << 20)
libc.free(small)
size, rounds = 8 << 20, 20
def step():
    blocks = [libc.malloc(size) for _ in range(3)]
    for block in blocks:
        libc.memset(block, 1, size)
    for block in blocks:
        libc.free(block)
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(rounds - 1):
    step()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"applied": applied, "pages": 3 * size // 4096, "faults": faults / (rounds - 1)}))
"""


def run_steps(mode: str, env: dict[str, str] | None = None) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", _STEPS, mode],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return json.loads(out.stdout)


def test_freed_blocks_are_reused_rather_than_faulted_in_again() -> None:
    kept = run_steps("keep")
    assert kept["applied"] is True
    assert kept["faults"] < 0.02 * kept["pages"]


def test_without_it_glibc_returns_the_blocks_and_every_step_faults_them_in_again() -> None:
    default = run_steps("default")
    assert default["faults"] > 0.5 * default["pages"]


@pytest.mark.parametrize(
    "env",
    [
        {"MALLOC_TRIM_THRESHOLD_": "1048576"},
        {"MALLOC_MMAP_THRESHOLD_": "131072"},
        {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1048576"},
    ],
)
def test_a_users_own_threshold_wins(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert user_set_thresholds()
    assert keep_freed_memory() is False
    assert run_steps("keep", env)["applied"] is False


def test_other_tunables_leave_the_choice_to_vbatch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    for name in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_"):
        monkeypatch.delenv(name, raising=False)
    assert not user_set_thresholds()


def heap_note(model_dir: Path) -> str:
    """The heap note of a real core on the tiny model."""
    client = EngineCoreClient(EngineConfig(model=str(model_dir), device="cpu", num_threads=1))
    try:
        assert client.info is not None
        (note,) = [n for n in client.info.kernels if n.startswith("heap:")]
    finally:
        client.shutdown()
    return note


def test_the_engine_core_keeps_freed_memory_and_says_so(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    assert heap_note(tiny_model_dir).startswith("heap: freed memory kept up to 64 MB")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1048576")
    assert heap_note(tiny_model_dir) == "heap: the environment's glibc thresholds"
