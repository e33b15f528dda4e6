"""EngineCoreClient: spawns the engine core, handshakes, and owns its sockets from one thread."""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import queue
import shutil
import signal
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import zmq

from vbatch.config import EngineConfig
from vbatch.errors import EngineDeadError, EngineStartupError, VbatchError
from vbatch.protocol import (
    Abort,
    AddRequest,
    ClientMessage,
    EngineError,
    EngineOutputs,
    Ready,
    SchedulerStats,
    Shutdown,
    StartupFailed,
    StartupProgress,
    Utility,
    UtilityResult,
    client_decoder,
    encoder,
)

_POLL_MS = 500
_RETRY_SEND_MS = 10
_LAST_WORDS_MS = 300
_MAIN_GUARD_HINT = (
    ' If you call vbatch from a script, put that code under `if __name__ == "__main__":`; '
    "the engine core is started with multiprocessing 'spawn', which re-imports your script."
)


class EngineCoreClient:
    """The user-side end of the engine core: submit requests, read step outputs, shut down.

    Invariants: only the socket thread touches zmq sockets and spawns/joins the core; the user's
    thread talks to it through `_send_q` plus a wake pipe and reads `_result_q`; once `_dead` is
    set, every call raises it.
    """

    def __init__(
        self, config: EngineConfig, on_progress: Callable[[str], None] | None = None
    ) -> None:
        self.config = config
        self.latest_stats: SchedulerStats | None = None
        self._send_q: queue.SimpleQueue[ClientMessage] = queue.SimpleQueue()
        self._result_q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._stopping = threading.Event()
        self._dead: VbatchError | None = None
        self._closed = False
        self._shutdown_timeout = 5.0
        self._calls: dict[int, Future[SchedulerStats]] = {}
        self._call_ids = itertools.count()
        self._proc: multiprocessing.process.BaseProcess | None = None
        self.ipc_dir = tempfile.mkdtemp(prefix="vbatch-")
        self._thread = threading.Thread(target=self._run, name="vbatch-client")
        self._thread.start()
        try:
            self.info: Ready = self._wait_ready(on_progress)
        except BaseException:
            self.shutdown()
            raise

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def add_requests(self, reqs: Sequence[AddRequest]) -> None:
        """Queue requests for the core; raises SamplingParamsError (sending none of them) if
        any one's params are invalid now, e.g. a field set after construction."""
        self._check_alive()
        checked: set[int] = set()
        for req in reqs:
            params = req.sampling_params
            if id(params) not in checked:
                params.validate(self.info.vocab_size)
                checked.add(id(params))
        for req in reqs:
            self._send_q.put(req)
        self._wake()

    def abort(self, request_ids: Sequence[str], indices: Sequence[int] | None = None) -> None:
        """Abort these requests; with `indices`, only sample indices[j] of request_ids[j]."""
        if request_ids and self._dead is None and not self._closed:
            self._send_q.put(Abort(list(request_ids), None if indices is None else list(indices)))
            self._wake()

    def get_outputs(self, timeout: float | None = None) -> list[EngineOutputs]:
        """Outputs of one or more engine steps, in order; [] on timeout; raises if the core died."""
        self._check_alive()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = _POLL_MS / 1000 if deadline is None else deadline - time.monotonic()
            try:
                item = self._result_q.get(timeout=max(0.0, min(wait, _POLL_MS / 1000)))
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    return []
                continue
            if isinstance(item, BaseException):
                raise item
            return item

    def get_stats(self, timeout: float = 5.0) -> SchedulerStats:
        """Ask the core for fresh scheduler stats (a Utility round trip)."""
        self._check_alive()
        call_id = next(self._call_ids)
        future: Future[SchedulerStats] = Future()
        self._calls[call_id] = future
        self._send_q.put(Utility(call_id, "stats"))
        self._wake()
        try:
            return future.result(timeout)
        except FutureTimeout:
            self._calls.pop(call_id, None)
            self._check_alive()
            raise EngineDeadError(f"the engine core did not answer within {timeout:g} s") from None

    def shutdown(self, timeout: float = 5.0) -> None:
        """Send Shutdown, wait for the core to exit (kill it after `timeout`), clean up."""
        if self._closed:
            return
        self._closed = True
        self._shutdown_timeout = timeout
        self._stopping.set()
        self._wake()
        self._thread.join(timeout + 5.0)
        proc = self._proc
        if proc is not None and proc.is_alive():
            proc.kill()
            proc.join(5.0)
        os.close(self._wake_r)
        os.close(self._wake_w)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead
        if self._closed:
            raise EngineDeadError("the engine has been shut down")

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"\0")

    def _wait_ready(self, on_progress: Callable[[str], None] | None) -> Ready:
        limit = self.config.startup_timeout_s
        deadline = time.monotonic() + limit
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EngineStartupError(f"the engine core did not report READY within {limit:g} s")
            try:
                item = self._result_q.get(timeout=min(remaining, _POLL_MS / 1000))
            except queue.Empty:
                continue
            if isinstance(item, StartupProgress):
                if on_progress is not None:
                    on_progress(item.stage)
            elif isinstance(item, Ready):
                return item
            elif isinstance(item, StartupFailed):
                raise EngineStartupError(f"the engine core failed to start: {item.message}")
            elif isinstance(item, BaseException):
                hint = _MAIN_GUARD_HINT if "exited with code" in str(item) else ""
                raise EngineStartupError(f"{item} before it was ready.{hint}") from None

    def _run(self) -> None:
        ctx = zmq.Context(1)
        req_sock = ctx.socket(zmq.PUSH)
        out_sock = ctx.socket(zmq.PULL)
        try:
            for sock in (req_sock, out_sock):
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, 0)
                sock.setsockopt(zmq.RCVHWM, 0)
            input_addr = _bind(req_sock, self.ipc_dir, "input")
            output_addr = _bind(out_sock, self.ipc_dir, "output")
            self._proc = _spawn_core(self.config, input_addr, output_addr)
            self._loop(req_sock, out_sock, self._proc)
        except BaseException as e:
            self._fail(EngineDeadError(f"the engine client thread failed: {e!r}"))
            if self._proc is not None and self._proc.is_alive():
                self._proc.kill()
                self._proc.join(5.0)
        finally:
            req_sock.close()
            out_sock.close()
            ctx.term()
            shutil.rmtree(self.ipc_dir, ignore_errors=True)

    def _loop(self, req_sock: zmq.Socket, out_sock: zmq.Socket, proc: Any) -> None:
        poller = zmq.Poller()
        poller.register(out_sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        poller.register(proc.sentinel, zmq.POLLIN)
        pending: deque[ClientMessage] = deque()
        core_error: list[EngineError] = []
        main = threading.main_thread()
        while True:
            events = dict(poller.poll(_RETRY_SEND_MS if pending else _POLL_MS))
            if out_sock in events:
                self._receive(out_sock, core_error)
            if self._wake_r in events:
                _drain_pipe(self._wake_r)
            _send_all(req_sock, self._send_q, pending)
            if self._stopping.is_set() or not main.is_alive():
                self._stop_core(req_sock, out_sock, proc, core_error)
                return
            if proc.sentinel in events or not proc.is_alive():
                if out_sock.poll(_LAST_WORDS_MS):
                    self._receive(out_sock, core_error)
                proc.join(1.0)
                self._fail(EngineDeadError(_death_message(proc, core_error)))
                return

    def _stop_core(
        self, req_sock: zmq.Socket, out_sock: zmq.Socket, proc: Any, core_error: list
    ) -> None:
        try:
            req_sock.send(encoder.encode(Shutdown()), zmq.NOBLOCK)
        except zmq.Again:
            proc.terminate()
        deadline = time.monotonic() + self._shutdown_timeout
        while proc.is_alive() and time.monotonic() < deadline:
            if out_sock.poll(50):
                self._receive(out_sock, core_error)
        if proc.is_alive():
            proc.kill()
        proc.join(5.0)
        self._fail(EngineDeadError("the engine has been shut down"))

    def _receive(self, sock: zmq.Socket, core_error: list[EngineError]) -> None:
        """Drain every waiting message; the outputs of many steps go out as one list."""
        batch: list[EngineOutputs] = []
        while True:
            try:
                frame = sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            msg = client_decoder.decode(frame.buffer)
            if isinstance(msg, EngineOutputs):
                if msg.stats is not None:
                    self.latest_stats = msg.stats
                if not msg.is_empty:
                    batch.append(msg)
            elif isinstance(msg, UtilityResult):
                future = self._calls.pop(msg.call_id, None)
                if future is not None and msg.error is not None:
                    future.set_exception(VbatchError(msg.error))
                elif future is not None:
                    future.set_result(msg.result)
            elif isinstance(msg, EngineError):
                core_error.append(msg)
            else:
                self._result_q.put(msg)
        if batch:
            self._result_q.put(batch)

    def _fail(self, error: VbatchError) -> None:
        if self._dead is None:
            self._dead = error
        self._result_q.put(error)
        for call_id in list(self._calls):
            future = self._calls.pop(call_id, None)
            if future is not None:
                future.set_exception(error)


def _spawn_core(config: EngineConfig, input_addr: str, output_addr: str) -> Any:
    from vbatch.engine.core_process import run_engine_core

    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(
        target=run_engine_core,
        args=(config, input_addr, output_addr, os.getpid()),
        name="vbatch-engine-core",
        daemon=True,
    )
    proc.start()
    return proc


def _bind(sock: zmq.Socket, ipc_dir: str, name: str) -> str:
    path = os.path.join(ipc_dir, name)
    # NOTE: unix socket paths are limited to ~107 bytes; fall back to loopback tcp.
    if zmq.has("ipc") and len(path) < 100:
        sock.bind(f"ipc://{path}")
        return f"ipc://{path}"
    sock.bind("tcp://127.0.0.1:*")
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def _send_all(sock: zmq.Socket, send_q: queue.SimpleQueue, pending: deque) -> None:
    while True:
        if not pending:
            try:
                pending.append(send_q.get_nowait())
            except queue.Empty:
                return
        try:
            sock.send(encoder.encode(pending[0]), zmq.NOBLOCK)
        except zmq.Again:
            return
        pending.popleft()


def _drain_pipe(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _death_message(proc: Any, core_error: list[EngineError]) -> str:
    if core_error:
        return f"the engine core failed: {core_error[0].message}"
    code = proc.exitcode
    if code is not None and code < 0:
        name = signal.Signals(-code).name
        oom = " (possibly the out-of-memory killer)" if -code == signal.SIGKILL else ""
        return f"the engine core (pid {proc.pid}) was killed by signal {name}{oom}"
    return f"the engine core (pid {proc.pid}) exited with code {code}"
