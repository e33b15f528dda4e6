"""kernel_choice: decisions cached per machine, and one timed under load timed again when quiet."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from vbatch.engine import openmp_waits
from vbatch.layers import kernel_choice


def is_pick(choice: Any) -> bool:
    return isinstance(choice, dict) and "pick" in choice


def free_while(free: float) -> Callable[..., tuple[Any, float]]:
    """A stand-in for openmp_waits.free_cpus_while that reports `free` CPUs."""
    return lambda work, min_window_s=0.0: (work(), free)


def test_free_cpus_while_returns_the_result_and_counts_this_process_as_free() -> None:
    def spin() -> str:
        end = time.process_time() + 0.3
        while time.process_time() < end:
            pass
        return "done"

    result, free = openmp_waits.free_cpus_while(spin)
    assert result == "done"
    assert free is not None
    # NOTE: the spinning thread's own CPU counts as free; another process can take the rest.
    assert 0.1 <= free <= len(openmp_waits.os.sched_getaffinity(0)) + 0.2


def test_a_choice_timed_under_load_is_used_and_timed_again_at_a_quiet_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VBATCH_CACHE_DIR", str(tmp_path))
    threads = torch.get_num_threads()
    measured: list[str] = []

    def measure(label: str) -> Callable[[], dict[str, Any]]:
        def run() -> dict[str, Any]:
            measured.append(label)
            return {"pick": label}

        return run

    monkeypatch.setattr(kernel_choice, "free_cpus_while", free_while(threads - 1.0))
    assert kernel_choice.cached_choice("test", {"n": 1}, measure("busy"), is_pick) == {
        "pick": "busy"
    }
    (path,) = (tmp_path / "kernel_choices").glob("test-*.json")
    assert json.loads(path.read_text())["under_load"] is True

    # NOTE: a start that finds the machine busy too keeps the busy decision.
    monkeypatch.setattr(kernel_choice, "is_quiet_now", lambda: False)
    assert kernel_choice.cached_choice("test", {"n": 1}, measure("again"), is_pick) == {
        "pick": "busy"
    }
    assert measured == ["busy"]

    monkeypatch.setattr(kernel_choice, "is_quiet_now", lambda: True)
    monkeypatch.setattr(kernel_choice, "free_cpus_while", free_while(threads + 0.0))
    assert kernel_choice.cached_choice("test", {"n": 1}, measure("quiet"), is_pick) == {
        "pick": "quiet"
    }
    assert json.loads(path.read_text())["under_load"] is False
    assert kernel_choice.cached_choice("test", {"n": 1}, measure("never"), is_pick) == {
        "pick": "quiet"
    }
    assert measured == ["busy", "quiet"]


@pytest.mark.parametrize(
    ("free", "busy"), [(None, False), (0.4, True), (1.4, True), (1.5, False), (2.0, False)]
)
def test_busy_means_less_than_the_threads_less_half_a_cpu(
    monkeypatch: pytest.MonkeyPatch, free: float | None, busy: bool
) -> None:
    monkeypatch.setattr(kernel_choice.torch, "get_num_threads", lambda: 2)
    assert kernel_choice.is_busy(free) is busy


def test_a_timing_too_short_to_read_the_load_is_not_judged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VBATCH_CACHE_DIR", str(tmp_path))
    assert openmp_waits.free_cpus_while(lambda: None, min_window_s=0.1) == (None, None)
    assert kernel_choice.cached_choice("short", {"n": 1}, lambda: {"pick": 1}, is_pick) == {
        "pick": 1
    }
    (path,) = (tmp_path / "kernel_choices").glob("short-*.json")
    assert json.loads(path.read_text())["under_load"] is False


def test_a_burst_of_load_shorter_than_the_timing_cannot_make_a_pick() -> None:
    """A candidate's calls are spread over the whole timing: a burst as long as all of one
    shape's timed calls (back to back, they had all been slow) slows at most two calls of each
    candidate here, so every fastest time stays the quiet one."""
    calls: list[str] = []
    warm_ups = 6
    burst = range(warm_ups, warm_ups + 2 * kernel_choice.REPEATS)

    def candidate(name: str) -> Callable[[], None]:
        def call() -> None:
            calls.append(name)
            if len(calls) - 1 in burst:
                time.sleep(0.02)

        return call

    sets = {f"shape{i}": {"a": candidate(f"a{i}"), "b": candidate(f"b{i}")} for i in range(3)}
    timed = kernel_choice.fastest_ms(sets)
    assert len(calls) == warm_ups * (1 + kernel_choice.REPEATS)
    assert calls[warm_ups : 2 * warm_ups] == ["a0", "b0", "a1", "b1", "a2", "b2"]
    for by_name in timed.values():
        assert set(by_name) == {"a", "b"}
        assert max(by_name.values()) < 10.0, timed


@pytest.mark.parametrize(
    "content",
    ["[]", "null", '{"choice": 5}', '{"choice": {"other": 1}}', '{"choice": []}', "{trunc"],
)
def test_a_cached_choice_of_the_wrong_shape_is_measured_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: str
) -> None:
    """Valid JSON of another shape in a choice file stopped every engine start (an
    AttributeError or KeyError in the core), and the resume it printed failed the same way."""
    monkeypatch.setenv("VBATCH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(
        kernel_choice, "free_cpus_while", free_while(float(torch.get_num_threads()))
    )
    assert kernel_choice.cached_choice("kind", {"n": 1}, lambda: {"pick": 1}, is_pick) == {
        "pick": 1
    }
    (path,) = (tmp_path / "kernel_choices").glob("kind-*.json")
    path.write_text(content)
    assert kernel_choice.cached_choice("kind", {"n": 1}, lambda: {"pick": 2}, is_pick) == {
        "pick": 2
    }
    assert json.loads(path.read_text())["choice"] == {"pick": 2}


def test_each_kinds_check_refuses_a_choice_it_could_not_use() -> None:
    from vbatch.layers.greedy_screen import TIMED_BATCHES, _is_screen_choice
    from vbatch.layers.quantization import _is_int8_choice, exact_int8_backends

    backend = exact_int8_backends()[0]
    assert _is_int8_choice({"backend": backend, "speedup": 1.5, "ms": {"fp32": 2.0}})
    assert not _is_int8_choice({"backend": "bogus", "speedup": 1.5, "ms": {"fp32": 2.0}})
    assert not _is_int8_choice({"backend": backend, "speedup": "fast", "ms": {}})
    batches = list(TIMED_BATCHES)
    sides = ["fp32"] * len(batches)
    assert _is_screen_choice(
        {"batches": batches, "sides": sides, "ms": {"fp32": [1.0] * len(batches)}}
    )
    assert not _is_screen_choice({"batches": batches, "sides": [], "ms": {}})
    assert not _is_screen_choice({"batches": [1], "sides": ["fp32"], "ms": {}})
