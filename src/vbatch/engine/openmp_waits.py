"""The OpenMP wait settings an engine core is spawned with, chosen by the load on the machine at
the spawn, and their description for the manifest and the dashboard.

This module stays light (no torch): the CLI's entry imports it before spawning the core.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

# NOTE: libgomp reads these when torch loads it, so a core's are fixed when it is spawned.
_WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
WAITS_NOTE_VARIABLE = "VBATCH_OPENMP_WAITS"
# NOTE: libgomp's own default without a policy, about 3 ms of spinning, which also covers a
# step's serial Python between parallel regions (docs/performance.md: the AVX-512 EPYC's quiet
# 64-prompt job through the CLI, 29.7 s median of 4 rotated rounds against 33.2 s spinning 0.1 ms
# and 30.8 s spinning 1 ms). Load that arrives after the spawn makes the core drop to one thread
# (engine/cpu_share.py), which then waits at no barrier.
SPIN_COUNT = 300_000
_WINDOW_S = 0.03
_MARGIN = 0.5
T = TypeVar("T")


def free_cpus(window_s: float = _WINDOW_S) -> float | None:
    """How many of the CPUs this process may run on were free for a core over the next
    `window_s` seconds (None where /proc/stat cannot be read). Free is idle, or running this
    process, whose start-up work (imports, the input scan, in other threads) ends as its job
    begins."""
    return free_cpus_while(lambda: time.sleep(window_s))[1]


def free_cpus_while(work: Callable[[], T], min_window_s: float = 0.0) -> tuple[T, float | None]:
    """work()'s result, and how many of the CPUs this process may run on were free while it ran
    (idle, or running this process; None where /proc/stat cannot be read, or where work() took
    less than `min_window_s`: /proc/stat counts 10 ms ticks per CPU)."""
    try:
        cpus = {f"cpu{n}" for n in os.sched_getaffinity(0)}
        idle_before, own_before = cpu_seconds(cpus)
    except (AttributeError, OSError, ValueError, IndexError):
        return work(), None
    start = time.monotonic()
    result = work()
    elapsed = time.monotonic() - start
    try:
        idle_after, own_after = cpu_seconds(cpus)
    except (OSError, ValueError, IndexError):
        return result, None
    if elapsed <= 0 or elapsed < min_window_s:
        return result, None
    return result, (idle_after - idle_before + own_after - own_before) / elapsed


def cpu_seconds(cpus: set[str]) -> tuple[float, float]:
    """(idle seconds summed over `cpus`, this process's CPU seconds) so far: the free CPU time
    over an interval is the difference of two readings."""
    return idle_ticks(cpus) / os.sysconf("SC_CLK_TCK"), time.process_time()


def idle_ticks(cpus: set[str]) -> int:
    """Idle and I/O-wait ticks summed over `cpus`."""
    total = 0
    with open("/proc/stat") as f:
        for line in f:
            fields = line.split()
            if fields and fields[0] in cpus:
                total += int(fields[4]) + int(fields[5])
    return total


def openmp_waits(threads: int | None) -> dict[str, str]:
    """The OpenMP wait settings an engine core with `threads` threads starts under.

    Nothing where the user set either variable. Otherwise its threads spin briefly at a barrier
    before they sleep when the machine has a free CPU for each of them, and sleep at once when it
    has not: a spinning thread whose partner is descheduled burns the CPU the partner needs
    (docs/performance.md: 24 rows took 128-164 s spinning, 22-24 s passive, on a busy 2-core
    machine), while waking a sleeping one costs an idle machine 15% of a job.
    """
    if any(name in os.environ for name in _WAIT_VARIABLES):
        return {}
    wanted = threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
    free = free_cpus()
    waits = {"OMP_WAIT_POLICY": "PASSIVE"}
    if free is not None and free >= wanted - _MARGIN:
        waits["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
        waits[WAITS_NOTE_VARIABLE] = (
            f"spin {SPIN_COUNT}, then sleep ({free:.1f} CPUs free at start, {wanted} threads)"
        )
    else:
        seen = "unknown" if free is None else f"{free:.1f}"
        waits[WAITS_NOTE_VARIABLE] = f"sleep at once ({seen} CPUs free at start, {wanted} threads)"
    return waits


def describe_openmp_waits() -> str:
    """The engine core's OpenMP waits, for the manifest's and the dashboard's kernel notes."""
    ours = os.environ.get(WAITS_NOTE_VARIABLE)
    if ours:
        return f"OpenMP waits: {ours}"
    chosen = ", ".join(
        f"{name}={os.environ[name]}" for name in _WAIT_VARIABLES if name in os.environ
    )
    return f"OpenMP waits: the environment's ({chosen or 'libgomp defaults'})"


def set_core_waits(waits: dict[str, str]) -> None:
    """In a just-spawned core, before torch loads libgomp: take the waits its spawner chose
    (`openmp_waits`). The spawner passes them as an argument rather than through its own
    environment, which another thread may be forking from at the time (`-dp` spawns its cores
    from one thread each)."""
    os.environ.update(waits)
