"""StopControl: turns SIGTERM / SIGINT / SIGHUP / the drain deadline into a job's stop flags."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from types import TracebackType
from typing import Any


class StopNow(BaseException):
    """Raised by a signal handler to leave a blocking wait on the engine at once.

    A BaseException, like KeyboardInterrupt, so that no `except Exception` takes it for an error.
    """


class StopControl:
    """Stop flags for the job loop, set by signal handlers (STOP_SIGNALS) and by the loop.

    Invariants: handlers only set flags and take no locks; they raise StopNow only while
    `is_waiting` (the main thread is inside the engine client), never mid-write. The first stop
    request starts the drain deadline; a second signal, or the deadline, sets `stop_now`, as
    does the first signal while `starting` (the engine starts: no row runs yet to drain).
    """

    def __init__(self, drain_timeout_s: float) -> None:
        self.drain_timeout_s = max(drain_timeout_s, 0.001)
        self.is_waiting = False
        self.starting = False
        self.stop_requested = False
        self.stop_now = False
        self.drain_deadline: float | None = None
        self._timer: threading.Timer | None = None
        self._previous: dict[int, Any] = {}

    @property
    def is_stopping(self) -> bool:
        return self.stop_requested or self.stop_now

    def request_stop(self) -> None:
        """Stop admitting rows; in-flight rows get `drain_timeout_s` seconds to finish."""
        if self.stop_requested:
            return
        self.drain_deadline = time.monotonic() + self.drain_timeout_s
        self.stop_requested = True
        if self._timer is not None:
            self._timer.start()

    def _on_signal(self, signum: int, frame: Any) -> None:
        _stop_signal_seen.set()
        if not self.stop_requested:
            self.request_stop()
            if self.starting:
                self._on_deadline(signum, frame)
        else:
            self._on_deadline(signum, frame)

    def _on_deadline(self, signum: int, frame: Any) -> None:
        self.stop_now = True
        if self.is_waiting:
            raise StopNow

    def __enter__(self) -> StopControl:
        if threading.current_thread() is not threading.main_thread():
            return self
        handlers = {signum: self._on_signal for signum in taken_stop_signals()}
        handlers[signal.SIGALRM] = self._on_deadline
        self._previous = {signum: signal.signal(signum, fn) for signum, fn in handlers.items()}
        # NOTE: the deadline is a SIGALRM sent to the main thread, which interrupts a blocking
        # wait there; a timer thread rather than setitimer leaves other alarms alone.
        main_id = threading.main_thread().ident
        assert main_id is not None
        # NOTE: a longer wait (--drain-timeout 1e10, "forever") overflows the timer's clock.
        wait = min(self.drain_timeout_s, threading.TIMEOUT_MAX)
        self._timer = threading.Timer(wait, signal.pthread_kill, (main_id, signal.SIGALRM))
        self._timer.daemon = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.is_waiting = False
        if self._timer is not None:
            self._timer.cancel()
            if self._timer.is_alive():
                self._timer.join()
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}


# NOTE: SIGHUP (the terminal closed, the SSH session dropped) stops a job as SIGTERM does.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# NOTE: process-wide, set by the job's signal handlers; read by the command's own handlers.
_stop_signal_seen = threading.Event()
# NOTE: process-wide, set once a job's own handlers took the stop signals (StopOnSignal).
_job_took_signals = threading.Event()


def taken_stop_signals() -> list[int]:
    """The STOP_SIGNALS a job takes: SIGINT and SIGTERM always (docs/resume.md), SIGHUP unless
    it is ignored, as `nohup` makes it to keep a job running past its terminal."""
    return [
        signum
        for signum in STOP_SIGNALS
        if signum != signal.SIGHUP or signal.getsignal(signum) is not signal.SIG_IGN
    ]


def _after_stop_signal(signum: int, frame: Any) -> None:
    """The `vbatch` command's handler under the job's: once a job took the stop signals, a late
    one is ignored, so the exit status stays the job's (75 after a fast second Ctrl-C landing as
    the job exits, 0 after a signal landing as a finished job prints its summary); before that,
    it interrupts the command as a Ctrl-C does (`error: interrupted`, 130), where SIGTERM and
    SIGHUP had killed it without a word while it dispatched or checked its input."""
    if _stop_signal_seen.is_set() or _job_took_signals.is_set():
        return
    raise KeyboardInterrupt


@contextlib.contextmanager
def command_signals() -> Iterator[None]:
    """Around the `vbatch` command (not library use): under the job's handlers, a late stop
    signal is ignored once a job took the signals, through the interpreter's exit too."""
    _job_took_signals.clear()
    for signum in STOP_SIGNALS:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, _after_stop_signal)
    try:
        yield
    finally:
        if _stop_signal_seen.is_set() or _job_took_signals.is_set():
            for signum in STOP_SIGNALS:
                signal.signal(signum, signal.SIG_IGN)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """While a job is being created (before it exists): the stop signals the job will take
    (taken_stop_signals: SIGINT and SIGTERM even where they were ignored, SIGHUP unless it is)
    raise KeyboardInterrupt, so the command removes what it made and says it was interrupted
    (an ignored SIGINT left ignored here would be lost, and the job then run to its end)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, _raise_interrupt) for signum in taken_stop_signals()}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class StopOnSignal:
    """The taken stop signals raise StopNow at once, wherever the main thread is.

    For work that a crash at any point leaves safe (finalize: the journal decides what is done),
    around the engine loop's StopControl, which takes the signals over while it is active and
    gives them back on exit.
    """

    def __init__(self) -> None:
        self._previous: dict[int, Any] = {}

    def _on_signal(self, signum: int, frame: Any) -> None:
        _stop_signal_seen.set()
        raise StopNow

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            _job_took_signals.set()
            self._previous = {
                signum: signal.signal(signum, self._on_signal) for signum in taken_stop_signals()
            }
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
