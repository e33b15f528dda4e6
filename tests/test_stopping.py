"""Tests for StopControl: real signals to this process, the drain deadline, handler restore."""

from __future__ import annotations

import os
import signal
import time

import pytest

from vbatch.job.stopping import StopControl, StopNow, sigterm_interrupts


def test_first_signal_requests_a_drain_and_second_stops_now() -> None:
    # NOTE: compared with what was there, which need not be Python's default: under nohup or in
    # a background job SIGINT starts ignored.
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    with StopControl(drain_timeout_s=60) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.stop_requested and not stop.stop_now
        assert stop.drain_deadline is not None and stop.drain_deadline > time.monotonic() + 50
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.stop_now
    assert {signum: signal.getsignal(signum) for signum in before} == before


def test_stop_now_interrupts_only_a_wait_on_the_engine() -> None:
    with StopControl(drain_timeout_s=60) as stop:
        stop.request_stop()
        stop.is_waiting = True
        with pytest.raises(StopNow):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        stop.is_waiting = False


def test_drain_deadline_interrupts_a_blocking_wait() -> None:
    with StopControl(drain_timeout_s=0.05) as stop:
        stop.request_stop()
        stop.is_waiting = True
        started = time.monotonic()
        with pytest.raises(StopNow):
            time.sleep(5)
        assert time.monotonic() - started < 2 and stop.stop_now


def test_a_drain_timeout_past_the_timer_s_range_waits_without_a_traceback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--drain-timeout 1e10 ("forever"): the deadline's timer thread died with an
    OverflowError traceback on stderr."""
    import threading

    failures: list[object] = []
    monkeypatch.setattr(threading, "excepthook", failures.append)
    with StopControl(drain_timeout_s=1e10) as stop:
        stop.request_stop()
        time.sleep(0.2)
        assert stop.stop_requested and not stop.stop_now
    assert failures == []


def test_a_hangup_stops_a_job_unless_it_is_ignored_as_under_nohup() -> None:
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        with StopControl(drain_timeout_s=60) as stop:
            os.kill(os.getpid(), signal.SIGHUP)
            assert stop.stop_requested
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        with StopControl(drain_timeout_s=60) as stop:
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGHUP)
            assert not stop.stop_requested
    finally:
        signal.signal(signal.SIGHUP, previous)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_before_the_job_exists_an_ignored_sigint_or_sigterm_still_interrupts(signum: int) -> None:
    """As the running job takes them (started under `trap '' INT` or a script's `cmd &`): while
    the input is checked, the stop raises KeyboardInterrupt; an ignored SIGHUP stays ignored.
    Before, an ignored SIGINT was dropped there and the job ran to its end."""
    saved = {s: signal.getsignal(s) for s in (signum, signal.SIGHUP)}
    try:
        signal.signal(signum, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        with sigterm_interrupts():
            os.kill(os.getpid(), signal.SIGHUP)
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signum)
                time.sleep(5)
        assert signal.getsignal(signum) is signal.SIG_IGN
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
