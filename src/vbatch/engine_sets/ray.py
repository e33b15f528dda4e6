"""RayEngines: the engine set of `--ray`: N Ray actors (one LLM each) behind one stream."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import heapq
import itertools
import logging
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayError

from vbatch.client.outputs import Request, RequestOutput
from vbatch.client.tokenizer import TextTokenizer
from vbatch.engine_sets.base import EngineReport, EngineState, RaySettings, sum_stats
from vbatch.engine_sets.ray_replica import ReplicaEngine
from vbatch.errors import ConfigError, EngineDeadError, EngineStartupError
from vbatch.llm import TOKENIZE_BATCH
from vbatch.protocol import Ready, SchedulerStats
from vbatch.sampling_params import SamplingParams

POLL_WAIT_S = 1.0
REPLICA_NAME_PREFIX = "vbatch-replica-"
_WAIT_CAP_S = 1.0
STARTUP_GRACE_S = 60.0
_KEPT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGALRM)
_SHUTDOWN_S = 10.0


@dataclass
class _Replica:
    """The driver's view of one replica. Invariant: `in_flight` holds exactly the rows sent to
    the current incarnation and not returned; on failure they go back to the queue."""

    index: int
    handle: Any
    state: EngineState = EngineState.STARTING
    token: str = ""
    window: int = 0
    num_restarts: int = 0
    in_flight: dict[int, Request] = field(default_factory=dict)
    stats: SchedulerStats | None = None
    info: Ready | None = None
    probe: Any = None
    poll: Any = None
    seq: Iterator[int] = field(default_factory=itertools.count)
    is_told_final: bool = False


class RayEngines:
    """`EngineSet` over Ray actors: rows are dispatched to the least loaded live replica in
    batches, finished rows come back by long polls, and a replica's death puts its rows back
    in the queue for the others (or for its restarted self). Fails only when none is left."""

    def __init__(
        self,
        model: str | None,
        settings: RaySettings,
        *,
        max_in_flight: int | None = None,
        on_progress: Callable[[str], None] | None = None,
        **engine_args: Any,
    ) -> None:
        from vbatch.models.loader import resolve_model

        self.settings = settings
        self._replicas: list[_Replica] = []
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            _init_ray(settings.address)
        try:
            self._check_resources()
        except BaseException:
            self.shutdown()
            raise
        self.tokenizer = TextTokenizer.from_dir(resolve_model(model).hf_dir)
        args = {"num_threads": max(1, int(settings.cpus_per_replica)), **engine_args}
        if max_in_flight is not None:
            args["max_in_flight"] = max_in_flight
        actor = ray.remote(ReplicaEngine)
        # NOTE: named, so that `ray list actors` (and a test) can find a job's replicas.
        prefix = f"{REPLICA_NAME_PREFIX}{uuid.uuid4().hex[:8]}-"
        self._replicas = [
            _Replica(
                i,
                actor.options(
                    name=f"{prefix}{i}",
                    num_cpus=settings.cpus_per_replica,
                    num_gpus=settings.gpus_per_replica,
                    max_restarts=settings.max_restarts,
                    max_concurrency=4,
                ).remote(model, args),
            )
            for i in range(settings.replicas)
        ]
        self._epochs = itertools.count()
        self._last_error = ""
        try:
            self.engine_info: Ready = self._start(on_progress)
        except BaseException:
            self.shutdown()
            raise

    def _check_resources(self) -> None:
        total = ray.cluster_resources()
        for name, need in (
            ("CPU", self.settings.cpus_per_replica),
            ("GPU", self.settings.gpus_per_replica),
        ):
            if need > total.get(name, 0):
                raise ConfigError(
                    f"a replica asks for {need:g} {name}s, and the Ray cluster has "
                    f"{total.get(name, 0):g}; lower --{name.lower()}s-per-replica"
                )

    def _start(self, on_progress: Callable[[str], None] | None) -> Ready:
        """Wait for every replica, or for STARTUP_GRACE_S after the first is live (the others,
        maybe waiting for resources, join the stream when they are up)."""
        for rep in self._replicas:
            rep.probe = rep.handle.ready.remote()
        first_live_t = None
        while any(rep.state is EngineState.STARTING for rep in self._replicas):
            live = [rep for rep in self._replicas if rep.state is EngineState.LIVE]
            if live and first_live_t is None:
                first_live_t = time.monotonic()
            if first_live_t is not None and time.monotonic() - first_live_t > STARTUP_GRACE_S:
                break
            if on_progress is not None:
                on_progress(f"starting Ray replicas ({len(live)} of {len(self._replicas)} live)")
            self._wait_probes(_WAIT_CAP_S)
        info = next((rep.info for rep in self._replicas if rep.state is EngineState.LIVE), None)
        if info is None:
            raise EngineStartupError(f"no Ray replica started: {self._last_error}")
        return info

    @property
    def latest_stats(self) -> SchedulerStats | None:
        return sum_stats([rep.stats for rep in self._replicas if rep.state is EngineState.LIVE])

    def engine_reports(self) -> list[EngineReport]:
        return [
            EngineReport(f"replica {rep.index}", rep.state, rep.stats, len(rep.in_flight))
            for rep in self._replicas
        ]

    def stream(
        self,
        inputs: Iterable[str | list[dict] | Request],
        sampling_params: SamplingParams | None = None,
        *,
        on_output: Callable[[RequestOutput], None] | None = None,
        idle_s: float | None = None,
    ) -> Iterator[RequestOutput | None]:
        """Yield finished rows in completion order; `on_output` runs on the caller's thread."""
        defaults = sampling_params or SamplingParams()
        defaults.validate(self.engine_info.vocab_size)
        epoch = next(self._epochs)
        source = (_as_row(pos, item, defaults) for pos, item in enumerate(inputs))
        queue: collections.deque[tuple[int, Request]] = collections.deque()
        is_exhausted = False
        idle_deadline = None if idle_s is None else time.monotonic() + idle_s
        for rep in self._replicas:
            rep.is_told_final = False
        try:
            while True:
                is_exhausted = self._dispatch(epoch, source, queue, is_exhausted)
                live = [rep for rep in self._replicas if rep.state is EngineState.LIVE]
                if is_exhausted and not queue and not any(rep.in_flight for rep in live):
                    return
                if not live and not self._is_coming():
                    raise EngineDeadError(
                        f"every Ray replica died ({self._last_error}); no restart is left"
                    )
                timeout = _WAIT_CAP_S
                if idle_deadline is not None:
                    timeout = min(timeout, max(0.0, idle_deadline - time.monotonic()))
                finished = self._wait(epoch, live, queue, timeout)
                for out in finished:
                    if on_output is not None:
                        on_output(out)
                    yield out
                if idle_deadline is not None:
                    now = time.monotonic()
                    if finished:
                        idle_deadline = now + idle_s
                    elif now >= idle_deadline:
                        yield None
                        idle_deadline = now + idle_s
        finally:
            self._end_stream(epoch)

    def _is_coming(self) -> bool:
        """Whether a replica is starting or restarting, so rows may still run."""
        coming = (EngineState.STARTING, EngineState.RESTARTING)
        return any(rep.state in coming for rep in self._replicas)

    def _dispatch(
        self,
        epoch: int,
        source: Iterator[tuple[int, Request]],
        queue: collections.deque[tuple[int, Request]],
        is_exhausted: bool,
    ) -> bool:
        """Fill every live replica's window, one row at a time to the least loaded, and send
        each replica its rows in one call; returns whether `source` is exhausted."""
        live = [rep for rep in self._replicas if rep.state is EngineState.LIVE]
        heap = [(len(rep.in_flight), rep.index) for rep in live if len(rep.in_flight) < rep.window]
        heapq.heapify(heap)
        batches: dict[int, list[tuple[int, Request]]] = {rep.index: [] for rep in live}
        while heap:
            if queue:
                row = queue.popleft()
            elif is_exhausted:
                break
            else:
                row = next(source, None)
                if row is None:
                    is_exhausted = True
                    break
            load, index = heapq.heappop(heap)
            batches[index].append(row)
            self._replicas[index].in_flight[row[0]] = row[1]
            if load + 1 < self._replicas[index].window:
                heapq.heappush(heap, (load + 1, index))
        for rep in live:
            rows = batches[rep.index]
            is_final = is_exhausted and not queue
            if rows or (is_final and not rep.is_told_final):
                rep.is_told_final = is_final
                rep.handle.submit.remote(rep.token, epoch, next(rep.seq), rows, is_final)
        return is_exhausted

    def _wait(
        self,
        epoch: int,
        live: list[_Replica],
        queue: collections.deque[tuple[int, Request]],
        timeout: float,
    ) -> list[RequestOutput]:
        """Wait for a poll or a restart probe; returns the rows finished meanwhile."""
        for rep in live:
            if rep.poll is None:
                rep.poll = rep.handle.poll.remote(rep.token, epoch, POLL_WAIT_S)
        by_ref = {rep.poll: rep for rep in live}
        by_ref.update({rep.probe: rep for rep in self._replicas if rep.probe is not None})
        done, _ = ray.wait(list(by_ref), num_returns=1, timeout=timeout)
        finished: list[RequestOutput] = []
        for ref in done:
            rep = by_ref[ref]
            if ref == rep.probe:
                self._wait_probes(0)
                continue
            rep.poll = None
            try:
                polled = ray.get(ref)
            except RayError as e:
                is_alive = not isinstance(e, RayActorError)
                self._fail(rep, _error_text(e), queue, is_alive=is_alive)
                continue
            if polled is None:
                self._fail(rep, "Ray restarted it", queue, is_alive=False)
                continue
            outputs, rep.stats = polled
            for position, out in outputs:
                if rep.in_flight.pop(position, None) is not None:
                    finished.append(out)
        return finished

    def _wait_probes(self, timeout: float | None) -> None:
        """Wait for restart or start-up probes; a replica that answers is live again."""
        probes = {rep.probe: rep for rep in self._replicas if rep.probe is not None}
        done, _ = ray.wait(list(probes), num_returns=1, timeout=timeout)
        for ref in done:
            rep = probes[ref]
            rep.probe = None
            try:
                token, rep.info, max_in_flight = ray.get(ref)
            except ActorUnavailableError:
                # NOTE: the actor is being restarted; ask again until it answers or is dead.
                rep.probe = rep.handle.ready.remote()
                continue
            except RayError as e:
                self._last_error = _error_text(e)
                rep.state = EngineState.DEAD
                ray.kill(rep.handle)
                continue
            if token == rep.token:
                # NOTE: the failed incarnation answered before the kill that restarts it landed.
                rep.probe = rep.handle.ready.remote()
                continue
            rep.token = token
            rep.window = max_in_flight + TOKENIZE_BATCH
            rep.seq = itertools.count()
            rep.is_told_final = False
            rep.state = EngineState.LIVE

    def _fail(
        self,
        rep: _Replica,
        error: str,
        queue: collections.deque[tuple[int, Request]],
        *,
        is_alive: bool,
    ) -> None:
        """A replica failed: its rows go back to the queue (in input order), then it restarts
        if it may, else it is dead. Ray restarts an actor whose process died by itself; one
        still alive (`is_alive`: its engine failed) is killed for that."""
        self._last_error = f"replica {rep.index}: {error}"
        queue.extendleft(sorted(rep.in_flight.items(), reverse=True))
        rep.in_flight.clear()
        rep.stats = None
        if rep.num_restarts < self.settings.max_restarts:
            rep.num_restarts += 1
            rep.state = EngineState.RESTARTING
            if is_alive:
                ray.kill(rep.handle, no_restart=False)
            rep.probe = rep.handle.ready.remote()
        else:
            rep.state = EngineState.DEAD
            ray.kill(rep.handle)

    def _end_stream(self, epoch: int) -> None:
        """Stop every replica's rows of this stream (a stream closed early leaves some)."""
        calls = []
        for rep in self._replicas:
            rep.poll = None
            if rep.state is EngineState.LIVE and rep.in_flight:
                calls.append(rep.handle.abort.remote(epoch))
            rep.in_flight.clear()
        with contextlib.suppress(RayError, GetTimeoutError):
            ray.get(calls, timeout=_SHUTDOWN_S)

    def shutdown(self) -> None:
        calls = [
            rep.handle.shutdown.remote() for rep in self._replicas if rep.state is EngineState.LIVE
        ]
        try:
            ray.wait(calls, num_returns=len(calls), timeout=_SHUTDOWN_S)
        finally:
            for rep in self._replicas:
                ray.kill(rep.handle)
                rep.state = EngineState.DEAD
            if self._owns_ray:
                ray.shutdown()


def _init_ray(address: str | None) -> None:
    """Join or start the Ray cluster, keeping this process's signal handlers.

    NOTE: ray.init installs its own SIGTERM (and SIGINT) handlers, which would exit at once
    instead of letting the job drain, commit and print the resume command."""
    main = threading.current_thread() is threading.main_thread()
    handlers = {signum: signal.getsignal(signum) for signum in _KEPT_SIGNALS} if main else {}
    # NOTE: Ray's own log lines would break up the dashboard; its errors still raise.
    ray.init(
        address=address,
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.ERROR,
    )
    for signum, handler in handlers.items():
        if handler is not None:
            signal.signal(signum, handler)


def _as_row(position: int, item: Any, defaults: SamplingParams) -> tuple[int, Request]:
    """The row as a Request carrying its index and resolved params (an unusable item becomes
    an empty Request, which the replica's LLM turns into an error output)."""
    if isinstance(item, str):
        item = Request(prompt=item)
    elif isinstance(item, list):
        item = Request(messages=item)
    elif not isinstance(item, Request):
        item = Request()
    return position, dataclasses.replace(
        item,
        index=position if item.index is None else item.index,
        sampling_params=item.sampling_params or defaults,
    )


def _error_text(error: BaseException) -> str:
    cause = getattr(error, "cause", None)
    text = str(cause if isinstance(cause, BaseException) else error).strip()
    return text.splitlines()[-1] if text else type(error).__name__
