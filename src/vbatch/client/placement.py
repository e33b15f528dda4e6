"""Data-parallel placement: each engine core's CPUs or GPU, and the core each request goes to."""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import replace

from vbatch.config import CorePlacement, EngineConfig
from vbatch.errors import ConfigError

_NVIDIA_GPUS_DIR = "/proc/driver/nvidia/gpus"
# NOTE: a row's prefix key covers at most this many prompt blocks (512 tokens at block 16).
MAX_PREFIX_BLOCKS = 32
MAX_PREFIX_KEYS = 1 << 16
# NOTE: a core holding a row's prefix takes the row while its load stays within this fraction
# of the mean load (plus the prefix's own tokens) above the least loaded core's.
PREFIX_SLACK = 0.25


def split_cpus(
    cpus: list[int], num_threads: int, num_cores: int
) -> list[tuple[tuple[int, ...], int]]:
    """(CPU set, thread count) per core: `num_threads` split as evenly as possible, and `cpus`
    cut into disjoint contiguous runs (shared round-robin when there are fewer CPUs than cores)."""
    if num_threads < num_cores:
        raise ConfigError(
            f"--num-threads {num_threads} cannot be split between {num_cores} data-parallel "
            f"cores; each needs at least one thread: give --num-threads {num_cores} or more, or "
            f"-dp {num_threads} or fewer (a resumed job keeps its --num-threads)"
        )
    threads = [num_threads // num_cores + (i < num_threads % num_cores) for i in range(num_cores)]
    if len(cpus) < num_cores:
        return [((cpus[i % len(cpus)],), threads[i]) for i in range(num_cores)]
    result = []
    start = 0
    for i in range(num_cores):
        size = len(cpus) // num_cores + (i < len(cpus) % num_cores)
        result.append((tuple(cpus[start : start + size]), threads[i]))
        start += size
    return result


def visible_gpus(device: str) -> list[str]:
    """The GPUs the cores may use, as CUDA_VISIBLE_DEVICES entries, read without torch: the
    parent's CUDA_VISIBLE_DEVICES, else the NVIDIA driver's list; [] on CPU."""
    if device == "cpu":
        return []
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [entry.strip() for entry in listed.split(",") if entry.strip()]
    try:
        num_gpus = len(os.listdir(_NVIDIA_GPUS_DIR))
    except OSError:
        num_gpus = 0
    return [str(i) for i in range(num_gpus)]


def core_placements(
    config: EngineConfig, num_cores: int
) -> list[tuple[EngineConfig, CorePlacement]]:
    """Each core's config and placement: one visible GPU each on CUDA; on CPU a share of
    `num_threads` (the total; default: the CPUs this process may use) and its own CPUs."""
    gpus = visible_gpus(config.device)
    if gpus:
        if len(gpus) < num_cores:
            raise ConfigError(
                f"--data-parallel-size {num_cores} needs one GPU per core, but {len(gpus)} "
                f"{'is' if len(gpus) == 1 else 'are'} visible"
            )
        return [(config, CorePlacement(cuda_visible_devices=gpus[i])) for i in range(num_cores)]
    if config.device == "cuda":
        raise ConfigError("--device cuda with --data-parallel-size, but no GPU is visible")
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    num_threads = config.num_threads or max(len(cpus), num_cores)
    if not cpus:
        threads = split_cpus([0], num_threads, num_cores)
        return [(replace(config, num_threads=t), CorePlacement()) for _, t in threads]
    return [
        (replace(config, num_threads=t), CorePlacement(cpus=cpu_set))
        for cpu_set, t in split_cpus(cpus, num_threads, num_cores)
    ]


def prefix_keys(prompt_token_ids: bytes, block_size: int) -> list[int]:
    """Chained keys of the prompt's first full blocks (int32 token bytes), shortest first."""
    step = 4 * block_size
    num_blocks = min(len(prompt_token_ids) // step, MAX_PREFIX_BLOCKS)
    keys = []
    key = 0
    for i in range(num_blocks):
        key = hash((key, prompt_token_ids[i * step : (i + 1) * step]))
        keys.append(key)
    return keys


class LoadBalancer:
    """Picks a core for each request by load: the sum of its live requests' costs (prompt
    tokens plus n * max_tokens), and, with `prefix_aware`, the core that first took a request
    with the same leading prompt blocks while its load stays within the slack.

    Invariants: `loads[i]` is the cost of the requests placed on core i and not yet released;
    the prefix map holds at most MAX_PREFIX_KEYS keys, least recently used dropped first.
    """

    def __init__(self, num_cores: int, block_size: int, prefix_aware: bool = True) -> None:
        self.loads = [0] * num_cores
        self.num_live = [0] * num_cores
        self.block_size = block_size
        self.prefix_aware = prefix_aware
        self._prefix_core: OrderedDict[int, int] = OrderedDict()

    def place(self, prompt_token_ids: bytes, cost: int) -> int:
        loads = self.loads
        core = min(range(len(loads)), key=loads.__getitem__)
        keys = prefix_keys(prompt_token_ids, self.block_size) if self.prefix_aware else []
        for depth in range(len(keys), 0, -1):
            owner = self._prefix_core.get(keys[depth - 1])
            if owner is None:
                continue
            mean = sum(loads) / len(loads)
            slack = PREFIX_SLACK * mean + depth * self.block_size
            if loads[owner] - loads[core] <= slack:
                core = owner
            break
        # NOTE: a prefix stays with the core that first took it; a row sent elsewhere because
        # that core was busy does not move it (both cores then cache it, but rows keep going
        # to the first).
        for key in keys:
            self._prefix_core.setdefault(key, core)
            self._prefix_core.move_to_end(key)
        while len(self._prefix_core) > MAX_PREFIX_KEYS:
            self._prefix_core.popitem(last=False)
        loads[core] += cost
        self.num_live[core] += 1
        return core

    def release(self, core: int, cost: int) -> None:
        self.loads[core] -= cost
        self.num_live[core] -= 1
