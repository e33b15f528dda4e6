"""The thread count of a running CPU engine core: its own, or one while other processes want the
CPUs it runs on.

A step's parallel regions end at a barrier where its threads wait for each other. When another
process takes one of the core's CPUs, every region waits for the descheduled thread's next time
slice, and a thread spinning at the barrier (engine/openmp_waits.py) burns CPU the other process
wants. The spawn-time choice of waits cannot see load that arrives later, so the core watches: on
the AVX-512 EPYC (Zen 4), 32 chat prompts x 64 tokens with one CPU-bound process started 3 s into
the job took 34.6 s at two threads spinning 0.1 ms, 38.2 s spinning 3 ms, and 32.2 s at one
thread (quiet: 16.4, 15.4 and 24.8 s). A core therefore drops to one thread while other processes
leave it less than its thread count less half a CPU, and takes its threads back once they leave
it all but a quarter. The CPU kernels compute each output element on one thread, so the count
does not change a result's bits (tests/test_cpu_share.py).

This module stays light (no torch): the engine-core process imports it before torch.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from vbatch.engine.heap import describe_heap
from vbatch.engine.openmp_waits import cpu_seconds, describe_openmp_waits

logger = logging.getLogger(__name__)

SAMPLE_S = 0.5
BUSY_MARGIN = 0.5
QUIET_MARGIN = 0.25
BUSY_SAMPLES = 2
QUIET_SAMPLES = 4


def shares_cpus(threads: int, device_type: str, thread_invariant: bool) -> bool:
    """Whether a core with these settings gives up threads under contention: a CPU core of two
    threads or more on a system that reports CPU affinity, whose results do not depend on its
    thread count (`thread_invariant`: MKL's and oneDNN's GEMMs may split a sum across threads,
    so only a model whose linears all run the native kernel qualifies)."""
    return (
        device_type == "cpu"
        and threads >= 2
        and thread_invariant
        and hasattr(os, "sched_getaffinity")
    )


def cpu_notes(threads: int, thread_invariant: bool) -> list[str]:
    """A CPU core's kernel notes for the manifest and the dashboard: its OpenMP waits, its heap
    (engine/heap.py) and, where it shares its CPUs, its thread count."""
    notes = [describe_openmp_waits(), describe_heap()]
    if shares_cpus(threads, "cpu", thread_invariant):
        notes.append(f"threads: {threads}, one while other processes want these CPUs")
    return notes


class CpuShare:
    """Samples how much of a core's CPUs is free to it (`sample`, from its watchdog thread) and
    sets the thread count of its next step (`apply`, from its busy loop).

    Free is the CPUs' idle time plus the core's own CPU time (openmp_waits.cpu_seconds), per
    second, over the last SAMPLE_S. Invariant: `wanted` is `threads` or 1.
    """

    def __init__(
        self,
        threads: int,
        cpus: set[int],
        set_threads: Callable[[int], None],
        read: Callable[[], tuple[float, float]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.threads = threads
        self.wanted = threads
        self._applied = threads
        self._set_threads = set_threads
        names = {f"cpu{n}" for n in cpus}
        self._read = read or (lambda: cpu_seconds(names))
        self._clock = clock
        self._last: tuple[float, float, float] | None = None
        self._busy = 0
        self._quiet = 0

    def sample(self) -> None:
        """Take a reading if SAMPLE_S has passed since the last one, and update `wanted`."""
        now = self._clock()
        if self._last is not None and now - self._last[0] < SAMPLE_S:
            return
        try:
            reading = (now, *self._read())
        except (OSError, ValueError, IndexError):
            return
        last, self._last = self._last, reading
        if last is None:
            return
        free = (reading[1] - last[1] + reading[2] - last[2]) / (now - last[0])
        self._busy = self._busy + 1 if free < self.threads - BUSY_MARGIN else 0
        self._quiet = self._quiet + 1 if free >= self.threads - QUIET_MARGIN else 0
        if self.wanted == self.threads and self._busy >= BUSY_SAMPLES:
            self.wanted = 1
        elif self.wanted == 1 and self._quiet >= QUIET_SAMPLES:
            self.wanted = self.threads

    def apply(self) -> None:
        """Set the thread count `sample` chose, if it changed."""
        wanted = self.wanted
        if wanted == self._applied:
            return
        self._set_threads(wanted)
        self._applied = wanted
        logger.info("engine core: %d thread(s) (other processes' load on its CPUs)", wanted)
