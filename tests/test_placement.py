"""Tests for data-parallel placement: CPU and GPU shares per core, routing by load and prefix."""

from __future__ import annotations

import random

import numpy as np
import pytest

from vbatch.client.placement import LoadBalancer, core_placements, split_cpus, visible_gpus
from vbatch.config import EngineConfig
from vbatch.errors import ConfigError


def test_threads_are_split_and_each_core_gets_its_own_cpus() -> None:
    assert split_cpus([0, 1], 2, 2) == [((0,), 1), ((1,), 1)]
    assert split_cpus([0, 1, 2, 3], 3, 2) == [((0, 1), 2), ((2, 3), 1)]
    assert split_cpus([4, 5, 6], 6, 2) == [((4, 5), 3), ((6,), 3)]
    # NOTE: fewer CPUs than cores: they are shared round-robin rather than refused.
    assert split_cpus([3], 2, 2) == [((3,), 1), ((3,), 1)]
    with pytest.raises(
        ConfigError, match=r"between 2 .*give --num-threads 2 or more, or -dp 1 or fewer"
    ):
        split_cpus([0, 1], 1, 2)


def test_cpu_placements_cover_this_process_cpus_without_overlap() -> None:
    cpus = sorted(__import__("os").sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs")
    placed = core_placements(EngineConfig(device="cpu"), 2)
    sets = [set(placement.cpus or ()) for _, placement in placed]
    assert sets[0] and sets[1] and not sets[0] & sets[1]
    assert sets[0] | sets[1] == set(cpus)
    assert sum(config.num_threads or 0 for config, _ in placed) == len(cpus)
    placed = core_placements(EngineConfig(device="cpu", num_threads=4), 2)
    assert [config.num_threads for config, _ in placed] == [2, 2]


def test_each_cuda_core_sees_one_visible_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5, 7")
    assert visible_gpus("cpu") == []
    assert visible_gpus("auto") == ["5", "7"]
    placed = core_placements(EngineConfig(device="cuda"), 2)
    assert [p.cuda_visible_devices for _, p in placed] == ["5", "7"]
    assert all(p.cpus is None for _, p in placed)
    with pytest.raises(ConfigError, match="needs one GPU per core, but 2 are visible"):
        core_placements(EngineConfig(device="cuda"), 3)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ConfigError, match="no GPU is visible"):
        core_placements(EngineConfig(device="cuda"), 2)


def prompt(group: int, row: int, shared: int = 64) -> bytes:
    return np.array([group] * shared + [1000 + row] * 20, dtype="<i4").tobytes()


def test_requests_go_to_the_least_loaded_core_not_round_robin() -> None:
    balancer = LoadBalancer(2, block_size=16, prefix_aware=False)
    assert balancer.place(prompt(0, 0), 1000) == 0
    # NOTE: round-robin would send the second and fourth to core 0 again.
    assert [balancer.place(prompt(0, i), 10) for i in range(1, 5)] == [1, 1, 1, 1]
    assert balancer.loads == [1000, 40] and balancer.num_live == [1, 4]
    balancer.release(0, 1000)
    assert balancer.place(prompt(0, 9), 10) == 0
    assert balancer.loads == [10, 40] and balancer.num_live == [1, 4]


@pytest.mark.parametrize("num_groups", [2, 5])
def test_rows_sharing_a_prefix_stay_on_one_core_while_loads_stay_close(num_groups: int) -> None:
    rng = random.Random(0)
    rows = [rng.randrange(num_groups) for _ in range(400)]
    shares = {}
    for aware in (True, False):
        balancer = LoadBalancer(2, block_size=16, prefix_aware=aware)
        placed: dict[int, list[int]] = {g: [] for g in range(num_groups)}
        live: list[int] = []
        worst = 0
        for i, group in enumerate(rows):
            core = balancer.place(prompt(group, i), 30)
            placed[group].append(core)
            live.append(core)
            if len(live) > 32:
                balancer.release(live.pop(0), 30)
            worst = max(worst, abs(balancer.loads[0] - balancer.loads[1]))
        shares[aware] = min(max(c.count(0), c.count(1)) / len(c) for c in placed.values())
        # NOTE: at most 33 rows of 30 in flight (mean load 495): the slack is 25% of the mean
        # plus the 64-token prefix; the row placed and a release from the other core add one
        # row's cost each.
        assert worst <= (0.25 * 495 + 64 if aware else 0) + 2 * 30, (aware, worst)
    assert shares[True] >= 0.8
    assert shares[False] <= 0.65
