"""`vbatch` and `python -m vbatch`: the command line, with the engine core spawned before the
CLI's own imports for the commands that run one core (engine/preload.py)."""

from __future__ import annotations

import atexit
import os
import sys
import threading

PRELOADING_COMMANDS = ("run", "resume")
# NOTE: these start several cores, or none in this process, or only print.
NOT_PRELOADING_OPTIONS = ("--help", "-h", "--ray", "--replicas", "--data-parallel-size", "-dp")
# NOTE: numpy's OpenBLAS starts a thread per CPU as it loads, and each spins ~0.1 s before it
# sleeps, beside the core's start-up: on the 2-CPU AVX-512 EPYC (Zen 4) a warm one-row job took
# 2.51 s with them and 2.32 s with one thread (medians of 6 interleaved runs). Neither the
# command nor its cores, which inherit this, compute through numpy's BLAS.
BLAS_THREADS = {"OPENBLAS_NUM_THREADS": "1"}


def runs_one_core(args: list[str]) -> bool:
    """Whether a command line (without the program name) runs one local engine core."""
    if not args or args[0] not in PRELOADING_COMMANDS:
        return False
    return not any(arg.split("=")[0].startswith(NOT_PRELOADING_OPTIONS) for arg in args[1:])


def main() -> None:
    for name, value in BLAS_THREADS.items():
        os.environ.setdefault(name, value)
    try:
        # NOTE: imported here, so that a Ctrl-C while they load is handled below.
        from vbatch.engine.preload import preload_core

        if runs_one_core(sys.argv[1:]):
            preload_core()
        from vbatch.cli import main as cli_main

        cli_main()
    except SystemExit as e:
        exit_now(e.code)
    except KeyboardInterrupt:
        # NOTE: Ctrl-C before the command installed its own handling (while it imports).
        print("error: interrupted", file=sys.stderr)
        exit_now(130)
    finally:
        _discard_preloaded()


def exit_now(code: int | str | None) -> None:
    """End the command with `code` as sys.exit would, less the interpreter's teardown.

    By the time a command returns, its job has closed every file and engine it opened. What is
    left is the teardown of ~600 modules, which took 0.11-0.15 s of a 3 s one-row job (mostly
    the collector's passes). The exit hooks still run (logging, multiprocessing, Ray), and the
    standard streams are flushed; with a non-daemon thread still running, the exit is the usual
    one, which waits for it.
    """
    if any(not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        raise SystemExit(code)
    _discard_preloaded()
    atexit._run_exitfuncs()
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:
        print(code, file=sys.stderr)
        status = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            status = status or 1
    os._exit(status)


def _discard_preloaded() -> None:
    preload = sys.modules.get("vbatch.engine.preload")
    if preload is not None:
        preload.discard_preloaded()


if __name__ == "__main__":
    main()
