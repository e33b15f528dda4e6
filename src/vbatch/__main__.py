"""`vbatch` and `python -m vbatch`: the command line, with the engine core spawned before the
CLI's own imports for the commands that run one core (engine/preload.py)."""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from typing import Any, TextIO

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


class TolerantStream:
    """The command's stderr: once a write or flush fails (the terminal closed, `2>/dev/full`, a
    pipe whose reader left), the rest of what it shows is dropped, rather than failing the job
    that was showing its progress. Everything else is the wrapped stream's."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.failed = False

    def write(self, text: str) -> int:
        if not self.failed:
            try:
                return self.stream.write(text)
            except OSError:
                self.failed = True
        return len(text)

    def flush(self) -> None:
        if not self.failed:
            try:
                self.stream.flush()
            except OSError:
                self.failed = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def guard_standard_streams() -> None:
    """Opens the null device on a closed fd 0, 1 or 2 (`2>&-`), so that no file the job opens
    takes that number (an engine core writes its stderr to fd 2), and makes stderr tolerant."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
    if sys.stderr is not None:
        sys.stderr = TolerantStream(sys.stderr)  # type: ignore[assignment]


def interrupt_on_stop_signals() -> None:
    """The stop signals a job takes (SIGINT and SIGTERM even where the command was started with
    them ignored, as `cmd &` in a script does; SIGHUP unless `nohup` ignores it) raise
    KeyboardInterrupt from the command's first line on, so one that lands while it still imports
    ends it as `error: interrupted` (130): an ignored SIGINT was lost there and the job ran to
    its end, and SIGTERM or SIGHUP killed it without a word. The command's and the job's own
    handlers take over later."""
    from vbatch.job.stopping import taken_stop_signals

    for signum in taken_stop_signals():
        signal.signal(signum, signal.default_int_handler)


def main() -> None:
    interrupt_on_stop_signals()
    guard_standard_streams()
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
    except (KeyboardInterrupt, RuntimeError) as e:
        # NOTE: Ctrl-C before the command installed its own handling (while it imports); Python
        # 3.11 wraps one that lands in a __set_name__ (a class body) in a RuntimeError.
        if isinstance(e, RuntimeError) and not isinstance(e.__cause__, KeyboardInterrupt):
            raise
        print("error: interrupted", file=sys.stderr)
        exit_now(130)
    except OSError as e:
        # NOTE: a command's errors are one line already (cli._guarded); what is left is its
        # printing to stdout (`vbatch status > /dev/full`).
        print(f"error: cannot write the command's output: {e.strerror or e}", file=sys.stderr)
        exit_now(1)
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
        if stream is None:
            continue
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
