"""An engine-core process spawned before its job is known, so that its torch import overlaps the
CLI's own start-up (its imports, option checks and input scan); the first single core the
process then starts adopts it and sends it the arguments of run_engine_core.

This module stays light (no torch, zmq or msgspec): the CLI's entry imports it first.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import multiprocessing.spawn
import os
import signal
import threading
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

from vbatch.engine.openmp_waits import openmp_waits, set_core_waits
from vbatch.engine.startup_gc import pause_collection

_OWN_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_JOIN_S = 5.0

_lock = threading.Lock()
_preloaded: tuple[Any, Connection] | None = None


def spawn_context() -> Any:
    """The start method of every engine core: spawned, not forked."""
    return multiprocessing.get_context("spawn")


@contextlib.contextmanager
def own_signals_held() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP held back: blocked in this thread, so a child started here
    inherits them blocked and a group-wide signal cannot kill it before it ignores them, and in
    the main thread also recorded by a handler of ours and raised again on exit, so that no
    KeyboardInterrupt lands inside multiprocessing's start (its child then read a cut message
    and printed an EOFError traceback)."""
    received: list[int] = []
    previous_handlers: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        # NOTE: a handler set outside Python reads as None and cannot be put back, so it stays.
        previous_handlers = {
            signum: signal.signal(signum, lambda signum, frame: received.append(signum))
            for signum in _OWN_SIGNALS
            if signal.getsignal(signum) is not None
        }
    previous_mask = None
    if hasattr(signal, "pthread_sigmask"):
        previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _OWN_SIGNALS)
    try:
        yield
    finally:
        if previous_mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
        for signum, handler in previous_handlers.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(received):
            signal.raise_signal(signum)


@contextlib.contextmanager
def main_module_hidden() -> Iterator[None]:
    """Start a spawn child that does not run the parent's main module again.

    The core's target and arguments are vbatch's own, so the child needs nothing from the user's
    script; without its main module it neither runs an unguarded script's top level a second time
    nor pays for importing it (the CLI's own modules, before the core's torch import).
    """
    # NOTE: Process.start() asks multiprocessing.spawn.get_preparation_data what the child
    # imports as __mp_main__; a filter, installed once, drops that for starts in this thread
    # only. Hiding __main__'s __file__ and __spec__ instead had the user's other threads (a
    # script reading its input while the core starts, its own spawn pools) see them missing.
    with _lock:
        if multiprocessing.spawn.get_preparation_data is not _preparation_data:
            _wrapped.append(multiprocessing.spawn.get_preparation_data)
            multiprocessing.spawn.get_preparation_data = _preparation_data
    _main_hidden.active = True
    try:
        yield
    finally:
        _main_hidden.active = False


_main_hidden = threading.local()
_wrapped: list[Callable[[str], dict[str, Any]]] = []
_MAIN_KEYS = ("init_main_from_name", "init_main_from_path")


def _preparation_data(name: str) -> dict[str, Any]:
    data = _wrapped[-1](name)
    if getattr(_main_hidden, "active", False):
        for key in _MAIN_KEYS:
            data.pop(key, None)
    return data


def preload_core() -> None:
    """Spawn an engine-core process now; it imports torch and the engine, then waits."""
    global _preloaded
    ctx = spawn_context()
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(
        target=_run_preloaded,
        args=(reader, openmp_waits(None)),
        name="vbatch-engine-core",
        daemon=True,
    )
    with own_signals_held(), main_module_hidden():
        proc.start()
        reader.close()
        with _lock:
            _preloaded = (proc, writer)


def adopt_preloaded(args: tuple[Any, ...]) -> Any | None:
    """The preloaded core, now running run_engine_core(*args), or None where there is none (or
    it died: then the caller spawns its own, whose failure is reported as usual)."""
    global _preloaded
    with _lock:
        taken, _preloaded = _preloaded, None
    if taken is None:
        return None
    proc, writer = taken
    try:
        writer.send(args)
    except OSError:
        proc.join(_JOIN_S)
        return None
    finally:
        writer.close()
    return proc


def discard_preloaded() -> None:
    """Kill a preloaded core that no job adopted; it holds nothing yet (no file, no socket), and
    would otherwise finish its torch import before it saw its pipe closed."""
    global _preloaded
    with _lock:
        taken, _preloaded = _preloaded, None
    if taken is None:
        return
    proc, writer = taken
    writer.close()
    proc.kill()
    proc.join()


def _run_preloaded(conn: Connection, waits: dict[str, str]) -> None:
    """Process entry: ignore the parent's signals, take the OpenMP `waits`, import the engine,
    then run the core with the arguments sent on `conn`; exit at once if the parent closes it
    unused (or dies)."""
    pause_collection()
    set_core_waits(waits)
    for signum in _OWN_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _OWN_SIGNALS)
    importlib.import_module("vbatch.engine.encoder_core")
    try:
        args = conn.recv()
    except (EOFError, OSError):
        os._exit(0)
    conn.close()
    from vbatch.engine.core_process import run_engine_core

    run_engine_core(*args)
