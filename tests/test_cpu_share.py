"""A running core's thread count: one while other processes want its CPUs, its own otherwise
(engine/cpu_share.py), and results that do not depend on it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from vbatch.config import EngineConfig
from vbatch.engine.core import EngineCore
from vbatch.engine.cpu_share import SAMPLE_S, CpuShare, cpu_notes, shares_cpus
from vbatch.layers.linear_choice import runs_at_any_thread_count
from vbatch.protocol import AddRequest, pack_token_ids
from vbatch.sampling_params import SamplingParams


class Readings:
    """A fake clock and CPU counters: each `tick(free)` is SAMPLE_S in which `free` CPUs were
    idle or running the core."""

    def __init__(self) -> None:
        self.now = 0.0
        self.idle = 0.0
        self.own = 0.0

    def tick(self, free: float, own: float = 1.0) -> None:
        self.now += SAMPLE_S
        self.own += own * SAMPLE_S
        self.idle += (free - own) * SAMPLE_S


def fake_share(readings: Readings, threads: int = 2) -> tuple[CpuShare, list[int]]:
    applied: list[int] = []
    share = CpuShare(
        threads,
        {0, 1},
        applied.append,
        read=lambda: (readings.idle, readings.own),
        clock=lambda: readings.now,
    )
    share.sample()
    return share, applied


def run_ticks(share: CpuShare, readings: Readings, frees: list[float]) -> list[int]:
    """`wanted` after each of the ticks, applied as the busy loop would."""
    seen = []
    for free in frees:
        readings.tick(free)
        share.sample()
        share.apply()
        seen.append(share.wanted)
    return seen


def test_a_quiet_machine_keeps_every_thread() -> None:
    readings = Readings()
    share, applied = fake_share(readings)
    assert run_ticks(share, readings, [2.0, 1.9, 1.6, 2.0, 1.7]) == [2] * 5
    assert applied == []


def test_sustained_load_drops_to_one_thread_and_its_end_gives_them_back() -> None:
    readings = Readings()
    share, applied = fake_share(readings)
    # NOTE: one busy sample is a blip (the client writing a batch), two in a row are load.
    assert run_ticks(share, readings, [1.2, 2.0, 1.2, 1.0]) == [2, 2, 2, 1]
    assert applied == [1]
    # NOTE: at one thread with the other process still there, the core alone is free to it.
    assert run_ticks(share, readings, [1.0, 1.0, 2.0, 2.0, 2.0, 1.0, 2.0]) == [1] * 7
    assert run_ticks(share, readings, [2.0, 2.0, 1.9]) == [1, 1, 2]
    assert applied == [1, 2]


def test_samples_closer_than_the_interval_are_skipped() -> None:
    readings = Readings()
    share, _ = fake_share(readings)
    for _ in range(5):
        readings.now += SAMPLE_S / 10
        readings.own += SAMPLE_S / 10
        share.sample()
    assert share.wanted == 2


def test_unreadable_counters_change_nothing() -> None:
    def unreadable() -> tuple[float, float]:
        raise OSError("no /proc here")

    share = CpuShare(2, {0, 1}, lambda n: None, read=unreadable)
    for _ in range(3):
        share.sample()
    assert share.wanted == 2


def test_which_cores_share_and_what_they_report() -> None:
    assert shares_cpus(2, "cpu", thread_invariant=True)
    assert not shares_cpus(1, "cpu", thread_invariant=True)
    assert not shares_cpus(2, "cuda", thread_invariant=True)
    assert not shares_cpus(4, "cpu", thread_invariant=False)
    assert cpu_notes(2, thread_invariant=True)[-1].startswith("threads: 2, one while")
    assert not any(note.startswith("threads") for note in cpu_notes(1, thread_invariant=True))
    assert not any(note.startswith("threads") for note in cpu_notes(2, thread_invariant=False))


def test_only_native_linears_run_alike_at_any_thread_count() -> None:
    native = {"rows": [1, 8], "qkv": ["native", "native"], "lm_head": ["native", "native"]}
    assert runs_at_any_thread_count({**native, "mlp": ["separate", "separate"]})
    assert not runs_at_any_thread_count({**native, "qkv": ["torch", "native"]})
    assert not runs_at_any_thread_count({**native, "lm_head": ["native", "onednn"]})
    assert not runs_at_any_thread_count({**native, "mlp": ["separate", "torch-transposed"]})
    assert not runs_at_any_thread_count({"rows": [1, 8]})


@pytest.fixture
def hogs() -> Iterator[None]:
    """A CPU-bound process on every CPU this process may use."""
    count = len(os.sched_getaffinity(0))
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        time.sleep(0.2)
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_real_load_on_every_cpu_drops_a_core_to_one_thread(hogs: None) -> None:
    applied: list[int] = []
    share = CpuShare(2, os.sched_getaffinity(0), applied.append)
    deadline = time.monotonic() + 20 * SAMPLE_S
    while share.wanted != 1 and time.monotonic() < deadline:
        share.sample()
        time.sleep(SAMPLE_S / 5)
    share.apply()
    assert applied == [1]


def generate(core: EngineCore, prompts: list[list[int]], switch_at: int | None) -> list[object]:
    """Every step's token ids and logprobs; from step `switch_at` on, one thread."""
    for i, ids in enumerate(prompts):
        params = SamplingParams(
            temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=12, logprobs=2
        )
        core.add_request(AddRequest(f"r{i}", pack_token_ids(ids), params))
    steps: list[object] = []
    while core.requests:
        if len(steps) == switch_at:
            torch.set_num_threads(1)
        out = core.step()
        steps.append((out.request_ids, out.token_ids, out.logprobs))
    return steps


def test_the_thread_count_does_not_change_a_sharing_cores_result(tiny_model_dir: Path) -> None:
    before = torch.get_num_threads()
    prompts = [[1 + (7 * i + j) % 250 for j in range(20 + 9 * i)] for i in range(6)]
    config = EngineConfig(model=str(tiny_model_dir), num_threads=2, seed=0, linear_backend="native")
    try:
        core = EngineCore(config)
        assert core.thread_invariant
        two = generate(core, prompts, switch_at=None)
        torch.set_num_threads(2)
        switched = generate(EngineCore(config), prompts, switch_at=3)
    finally:
        torch.set_num_threads(before)
    assert switched == two


@pytest.mark.parametrize("backend", ["torch", "onednn"])
def test_a_core_whose_linears_depend_on_threads_keeps_its_count(
    tiny_model_dir: Path, backend: str
) -> None:
    before = torch.get_num_threads()
    try:
        core = EngineCore(
            EngineConfig(model=str(tiny_model_dir), num_threads=2, linear_backend=backend)
        )
    finally:
        torch.set_num_threads(before)
    assert not core.thread_invariant
    assert not any(note.startswith("threads") for note in core.runner.kernel_notes)
