"""Kernel defaults chosen by measurement: the candidates timed on the model's shapes, once per
machine and shape set, the decision cached in the cache directory (a decision timed while other
processes took the CPUs is timed again at the first start that finds them free)."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from vbatch.engine.cpu_share import BUSY_MARGIN
from vbatch.engine.openmp_waits import free_cpus, free_cpus_while
from vbatch.layers.native import cache_dir, cpu_flags, library_key

# NOTE: every switch that changes which kernels torch, oneDNN, MKL, FBGEMM or csrc/ run, so an
# emulated AVX2 run never reads a decision measured without the emulation, or the reverse.
ISA_SWITCHES = (
    "ATEN_CPU_CAPABILITY",
    "ONEDNN_MAX_CPU_ISA",
    "MKL_ENABLE_INSTRUCTIONS",
    "FBGEMM_ENABLE_INSTRUCTIONS",
    "VBATCH_NATIVE_MARCH",
)
REPEATS = 5
CHOICES_VERSION = 6
# NOTE: /proc/stat counts in ticks of 10 ms per CPU, so a reading over a shorter window is too
# coarse to tell half a CPU apart.
LOAD_WINDOW_S = 0.1


def machine_key() -> dict[str, Any]:
    """What a timing depends on besides the shapes: the CPU, its flags, torch, the ISA switches,
    the thread count and the native library's build (a changed kernel is timed again)."""
    model_name = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model_name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": model_name,
        "flags": hashlib.sha256(cpu_flags().encode()).hexdigest()[:12],
        "torch": torch.__version__,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "switches": {name: os.environ[name] for name in ISA_SWITCHES if name in os.environ},
        "threads": torch.get_num_threads(),
        "native": library_key(),
    }


def fastest_ms(sets: dict[str, dict[str, Callable[[], object]]]) -> dict[str, dict[str, float]]:
    """Per set, each candidate's fastest time in ms over REPEATS calls: one warm-up call each,
    then REPEATS rounds that each call every candidate of every set once, so that one
    candidate's calls spread over the whole measurement. The fastest, not the median: another
    process on the host only ever adds time, and with few calls a median still carries it
    (measured on a shared 2-core host: 3-call medians picked the GEMM library that was 10-20%
    slower at 2048 rows). Spread, not back to back: a burst of load of a few ms from another
    thread or process had covered all 5 calls of a small shape, and the pick for SmolLM2's o
    projection at 1 and 8 rows became a kernel 1.5-2x slower there."""
    for candidates in sets.values():
        for fn in candidates.values():
            fn()
    times = {key: {name: [] for name in candidates} for key, candidates in sets.items()}
    for _ in range(REPEATS):
        for key, candidates in sets.items():
            for name, fn in candidates.items():
                start = time.perf_counter()
                fn()
                times[key][name].append((time.perf_counter() - start) * 1e3)
    return {
        key: {name: round(min(ts), 3) for name, ts in by_name.items()}
        for key, by_name in times.items()
    }


def is_busy(free: float | None) -> bool:
    """Whether `free` CPUs (openmp_waits.free_cpus) left this process's threads short, as
    engine/cpu_share.py counts it."""
    return free is not None and free < torch.get_num_threads() - BUSY_MARGIN


@functools.cache
def is_quiet_now() -> bool:
    """Whether the machine is free for this process's threads, read once per process."""
    return not is_busy(free_cpus(LOAD_WINDOW_S))


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def cached_choice(
    kind: str,
    shapes: dict[str, int],
    measure: Callable[[], dict[str, Any]],
    is_valid: Callable[[Any], bool],
) -> dict[str, Any]:
    """`measure()`'s result for this kind, machine and shape set: read from the cache, or
    measured now and written there (best effort: an unwritable cache only costs a re-measure).
    A cached entry that is not JSON, or whose choice `is_valid` refuses (or cannot read), is
    measured again and replaced, so a damaged cache file cannot stop an engine's start.

    A result measured while other processes took the CPUs is written as such: it serves the
    starts that find the machine busy too, and the first that finds it quiet measures again
    (on a shared 2-core host, a choice timed beside another job picked a GEMM 35% slower at
    decode rows, and kept it)."""
    key = {"kind": kind, "shapes": shapes, "machine": machine_key(), "version": CHOICES_VERSION}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_dir() / "kernel_choices" / f"{kind}-{digest}.json"
    try:
        entry = json.loads(path.read_text())
        choice = entry["choice"]
        if is_valid(choice) and not (entry.get("under_load", False) and is_quiet_now()):
            return choice
    except (OSError, ValueError, LookupError, TypeError, AttributeError):
        pass
    choice, free = free_cpus_while(measure, LOAD_WINDOW_S)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # NOTE: the pid alone is not unique where cores in containers share a cache.
        tmp = path.with_suffix(f".{os.getpid()}-{secrets.token_hex(4)}.tmp")
        entry = {"key": key, "choice": choice, "under_load": is_busy(free)}
        tmp.write_text(json.dumps(entry, indent=1))
        tmp.replace(path)
    except OSError:
        pass
    return choice
