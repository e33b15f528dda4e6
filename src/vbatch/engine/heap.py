"""The engine core's heap: glibc keeps the memory a step frees for the next step.

A step allocates and frees tens of MB of activations (a 2048-row prefill step's SwiGLU output
alone is 12.6 MB). glibc serves such blocks from fresh mappings, or from the heap that it trims
back to the system as soon as its free top passes a threshold that it sizes by the blocks freed
so far, so which steps get their memory back depends on what ran before them. In the CLI's core
on the AVX-512 EPYC (Zen 4), two of the 64-prompt e2e job's prefill steps page-faulted 180-190k
times each against ~30k in process, and the job took 0.38-0.96 million minor faults and
1.7-3.2 s of system CPU across runs; with fixed thresholds, 0.36 million and 1.3-1.7 s in every
run, the rest being the KV cache's first touches (docs/performance.md).

This module stays light (no torch): the core applies it before it builds the engine.
"""

from __future__ import annotations

import ctypes
import os
import sys

# NOTE: glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# NOTE: blocks from this size on get their own mapping (the KV cache, the weights); below it they
# come from the heap. glibc's own dynamic threshold stops growing here too.
MMAP_THRESHOLD = 32 << 20
# NOTE: the free memory at the heap's top that glibc keeps. A prefill step of 2048 rows on
# SmolLM2 faulted as little with 64 MB as with 128 or 256 MB, and the core's peak RSS did not move.
TRIM_THRESHOLD = 64 << 20
# NOTE: a user's own setting of either threshold wins.
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
_USER_TUNABLES = ("glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold")

_kept = False


def keep_freed_memory() -> bool:
    """Fix glibc's mmap and trim thresholds for this process (MMAP_THRESHOLD, TRIM_THRESHOLD);
    whether they were set. Not where the user set either (by MALLOC_*_ or GLIBC_TUNABLES), and
    not outside Linux or where the C library has no mallopt that takes them (musl's ignores
    them and returns 0)."""
    if not sys.platform.startswith("linux") or user_set_thresholds():
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    global _kept
    _kept = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    return _kept


def describe_heap() -> str:
    """This process's heap setting, for the manifest's and the dashboard's kernel notes."""
    if _kept:
        return (
            f"heap: freed memory kept up to {TRIM_THRESHOLD >> 20} MB, blocks from "
            f"{MMAP_THRESHOLD >> 20} MB mapped (glibc)"
        )
    if user_set_thresholds():
        return "heap: the environment's glibc thresholds"
    return "heap: the C library's defaults"


def user_set_thresholds() -> bool:
    """Whether this process's environment sets glibc's mmap or trim threshold."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    return any(name in os.environ for name in _USER_SETTINGS) or any(
        name in tunables for name in _USER_TUNABLES
    )
