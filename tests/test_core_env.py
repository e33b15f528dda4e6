"""The environment the engine core is spawned with: OpenMP waits chosen by the machine's load."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from vbatch.client.core_client import EngineCoreClient
from vbatch.config import EngineConfig
from vbatch.engine import openmp_waits, preload

WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", openmp_waits.WAITS_NOTE_VARIABLE)


@pytest.fixture
def no_policy() -> Iterator[None]:
    saved = {name: os.environ.pop(name, None) for name in WAIT_VARIABLES}
    yield
    for name, value in saved.items():
        os.environ.pop(name, None)
        if value is not None:
            os.environ[name] = value


@pytest.fixture
def busy_cpus() -> Iterator[None]:
    """A CPU-bound process on every CPU this process may use."""
    count = len(os.sched_getaffinity(0))
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def core_environ(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode().split("=", 1) for entry in entries if b"=" in entry)


def start_core(model_dir: Path) -> tuple[EngineCoreClient, dict[str, str], str]:
    """A core on the tiny model: its client, the environment it was exec'd with, and the OpenMP
    waits it reports (its note, which it reads from its own environment)."""
    client = EngineCoreClient(EngineConfig(model=str(model_dir), device="cpu", num_threads=1))
    assert client.pid is not None and client.info is not None
    (note,) = [n for n in client.info.kernels if n.startswith("OpenMP waits")]
    return client, core_environ(client.pid), note


@pytest.fixture
def spawn_environments(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, str | None]]:
    """The wait variables in this process's environment at each process start: a core's are
    passed to it, never set here, where another thread may be forking at the same moment."""
    seen: list[dict[str, str | None]] = []
    start = multiprocessing.process.BaseProcess.start

    def recording_start(process: multiprocessing.process.BaseProcess) -> None:
        seen.append({name: os.environ.get(name) for name in WAIT_VARIABLES})
        start(process)

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", recording_start)
    return seen


@pytest.mark.parametrize(
    "chosen", [{"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "500"}], ids=["policy", "spins"]
)
def test_the_users_openmp_waits_reach_the_core_unchanged(
    chosen: dict[str, str], no_policy: None, tiny_model_dir: Path
) -> None:
    os.environ.update(chosen)
    client, environ, note = start_core(tiny_model_dir)
    try:
        assert {name: environ.get(name) for name in WAIT_VARIABLES} == {
            name: chosen.get(name) for name in WAIT_VARIABLES
        }
        ((name, value),) = chosen.items()
        assert note == f"OpenMP waits: the environment's ({name}={value})"
    finally:
        client.shutdown()


def test_core_threads_sleep_at_once_on_a_busy_machine(
    no_policy: None,
    busy_cpus: None,
    spawn_environments: list[dict[str, str | None]],
    tiny_model_dir: Path,
) -> None:
    client, environ, note = start_core(tiny_model_dir)
    try:
        assert note.startswith("OpenMP waits: sleep at once")
        assert not any(name in environ for name in WAIT_VARIABLES), "set in the core, not here"
    finally:
        client.shutdown()
    assert spawn_environments and all(
        value is None for seen in spawn_environments for value in seen.values()
    )
    assert not any(name in os.environ for name in WAIT_VARIABLES)


def test_waits_follow_the_free_cpus_measured(
    no_policy: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(openmp_waits, "free_cpus", lambda: 1.9)
    spinning = openmp_waits.openmp_waits(2)
    assert spinning["OMP_WAIT_POLICY"] == "PASSIVE"
    assert spinning["GOMP_SPINCOUNT"] == str(openmp_waits.SPIN_COUNT)
    note = spinning[openmp_waits.WAITS_NOTE_VARIABLE]
    assert note.startswith(f"spin {openmp_waits.SPIN_COUNT}, then sleep (1.9 CPUs free")
    assert "GOMP_SPINCOUNT" not in openmp_waits.openmp_waits(4)
    monkeypatch.setattr(openmp_waits, "free_cpus", lambda: None)
    assert openmp_waits.openmp_waits(1)[openmp_waits.WAITS_NOTE_VARIABLE].startswith(
        "sleep at once (unknown CPUs free"
    )


def test_free_cpus_reads_the_machine(busy_cpus: None) -> None:
    free = openmp_waits.free_cpus(0.2)
    assert free is not None
    assert free < len(os.sched_getaffinity(0)) - 0.5


def test_free_cpus_counts_this_process_as_free(monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE: with no idle time read, what free_cpus reports is this process's own CPU time over
    # the window; the work spins for 0.2 s of that, however long a busy machine makes it wait.
    monkeypatch.setattr(openmp_waits, "idle_ticks", lambda cpus: 0)

    def spin() -> tuple[float, float]:
        cpu_start, wall_start = time.process_time(), time.monotonic()
        while time.process_time() - cpu_start < 0.2:
            pass
        return time.process_time() - cpu_start, time.monotonic() - wall_start

    (cpu_s, wall_s), busy_here = openmp_waits.free_cpus_while(spin)
    assert busy_here is not None and busy_here > 0
    assert busy_here == pytest.approx(cpu_s / wall_s, rel=0.25)


def test_the_preloaded_core_gets_its_waits_at_its_spawn(
    no_policy: None,
    busy_cpus: None,
    spawn_environments: list[dict[str, str | None]],
    tiny_model_dir: Path,
) -> None:
    preload.preload_core()
    preloaded = preload._preloaded[0]  # type: ignore[index]
    try:
        client, _, note = start_core(tiny_model_dir)
        assert client.pid == preloaded.pid, "the job adopted the preloaded core"
        client.shutdown()
    finally:
        preload.discard_preloaded()
    assert note.startswith("OpenMP waits: sleep at once")
    assert all(value is None for seen in spawn_environments for value in seen.values())
    assert not any(name in os.environ for name in WAIT_VARIABLES)
