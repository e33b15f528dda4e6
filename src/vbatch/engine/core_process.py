"""The engine-core subprocess: socket threads, the busy loop around EngineCore, parent watch."""

from __future__ import annotations

import ctypes
import os
import queue
import signal
import sys
import threading
import time
import traceback
from typing import Any

import msgspec
import zmq

from vbatch.config import EngineConfig
from vbatch.errors import VbatchError
from vbatch.protocol import (
    Abort,
    AddRequest,
    ClientMessage,
    EngineError,
    EngineOutputs,
    SampleFinish,
    SchedulerStats,
    Shutdown,
    StartupFailed,
    StartupProgress,
    Utility,
    UtilityResult,
    core_decoder,
    encoder,
)

STATS_INTERVAL_S = 0.5
PARENT_POLL_S = 0.25
_PR_SET_PDEATHSIG = 1
# NOTE: the core's last messages (a start-up failure, say) must reach a live client, yet a dead
# client must not keep the core alive, so the output socket lingers for a bounded time.
_OUTPUT_LINGER_MS = 2000


def run_engine_core(
    config: EngineConfig, input_addr: str, output_addr: str, parent_pid: int
) -> None:
    """Process entry: connect to the client, start the engine, serve requests until Shutdown."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # NOTE: Ctrl-C is the client's to handle.
    _die_with_parent(parent_pid)
    ctx = zmq.Context(1)
    in_sock = ctx.socket(zmq.PULL)
    in_sock.setsockopt(zmq.LINGER, 0)
    in_sock.connect(input_addr)
    out_sock = ctx.socket(zmq.PUSH)
    out_sock.setsockopt(zmq.LINGER, _OUTPUT_LINGER_MS)
    out_sock.setsockopt(zmq.SNDHWM, 0)
    out_sock.connect(output_addr)

    in_q: queue.Queue[ClientMessage] = queue.Queue()
    out_q: queue.Queue[Any] = queue.Queue()
    stop = threading.Event()
    reader = threading.Thread(target=_input_loop, args=(in_sock, in_q, stop), daemon=True)
    writer = threading.Thread(target=_output_loop, args=(out_sock, out_q), daemon=True)
    reader.start()
    writer.start()
    exit_code = 0
    try:
        exit_code = _serve(config, in_q, out_q)
    finally:
        stop.set()
        out_q.put(None)
        writer.join()
        reader.join()
        in_sock.close()
        out_sock.close()
        ctx.term()
    sys.stdout.flush()
    sys.stderr.flush()
    # NOTE: everything is closed; skipping interpreter teardown (torch's is slow) ends sooner.
    os._exit(exit_code)


def _serve(config: EngineConfig, in_q: queue.Queue, out_q: queue.Queue) -> int:
    """Build the engine and run the busy loop; failures become messages and a non-zero code."""
    try:
        from vbatch.engine.core import EngineCore

        core = EngineCore(config, on_progress=lambda stage: out_q.put(StartupProgress(stage)))
    except BaseException as e:
        out_q.put(StartupFailed(message=_describe(e), traceback=traceback.format_exc()))
        return 1
    info = core.info
    out_q.put(info)
    import torch

    try:
        # NOTE: one inference-mode guard for the whole loop, not one per step (~15 µs each).
        with torch.inference_mode():
            _busy_loop(core, in_q, out_q)
    except BaseException as e:
        out_q.put(EngineError(message=_describe(e), traceback=traceback.format_exc()))
        return 1
    finally:
        core.shutdown()
    return 0


def _busy_loop(core: Any, in_q: queue.Queue, out_q: queue.Queue) -> None:
    """Drain inputs (aborts land before the next step's outputs), step, push compact outputs.

    Blocks on the input queue only while the engine has no unfinished request.
    """
    busy_time = 0.0
    last_stats = 0.0
    while True:
        finished: list[SampleFinish] = []
        for msg in _drain(in_q, block=not core.has_unfinished()):
            if isinstance(msg, AddRequest):
                finished += core.add_request(msg)
            elif isinstance(msg, Abort):
                finished += core.abort(msg.request_ids, msg.indices)
            elif isinstance(msg, Utility):
                out_q.put(_utility(core, msg, busy_time))
            elif isinstance(msg, Shutdown):
                if finished:
                    out_q.put(EngineOutputs(finished=finished, timestamp=time.time()))
                return
        if core.has_unfinished():
            start = time.perf_counter()
            outputs = core.step()
            busy_time += time.perf_counter() - start
        else:
            outputs = EngineOutputs()
        if finished:
            # NOTE: these samples were not scheduled (they had ended), so no entry of this step
            # belongs to them and their finishes may follow the step's tokens.
            outputs.finished = finished + outputs.finished
        now = time.monotonic()
        if now - last_stats >= STATS_INTERVAL_S:
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
    if msg.method == "stats":
        return UtilityResult(msg.call_id, result=_stats(core, busy_time))
    return UtilityResult(msg.call_id, error=f"unknown utility method {msg.method!r}")


def _input_loop(sock: zmq.Socket, in_q: queue.Queue, stop: threading.Event) -> None:
    """Receive and decode client messages off the main thread, so they overlap the forward."""
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
            except msgspec.DecodeError as e:
                print(f"vbatch engine core: dropped an undecodable message: {e}", file=sys.stderr)
                continue
            in_q.put(msg)
            if isinstance(msg, Shutdown):
                return


def _output_loop(sock: zmq.Socket, out_q: queue.Queue) -> None:
    """Encode and send core messages off the main thread; None ends the loop."""
    while True:
        msg = out_q.get()
        if msg is None:
            return
        sock.send(encoder.encode(msg), copy=False)


def _die_with_parent(parent_pid: int) -> None:
    """Exit when the client process dies, even by SIGKILL, so the core is never orphaned.

    Linux: PR_SET_PDEATHSIG. Everywhere: a thread polling the parent pid, which also covers a
    parent that died before prctl ran.
    """
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="vbatch-parent-watch", daemon=True).start()


def _describe(e: BaseException) -> str:
    return str(e) if isinstance(e, VbatchError) else f"{type(e).__name__}: {e}"
