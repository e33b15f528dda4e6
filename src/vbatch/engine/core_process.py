"""The engine-core subprocess: socket threads, the busy loop around EngineCore, and a watchdog
thread (parent watch, heartbeat, dead-man alarm).

Signals: the core ignores SIGINT, SIGTERM and SIGHUP, which belong to its parent (a terminal's
Ctrl-C or hang-up, or `timeout`, systemd, Slurm and Kubernetes signalling the whole process
group, must let the job drain). It exits when told (Shutdown), when its parent is gone (then it
also removes the parent's IPC directory), or, as a backstop, by SIGALRM's default action when its
watchdog thread has not run for longer than the client would wait on it anyway (a core wedged
holding the GIL).
"""

from __future__ import annotations

import math
import os
import queue
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import zmq

from vbatch.config import FIRST_STEP_FACTOR, SLOW_STEP_FACTOR, CorePlacement, EngineConfig
from vbatch.engine.cpu_share import CpuShare, shares_cpus
from vbatch.engine.heap import keep_freed_memory
from vbatch.engine.openmp_waits import set_core_waits
from vbatch.engine.startup_gc import pause_collection, resume_collection
from vbatch.errors import ConfigError, LoraError, ModelLoadError, VbatchError
from vbatch.protocol import (
    Abort,
    AddRequest,
    ClientMessage,
    EngineError,
    EngineOutputs,
    FinishReason,
    Heartbeat,
    SampleFinish,
    SchedulerStats,
    Shutdown,
    StartupFailed,
    StartupProgress,
    Utility,
    UtilityResult,
    core_decoder,
    describe_decode_error,
    encoder,
    undecodable_target,
)
from vbatch.sampling_params import trust_decoded

STATS_INTERVAL_S = 0.5
PARENT_POLL_S = 0.25
# NOTE: a watchdog tick this much later than due means the whole process was stopped (SIGSTOP,
# Ctrl-Z) or starved; the busy loop's age then restarts, so a resumed job is not called hung.
_STALL_S = 2.0
# NOTE: the dead-man alarm fires this long after the client itself would have given up.
_ALARM_MARGIN_S = 30.0
_MAX_ALARM_S = 10**9
_OWN_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# NOTE: the core's last messages (a start-up failure, say) must reach a live client, yet a dead
# client must not keep the core alive, so the output socket lingers for a bounded time.
_OUTPUT_LINGER_MS = 2000


def run_engine_core(
    config: EngineConfig,
    input_addr: str,
    output_addr: str,
    parent_pid: int,
    ipc_dir: str | None = None,
    placement: CorePlacement | None = None,
    waits: dict[str, str] | None = None,
) -> None:
    """Process entry: connect to the client, start the engine, serve requests until Shutdown.

    `ipc_dir`, the client's socket directory, is removed here if the client dies first, and
    as the core exits: a client that died while it waited for that exit (a second Ctrl-C during
    the drain) left it behind.
    `waits` (engine/openmp_waits.py) and `placement` (one core of several) are applied first,
    before torch is imported; a preloaded core, which imported it already, took its waits at
    its own spawn. The garbage collector pauses until the engine is built (engine/startup_gc.py),
    and the heap keeps what a step frees for the next (engine/heap.py).
    """
    pause_collection()
    keep_freed_memory()
    if waits:
        set_core_waits(waits)
    if placement is not None:
        apply_placement(placement)
    # NOTE: the client spawns the core with SIGINT, SIGTERM and SIGHUP blocked, so none can kill it
    # before this point; they stay ignored, and SIGALRM keeps its default action (terminate).
    for signum in _OWN_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {*_OWN_SIGNALS, signal.SIGALRM})
    trust_decoded()
    in_q: queue.Queue[Any] = queue.Queue()
    out_q: queue.Queue[Any] = queue.Queue()
    watchdog = _Watchdog(config, parent_pid, ipc_dir, out_q)
    watchdog.start()
    ctx = zmq.Context(1)
    in_sock = ctx.socket(zmq.PULL)
    in_sock.setsockopt(zmq.LINGER, 0)
    in_sock.connect(input_addr)
    out_sock = ctx.socket(zmq.PUSH)
    out_sock.setsockopt(zmq.LINGER, _OUTPUT_LINGER_MS)
    out_sock.setsockopt(zmq.SNDHWM, 0)
    out_sock.connect(output_addr)

    stop = threading.Event()
    reader = threading.Thread(target=_input_loop, args=(in_sock, in_q, stop), daemon=True)
    writer = threading.Thread(target=_output_loop, args=(out_sock, out_q), daemon=True)
    reader.start()
    writer.start()
    exit_code = 0
    try:
        exit_code = _serve(config, in_q, out_q, watchdog)
    finally:
        stop.set()
        watchdog.stop_heartbeat()
        out_q.put(None)
        writer.join()
        reader.join()
        in_sock.close()
        out_sock.close()
        ctx.term()
        if ipc_dir is not None:
            shutil.rmtree(ipc_dir, ignore_errors=True)
    sys.stdout.flush()
    sys.stderr.flush()
    # NOTE: everything is closed; skipping interpreter teardown (torch's is slow) ends sooner.
    os._exit(exit_code)


def apply_placement(placement: CorePlacement) -> None:
    """Pin every thread of this process to `placement.cpus` and narrow the visible GPUs; torch
    reads CUDA_VISIBLE_DEVICES when it initialises CUDA, so this must come before."""
    if placement.cuda_visible_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = placement.cuda_visible_devices
    if placement.cpus is not None:
        # NOTE: on Linux the affinity is per thread; threads started later inherit it.
        for tid in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(tid), placement.cpus)


class _Watchdog:
    """One daemon thread that needs nothing from the busy loop but the GIL now and then.

    Every PARENT_POLL_S it checks the parent (gone: remove the IPC directory, exit), re-arms the
    dead-man alarm, and, once the busy loop runs, sends a Heartbeat about every second with the
    age of the loop's current iteration (`beat()` marks each iteration's start), the CPU time
    used in it, and the step limit sized from the steps measured so far (`record_step`); and it
    samples the load on the core's CPUs for `share` where it has one (engine/cpu_share.py).
    """

    def __init__(
        self, config: EngineConfig, parent_pid: int, ipc_dir: str | None, out_q: queue.Queue
    ) -> None:
        self.parent_pid = parent_pid
        self.ipc_dir = ipc_dir
        self.out_q = out_q
        self.heartbeat_timeout_s = config.heartbeat_timeout_s
        self.max_step_tokens = config.max_num_batched_tokens
        self.step_limit_s = FIRST_STEP_FACTOR * config.heartbeat_timeout_s
        self.slowest_s_per_token = 0.0
        self.loop_cpu_start = 0.0
        self.interval_s = min(1.0, max(PARENT_POLL_S, config.heartbeat_timeout_s / 4))
        self.alarm_s = config.startup_timeout_s + _ALARM_MARGIN_S
        self.loop_start: float | None = None
        self.resumed_at = 0.0
        self.share: CpuShare | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        threading.Thread(target=self._run, name="vbatch-watchdog", daemon=True).start()

    def beat(self) -> None:
        """The busy loop starts an iteration; the first call starts the heartbeats."""
        if self.loop_start is None:
            self.alarm_s = self.heartbeat_timeout_s + _ALARM_MARGIN_S
        self.loop_cpu_start = time.process_time()
        self.loop_start = time.monotonic()

    def record_step(self, seconds: float, num_tokens: int) -> None:
        """A step of `num_tokens` scheduled tokens took `seconds`: resize the step limit (a step
        that scheduled nothing says nothing about the rate)."""
        if num_tokens <= 0:
            return
        self.slowest_s_per_token = max(self.slowest_s_per_token, seconds / max(num_tokens, 1))
        self.step_limit_s = step_limit(
            self.slowest_s_per_token, self.max_step_tokens, self.heartbeat_timeout_s
        )

    def stop_heartbeat(self) -> None:
        with self._lock:
            self.out_q = None  # type: ignore[assignment]

    def _run(self) -> None:
        last_tick = last_beat = time.monotonic()
        while True:
            if os.getppid() != self.parent_pid:
                self._parent_gone()
            if hasattr(signal, "alarm"):
                signal.alarm(math.ceil(min(self.alarm_s, _MAX_ALARM_S)))
            now = time.monotonic()
            if now - last_tick > PARENT_POLL_S + _STALL_S:
                self.resumed_at = now
            last_tick = now
            share = self.share
            if share is not None:
                share.sample()
            loop_start = self.loop_start
            if loop_start is not None and now - last_beat >= self.interval_s:
                last_beat = now
                age = now - max(loop_start, self.resumed_at)
                beat = Heartbeat(
                    loop_age_s=max(age, 0.0),
                    loop_cpu_s=max(time.process_time() - self.loop_cpu_start, 0.0),
                    step_limit_s=self.step_limit_s,
                )
                with self._lock:
                    if self.out_q is not None:
                        self.out_q.put(beat)
            time.sleep(PARENT_POLL_S)

    def _parent_gone(self) -> None:
        if self.ipc_dir is not None:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
        os._exit(1)


def _serve(config: EngineConfig, in_q: queue.Queue, out_q: queue.Queue, watchdog: _Watchdog) -> int:
    """Build the engine and run the busy loop; failures become messages and a non-zero code."""
    try:
        from vbatch.engine.encoder_core import make_core

        core = make_core(config, on_progress=lambda stage: out_q.put(StartupProgress(stage)))
    except BaseException as e:
        kind = type(e).__name__ if isinstance(e, ModelLoadError | ConfigError | LoraError) else ""
        out_q.put(StartupFailed(message=_describe(e), traceback=traceback.format_exc(), kind=kind))
        return 1
    info = core.info
    out_q.put(info)
    resume_collection()
    import torch

    threads = torch.get_num_threads()
    share = None
    if shares_cpus(threads, info.device.partition(":")[0], core.thread_invariant):
        share = CpuShare(threads, os.sched_getaffinity(0), torch.set_num_threads)
        watchdog.share = share
    try:
        # NOTE: one inference-mode guard for the whole loop, not one per step (~15 µs each).
        with torch.inference_mode():
            _busy_loop(
                core,
                in_q,
                out_q,
                watchdog.beat,
                watchdog.record_step,
                share.apply if share is not None else lambda: None,
            )
    except BaseException as e:
        out_q.put(EngineError(message=_describe(e), traceback=traceback.format_exc()))
        return 1
    finally:
        core.shutdown()
    return 0


class _Undecodable:
    """A client message the core could not decode, but can answer: an AddRequest (by request id)
    or a Utility call (by call id)."""

    def __init__(self, kind: type, key: str | int, message: str) -> None:
        self.kind = kind
        self.key = key
        self.message = message


def step_limit(slowest_s_per_token: float, max_step_tokens: int, floor_s: float) -> float:
    """How long a computing step may run: SLOW_STEP_FACTOR times a full step (max_step_tokens)
    at the slowest rate measured, and at least `floor_s` (the heartbeat timeout)."""
    return max(floor_s, SLOW_STEP_FACTOR * slowest_s_per_token * max_step_tokens)


def _busy_loop(
    core: Any,
    in_q: queue.Queue,
    out_q: queue.Queue,
    beat: Callable[[], None] = lambda: None,
    record_step: Callable[[float, int], None] = lambda seconds, num_tokens: None,
    set_threads: Callable[[], None] = lambda: None,
) -> None:
    """Drain inputs (aborts land before the next step's outputs), step, push compact outputs.

    Blocks on the input queue only while the engine has no unfinished request. `beat()` marks
    the start of every iteration, for the heartbeat's loop age; `record_step` gets each step's
    time and scheduled tokens; `set_threads()` runs before each step (engine/cpu_share.py).
    """
    busy_time = 0.0
    last_stats = 0.0
    while True:
        beat()
        finished: list[SampleFinish] = []
        for msg in _drain(in_q, block=not core.has_unfinished()):
            if isinstance(msg, AddRequest):
                finished += core.add_request(msg)
            elif isinstance(msg, Abort):
                finished += core.abort(msg.request_ids, msg.indices)
            elif isinstance(msg, Utility):
                out_q.put(_utility(core, msg, busy_time))
            elif isinstance(msg, _Undecodable):
                if msg.kind is AddRequest:
                    finished.append(SampleFinish(msg.key, FinishReason.ERROR, error=msg.message))
                else:
                    out_q.put(UtilityResult(msg.key, error=msg.message))
            elif isinstance(msg, Shutdown):
                if finished:
                    out_q.put(EngineOutputs(finished=finished, timestamp=time.time()))
                return
        if core.has_unfinished():
            set_threads()
            start = time.perf_counter()
            outputs = core.step()
            seconds = time.perf_counter() - start
            busy_time += seconds
            record_step(seconds, core.last_step_tokens)
        else:
            outputs = EngineOutputs()
        if finished:
            # NOTE: these samples were not scheduled (they had ended), so no entry of this step
            # belongs to them and their finishes may follow the step's tokens.
            outputs.finished = finished + outputs.finished
        now = time.monotonic()
        # NOTE: also when the last request in flight ends, so that a job shorter than the
        # interval does not end on its first step's figures.
        if now - last_stats >= STATS_INTERVAL_S or (outputs.finished and not core.has_unfinished()):
            outputs.stats = _stats(core, busy_time)
            last_stats = now
        if not outputs.is_empty or outputs.stats is not None:
            outputs.timestamp = time.time()
            out_q.put(outputs)


def _drain(in_q: queue.Queue, block: bool) -> list[ClientMessage]:
    items = []
    if block:
        try:
            items.append(in_q.get(timeout=STATS_INTERVAL_S))
        except queue.Empty:
            return items
    while True:
        try:
            items.append(in_q.get_nowait())
        except queue.Empty:
            return items


def _stats(core: Any, busy_time: float) -> SchedulerStats:
    stats = core.stats()
    stats.busy_time_s = busy_time
    return stats


def _utility(core: Any, msg: Utility, busy_time: float) -> UtilityResult:
    if msg.method != "stats":
        return UtilityResult(msg.call_id, error=f"unknown utility method {msg.method!r}")
    try:
        return UtilityResult(msg.call_id, result=_stats(core, busy_time))
    except Exception as e:
        return UtilityResult(msg.call_id, error=f"the engine core failed to answer: {_describe(e)}")


def _input_loop(sock: zmq.Socket, in_q: queue.Queue, stop: threading.Event) -> None:
    """Receive and decode client messages off the main thread, so they overlap the forward.

    A message that fails to decode is answered when it names a request or a utility call (an
    ERROR finish, an error result), so no client waits on it forever; one that names neither
    is reported on stderr (no client waits on an Abort or a Shutdown).
    """
    while not stop.is_set():
        if not sock.poll(100):
            continue
        while True:
            try:
                frame = sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            try:
                msg = core_decoder.decode(frame.buffer)
            except Exception as e:
                msg = _undecodable(frame.buffer, e)
                if msg is None:
                    continue
            in_q.put(msg)
            if isinstance(msg, Shutdown):
                return


def _undecodable(data: memoryview, error: Exception) -> _Undecodable | None:
    reason = describe_decode_error(error)
    target = undecodable_target(data)
    if target is None:
        print(
            f"vbatch engine core: ignored an undecodable message that names no request: {reason}",
            file=sys.stderr,
        )
        return None
    kind, key = target
    what = "request" if kind is AddRequest else "utility call"
    return _Undecodable(kind, key, f"the engine core could not decode the {what}: {reason}")


def _output_loop(sock: zmq.Socket, out_q: queue.Queue) -> None:
    """Encode and send core messages off the main thread; None ends the loop."""
    while True:
        msg = out_q.get()
        if msg is None:
            return
        sock.send(encoder.encode(msg), copy=False)


def _describe(e: BaseException) -> str:
    return str(e) if isinstance(e, VbatchError) else f"{type(e).__name__}: {e}"
