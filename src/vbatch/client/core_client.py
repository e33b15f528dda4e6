"""EngineCoreClient: spawns the engine core, handshakes, and owns its sockets from one thread."""

from __future__ import annotations

import atexit
import contextlib
import itertools
import multiprocessing
import multiprocessing.util  # NOTE: registers its exit hook before ours (see start())
import os
import queue
import re
import shutil
import signal
import tempfile
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import zmq

from vbatch.config import (
    FIRST_STEP_FACTOR,
    IDLE_CPU_FRACTION,
    SLOW_STEP_FACTOR,
    CorePlacement,
    EngineConfig,
)
from vbatch.engine.openmp_waits import openmp_waits
from vbatch.engine.preload import adopt_preloaded, main_module_hidden, spawn_context
from vbatch.errors import EngineDeadError, EngineStartupError, SettledStartupError, VbatchError
from vbatch.protocol import (
    Abort,
    AddRequest,
    ClientMessage,
    EngineError,
    EngineOutputs,
    FinishReason,
    Heartbeat,
    Ready,
    SampleFinish,
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
# NOTE: a socket-thread iteration this much later than due means this process was stopped
# (SIGSTOP, Ctrl-Z) or starved; the core's silence is then counted from now.
_STALL_S = 2.0
_IPC_PREFIX = "vbatch-"
_IPC_DIR_NAME = re.compile(r"vbatch-(\d+)-[A-Za-z0-9_]+")
_OWN_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


def check_request_params(reqs: Sequence[AddRequest], vocab_size: int) -> None:
    """Raise SamplingParamsError if any request's params name a token id outside the vocabulary;
    each distinct params object is checked once (SamplingParams validates itself on
    construction and on every assignment, so nothing else can be wrong)."""
    checked: set[int] = set()
    for req in reqs:
        params = req.sampling_params
        if id(params) not in checked:
            params.check_vocab(vocab_size)
            checked.add(id(params))


class EngineCoreClient:
    """The user-side end of the engine core: submit requests, read step outputs, shut down.

    Lifetime: the core lives until `shutdown()`, until this client is garbage collected (a
    finalizer), or until the interpreter exits (an atexit hook, which runs after every
    non-daemon thread has finished, so a worker thread outliving the main thread keeps its
    engine). The socket thread is a daemon and holds only the `_Connection`, never the client.
    """

    def __init__(
        self,
        config: EngineConfig,
        on_progress: Callable[[str], None] | None = None,
        *,
        placement: CorePlacement | None = None,
        on_result: Callable[[], None] | None = None,
        wait: bool = True,
    ) -> None:
        """`placement` pins the core (one of several); `on_result` is called, on the socket
        thread, after each item that get_outputs would return (outputs or the core's death).
        With `wait=False` the core starts in the background and `wait_ready()` must follow."""
        if multiprocessing.current_process().daemon:
            raise EngineStartupError(
                "an engine core cannot start in a daemonic process (a multiprocessing Pool's "
                "worker), which Python forbids children; start the engine in a non-daemonic "
                "process (a spawn `Process`), or use data parallelism (-dp N) for several cores"
            )
        self.config = config
        sweep_stale_ipc_dirs()
        self._conn = _Connection(config, placement, on_result)
        # NOTE: the hook and the finalizer hold the connection, not the client, so dropping the
        # client runs the finalizer; atexit.unregister in close() drops the hook's reference.
        self._finalizer = weakref.finalize(self, self._conn.close)
        self._finalizer.atexit = False
        self._conn.start()
        if wait:
            self.wait_ready(on_progress)

    def wait_ready(self, on_progress: Callable[[str], None] | None = None) -> None:
        """Wait for the core's READY (sets `info`; at once when it has come); a failed start
        shuts the client down."""
        if getattr(self, "info", None) is not None:
            return
        try:
            self.info: Ready = self._conn.wait_ready(on_progress)
        except BaseException:
            self.shutdown()
            raise

    @property
    def pid(self) -> int | None:
        proc = self._conn.proc
        return proc.pid if proc is not None else None

    @property
    def ipc_dir(self) -> str:
        return self._conn.ipc_dir

    @property
    def latest_stats(self) -> SchedulerStats | None:
        return self._conn.latest_stats

    @property
    def is_alive(self) -> bool:
        return self._conn.dead is None and not self._conn.closed

    def add_requests(self, reqs: Sequence[AddRequest]) -> None:
        """Queue requests for the core; raises SamplingParamsError (sending none of them) if
        any one's params are invalid now, e.g. a field set after construction."""
        self._conn.check_alive()
        check_request_params(reqs, self.info.vocab_size)
        self.send_checked(reqs)

    def send_checked(self, reqs: Sequence[AddRequest]) -> None:
        """Queue requests whose params `check_request_params` has passed."""
        conn = self._conn
        conn.check_alive()
        for req in reqs:
            conn.send_q.put(req)
        conn.wake()

    def abort(self, request_ids: Sequence[str], indices: Sequence[int] | None = None) -> None:
        """Abort these requests; with `indices`, only sample indices[j] of request_ids[j]."""
        conn = self._conn
        if request_ids and conn.dead is None and not conn.closed:
            conn.send_q.put(Abort(list(request_ids), None if indices is None else list(indices)))
            conn.wake()

    def get_outputs(self, timeout: float | None = None) -> list[EngineOutputs]:
        """Outputs of one or more engine steps, in order; [] on timeout; raises if the core died."""
        conn = self._conn
        conn.check_alive()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = _POLL_MS / 1000 if deadline is None else deadline - time.monotonic()
            try:
                item = conn.result_q.get(timeout=max(0.0, min(wait, _POLL_MS / 1000)))
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    return []
                continue
            if isinstance(item, BaseException):
                raise item
            return item

    def get_stats(self, timeout: float | None = None) -> SchedulerStats:
        """Ask the core for fresh scheduler stats (a Utility round trip, answered between steps).

        Waits as long as the core is alive: a core busy in a long step answers after it, and a
        dead or hung one raises EngineDeadError (within heartbeat_timeout_s). With `timeout`, a
        live core that has not answered by then raises TimeoutError.
        """
        conn = self._conn
        conn.check_alive()
        call_id = next(conn.call_ids)
        future: Future[SchedulerStats] = Future()
        conn.calls[call_id] = future
        conn.send_q.put(Utility(call_id, "stats"))
        conn.wake()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = _POLL_MS / 1000
            if deadline is not None:
                wait = min(wait, max(0.0, deadline - time.monotonic()))
            try:
                return future.result(wait)
            except FutureTimeout:
                # NOTE: the socket thread fails every registered call when the core dies; this
                # also covers a call registered just after it did.
                if conn.dead is not None or conn.closed:
                    conn.calls.pop(call_id, None)
                    conn.check_alive()
                if deadline is not None and time.monotonic() >= deadline:
                    conn.calls.pop(call_id, None)
                    raise TimeoutError(
                        f"the engine core is alive but busy; it did not answer within {timeout:g} s"
                    ) from None

    def shutdown(self, timeout: float = 5.0) -> None:
        """Send Shutdown, wait for the core to exit (kill it after `timeout`), clean up."""
        self._finalizer.detach()
        self._conn.close(timeout)


class _Connection:
    """What the socket thread works on: the queues, the wake pipe, the core process.

    Invariants: only the socket thread touches zmq sockets and spawns/joins the core; user
    threads talk to it through `send_q` plus the wake pipe and read `result_q`; once `dead` is
    set, every call raises it. Nothing here refers to the EngineCoreClient.
    """

    def __init__(
        self,
        config: EngineConfig,
        placement: CorePlacement | None = None,
        on_result: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        self.placement = placement
        self._on_result = on_result
        self.latest_stats: SchedulerStats | None = None
        self.send_q: queue.SimpleQueue[ClientMessage] = queue.SimpleQueue()
        self.result_q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._fd_lock = threading.Lock()
        self.stopping = threading.Event()
        self.dead: VbatchError | None = None
        self.closed = False
        self._exit_finalizer: multiprocessing.util.Finalize | None = None
        self._close_lock = threading.Lock()
        self.shutdown_timeout = 5.0
        self.calls: dict[int, Future[SchedulerStats]] = {}
        self.call_ids = itertools.count()
        self.proc: multiprocessing.process.BaseProcess | None = None
        self._owner_pid = os.getpid()
        self.ipc_dir = tempfile.mkdtemp(prefix=f"{_IPC_PREFIX}{os.getpid()}-")
        # NOTE: liveness, kept by the socket thread: when the core was last heard from (None
        # until READY) and the age of its busy loop's iteration in its last heartbeat.
        self._last_heard: float | None = None
        self._loop_age = 0.0
        self._loop_cpu = 0.0
        self._step_limit = 0.0
        self.thread = threading.Thread(target=self._run, name="vbatch-client", daemon=True)

    def start(self) -> None:
        self.thread.start()
        # NOTE: registered after multiprocessing's own exit hook (imported by then), so it runs
        # before it: that hook SIGTERMs and joins daemonic children, and the core ignores
        # SIGTERM.
        atexit.register(self.close)
        # NOTE: a multiprocessing child skips atexit and ends in that same hook, which would
        # join the core forever: a finalizer it runs first stops the core there too.
        self._exit_finalizer = multiprocessing.util.Finalize(None, self.close, exitpriority=10)

    def check_alive(self) -> None:
        if self.dead is not None:
            raise self.dead
        if self.closed:
            raise EngineDeadError("the engine has been shut down")
        if os.getpid() != self._owner_pid:
            # NOTE: a forked child has copies of the queues, but no socket thread and no core.
            raise EngineDeadError(
                f"this engine belongs to process {self._owner_pid}, and this process "
                f"({os.getpid()}) was forked from it; create an LLM in this process instead"
            )

    def wake(self) -> None:
        with self._fd_lock, contextlib.suppress(OSError):
            if self._wake_w >= 0:
                os.write(self._wake_w, b"\0")

    def close(self, timeout: float = 5.0) -> None:
        """Stop the core (Shutdown, then a kill after `timeout`); wait for the socket thread
        unless called on it. Idempotent; safe from a finalizer or an atexit hook."""
        if os.getpid() != self._owner_pid:
            # NOTE: a forked child inherits this hook, not the core; the core is the parent's.
            return
        with self._close_lock:
            if self.closed:
                return
            self.closed = True
        atexit.unregister(self.close)
        if self._exit_finalizer is not None:
            self._exit_finalizer.cancel()
        self.shutdown_timeout = timeout
        self.stopping.set()
        self.wake()
        if self.thread.ident is not None and threading.current_thread() is not self.thread:
            self.thread.join(timeout + 5.0)
            proc = self.proc
            if proc is not None and proc.is_alive():
                proc.kill()
                proc.join(5.0)
        if not self.thread.is_alive():
            self._close_fds()
            shutil.rmtree(self.ipc_dir, ignore_errors=True)

    def _close_fds(self) -> None:
        with self._fd_lock:
            for fd in (self._wake_r, self._wake_w):
                if fd >= 0:
                    os.close(fd)
            self._wake_r = self._wake_w = -1

    def wait_ready(self, on_progress: Callable[[str], None] | None) -> Ready:
        limit = self.config.startup_timeout_s
        deadline = time.monotonic() + limit
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EngineStartupError(f"the engine core did not report READY within {limit:g} s")
            if self.closed:
                raise EngineStartupError("the engine core was shut down before it was ready")
            try:
                item = self.result_q.get(timeout=min(remaining, _POLL_MS / 1000))
            except queue.Empty:
                continue
            if isinstance(item, StartupProgress):
                if on_progress is not None:
                    on_progress(item.stage)
            elif isinstance(item, Ready):
                return item
            elif isinstance(item, StartupFailed):
                kind = SettledStartupError if item.kind else EngineStartupError
                raise kind(f"the engine core failed to start: {item.message}")
            elif isinstance(item, BaseException):
                raise EngineStartupError(f"{item} before it was ready.") from None

    def _run(self) -> None:
        # NOTE: blocked here, so the core (forked from this thread) starts with them blocked and
        # a group-wide SIGTERM or Ctrl-C cannot kill it before it ignores them; signal handlers
        # run in the main thread anyway.
        if hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_BLOCK, _OWN_SIGNALS)
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
            self.proc = _spawn_core(
                self.config, input_addr, output_addr, self.ipc_dir, self.placement
            )
            self._loop(req_sock, out_sock, self.proc)
        except BaseException as e:
            self._fail(EngineDeadError(f"the engine client thread failed: {e!r}"))
            if self.proc is not None and self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5.0)
        finally:
            req_sock.close()
            out_sock.close()
            ctx.term()
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
            if self.closed:
                self._close_fds()

    def _loop(self, req_sock: zmq.Socket, out_sock: zmq.Socket, proc: Any) -> None:
        poller = zmq.Poller()
        poller.register(out_sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        poller.register(proc.sentinel, zmq.POLLIN)
        pending: deque[ClientMessage] = deque()
        core_error: list[EngineError] = []
        last_iteration = time.monotonic()
        while True:
            events = dict(poller.poll(_RETRY_SEND_MS if pending else _POLL_MS))
            now = time.monotonic()
            if now - last_iteration > _POLL_MS / 1000 + _STALL_S and self._last_heard is not None:
                self._last_heard = now
            last_iteration = now
            if out_sock in events:
                self._receive(out_sock, core_error)
            if self._wake_r in events:
                _drain_pipe(self._wake_r)
            self._send_all(req_sock, pending)
            if self.stopping.is_set():
                self._stop_core(req_sock, out_sock, proc, core_error)
                return
            if proc.sentinel in events or not proc.is_alive():
                if out_sock.poll(_LAST_WORDS_MS):
                    self._receive(out_sock, core_error)
                proc.join(1.0)
                self._fail(EngineDeadError(_death_message(proc, core_error)))
                return
            hang = self._hang(now)
            if hang is not None:
                proc.kill()
                proc.join(5.0)
                self._fail(EngineDeadError(hang))
                return

    def _hang(self, now: float) -> str | None:
        """Why the core counts as hung, or None: no heartbeat for longer than
        heartbeat_timeout_s; a busy-loop iteration that long in which the core barely used the
        CPU (a step stuck waiting); or a computing step past the limit the core sized from its
        measured step times."""
        if self._last_heard is None:
            return None
        limit = self.config.heartbeat_timeout_s
        pid = self.proc.pid if self.proc is not None else "?"
        silence = now - self._last_heard
        if silence > limit:
            return (
                f"the engine core (pid {pid}) sent no heartbeat for {silence:.0f} s (stopped, or "
                f"stuck holding the interpreter lock) and was killed (heartbeat timeout "
                f"{limit:g} s)"
            )
        age = self._loop_age
        if age > limit and self._loop_cpu < IDLE_CPU_FRACTION * age:
            return (
                f"the engine core (pid {pid}) is alive but its loop made no progress for "
                f"{age:.0f} s, using {self._loop_cpu:.1f} s of CPU (a step hung or deadlocked), "
                f"and was killed (heartbeat timeout {limit:g} s)"
            )
        if age > max(limit, self._step_limit):
            return (
                f"the engine core (pid {pid}) has computed one step for {age:.0f} s "
                f"({self._loop_cpu:.0f} s of CPU), past the {self._step_limit:.0f} s a step may "
                f"take here (sized from the step times measured so far: "
                f"{SLOW_STEP_FACTOR:g}x a full step at the slowest rate seen, at least the "
                f"heartbeat timeout; {FIRST_STEP_FACTOR:g}x the heartbeat timeout before any "
                f"step was measured), and was killed (raise --heartbeat-timeout if steps are "
                f"this slow)"
            )
        return None

    def _send_all(self, sock: zmq.Socket, pending: deque) -> None:
        """Send what the user threads queued; a message that cannot be encoded is answered here
        (an ERROR finish for a request, an error for a call) rather than ending this thread."""
        while True:
            if not pending:
                try:
                    msg = self.send_q.get_nowait()
                except queue.Empty:
                    return
                try:
                    pending.append(encoder.encode(msg))
                except Exception as e:
                    self._refuse(msg, f"{type(e).__name__}: {e}")
                    continue
            try:
                sock.send(pending[0], zmq.NOBLOCK)
            except zmq.Again:
                return
            pending.popleft()

    def _refuse(self, msg: ClientMessage, reason: str) -> None:
        if isinstance(msg, AddRequest):
            error = f"the request cannot be sent to the engine core: {reason}"
            finish = SampleFinish(msg.request_id, FinishReason.ERROR, error=error)
            self._put_result([EngineOutputs(finished=[finish], timestamp=time.time())])
        elif isinstance(msg, Utility):
            future = self.calls.pop(msg.call_id, None)
            if future is not None:
                future.set_exception(VbatchError(f"cannot send a utility call: {reason}"))

    def _stop_core(
        self, req_sock: zmq.Socket, out_sock: zmq.Socket, proc: Any, core_error: list
    ) -> None:
        try:
            req_sock.send(encoder.encode(Shutdown()), zmq.NOBLOCK)
        except zmq.Again:
            proc.kill()
        deadline = time.monotonic() + self.shutdown_timeout
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
            if self._last_heard is not None:
                self._last_heard = time.monotonic()
            if isinstance(msg, Heartbeat):
                self._loop_age = msg.loop_age_s
                self._loop_cpu = msg.loop_cpu_s
                self._step_limit = msg.step_limit_s
            elif isinstance(msg, EngineOutputs):
                if msg.stats is not None:
                    self.latest_stats = msg.stats
                if not msg.is_empty:
                    batch.append(msg)
            elif isinstance(msg, UtilityResult):
                future = self.calls.pop(msg.call_id, None)
                if future is not None and msg.error is not None:
                    future.set_exception(VbatchError(msg.error))
                elif future is not None:
                    future.set_result(msg.result)
            elif isinstance(msg, EngineError):
                core_error.append(msg)
            else:
                if isinstance(msg, Ready):
                    self._last_heard = time.monotonic()
                self.result_q.put(msg)
        if batch:
            self._put_result(batch)

    def _put_result(self, item: list[EngineOutputs] | VbatchError) -> None:
        self.result_q.put(item)
        if self._on_result is not None:
            self._on_result()

    def _fail(self, error: VbatchError) -> None:
        if self.dead is None:
            self.dead = error
        self._put_result(error)
        for call_id in list(self.calls):
            future = self.calls.pop(call_id, None)
            if future is not None:
                future.set_exception(error)


def sweep_stale_ipc_dirs(tmp_dir: str | None = None) -> list[str]:
    """Remove this user's `vbatch-<pid>-*` IPC directories whose owner process is gone (it died
    by a signal before it could clean up); returns the removed paths."""
    tmp_dir = tmp_dir or tempfile.gettempdir()
    removed = []
    try:
        entries = list(os.scandir(tmp_dir))
    except OSError:
        return removed
    uid = os.getuid() if hasattr(os, "getuid") else None
    for entry in entries:
        match = _IPC_DIR_NAME.fullmatch(entry.name)
        if match is None or int(match[1]) == os.getpid():
            continue
        try:
            if not entry.is_dir(follow_symlinks=False):
                continue
            if uid is not None and entry.stat(follow_symlinks=False).st_uid != uid:
                continue
        except OSError:
            continue
        if not _is_running(int(match[1])):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


def _is_running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True


def _spawn_core(
    config: EngineConfig,
    input_addr: str,
    output_addr: str,
    ipc_dir: str,
    placement: CorePlacement | None,
) -> Any:
    """The core's process: the CLI's preloaded one where there is one (engine/preload.py) and no
    placement (which must come before torch's import), else a new spawn."""
    args = (config, input_addr, output_addr, os.getpid(), ipc_dir, placement)
    if placement is None:
        adopted = adopt_preloaded(args)
        if adopted is not None:
            return adopted
    from vbatch.engine.core_process import run_engine_core

    ctx = spawn_context()
    waits = openmp_waits(config.num_threads)
    proc = ctx.Process(
        target=run_engine_core, args=(*args, waits), name="vbatch-engine-core", daemon=True
    )
    with main_module_hidden():
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
