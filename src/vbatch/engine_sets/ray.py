"""RayEngines: the engine set of `--ray`: N Ray actors (one LLM each) behind one stream."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import heapq
import itertools
import math
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayError

from vbatch.client.core_client import sweep_stale_ipc_dirs
from vbatch.client.outputs import Request, RequestOutput
from vbatch.client.tokenizer import TextTokenizer
from vbatch.engine_sets.base import (
    EngineReport,
    EngineState,
    RaySettings,
    StartupCancelled,
    sum_stats,
)
from vbatch.engine_sets.ray_cluster import (
    ClusterWatch,
    RayCluster,
    alive_nodes,
    check_resources,
    free_resources,
    gcs_problem,
    open_cluster,
    pending_notice,
)
from vbatch.engine_sets.ray_replica import ReplicaEngine
from vbatch.engine_sets.stream import stream_loop
from vbatch.errors import EngineDeadError, EngineStartupError
from vbatch.protocol import Ready, SchedulerStats
from vbatch.sampling_params import SamplingParams

POLL_WAIT_S = 1.0
REPLICA_NAME_PREFIX = "vbatch-replica-"
_WAIT_CAP_S = 1.0
STARTUP_GRACE_S = 60.0
# NOTE: how long replicas may wait for CPUs or GPUs before the job says so (and goes on waiting).
PENDING_NOTICE_S = 20.0
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

    # NOTE: every wait in here is a short poll, so a stop signal must only set a flag: an
    # exception raised by a handler inside ray.wait breaks Ray ("SystemError: ... returned a
    # result with an exception set").
    waits_briefly = True

    def __init__(
        self,
        model: str | None,
        settings: RaySettings,
        *,
        max_in_flight: int | None = None,
        on_progress: Callable[[str], None] | None = None,
        on_notice: Callable[[str], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        **engine_args: Any,
    ) -> None:
        from vbatch.models.loader import resolve_model

        self.settings = settings
        self._replicas: list[_Replica] = []
        self._notice = on_notice or _ignore
        self._should_stop = should_stop or _never
        self._watch: ClusterWatch | None = None
        self._epochs = itertools.count()
        self._last_error = ""
        self._nodes: dict[str, str] = {}
        self._is_started = False
        sweep_stale_ipc_dirs()
        self.cluster: RayCluster = open_cluster(settings.address, on_progress, self._should_stop)
        try:
            self._notice(f"Ray: using {self.cluster.description}")
            if not self.cluster.address.startswith("ray://"):
                self._watch = ClusterWatch(self.cluster.address)
            self._nodes = alive_nodes()
            fits = check_resources(settings)
            if fits < settings.replicas:
                self._notice(
                    f"Ray: {fits} of {settings.replicas} replicas fit in the free resources "
                    f"now ({free_resources()}); the others wait until the cluster has room"
                )
            self.tokenizer = TextTokenizer.from_dir(resolve_model(model).hf_dir)
            args = {"num_threads": max(1, int(settings.cpus_per_replica)), **engine_args}
            if max_in_flight is not None:
                # NOTE: the job's bound is for all replicas together, as it is for -dp cores.
                args["max_in_flight"] = max(1, math.ceil(max_in_flight / settings.replicas))
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
            self.engine_info: Ready = self._start(on_progress)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, on_progress: Callable[[str], None] | None) -> Ready:
        """Wait for every replica, or for STARTUP_GRACE_S after the first is live (the others,
        maybe waiting for resources, join the stream when they are up). Replicas still not
        placed after PENDING_NOTICE_S are named, with the free resources."""
        for rep in self._replicas:
            rep.probe = rep.handle.ready.remote()
        start_t = time.monotonic()
        first_live_t = None
        is_told = False
        while any(rep.state is EngineState.STARTING for rep in self._replicas):
            if self._should_stop():
                raise StartupCancelled
            self._check_cluster()
            live = [rep for rep in self._replicas if rep.state is EngineState.LIVE]
            if live and first_live_t is None:
                first_live_t = time.monotonic()
            if first_live_t is not None and time.monotonic() - first_live_t > STARTUP_GRACE_S:
                break
            stage = f"starting Ray replicas ({len(live)} of {len(self._replicas)} live)"
            if not is_told and time.monotonic() - start_t > PENDING_NOTICE_S:
                num_starting = sum(rep.state is EngineState.STARTING for rep in self._replicas)
                self._notice(pending_notice(self.settings, num_starting))
                is_told = True
            if is_told:
                stage += f" ({free_resources()})"
            if on_progress is not None:
                on_progress(stage)
            self._wait_probes(_WAIT_CAP_S)
        if not any(rep.state is EngineState.LIVE for rep in self._replicas):
            raise EngineStartupError(f"no Ray replica started: {self._last_error}")
        self._is_started = True
        return self._set_info()

    def _set_info(self) -> Ready:
        """The set's engine facts: the KV cache summed over the replicas that have started."""
        infos = [rep.info for rep in self._replicas if rep.info is not None]
        self.engine_info = msgspec.structs.replace(
            infos[0],
            num_kv_blocks=sum(i.num_kv_blocks for i in infos),
            kv_cache_bytes=sum(i.kv_cache_bytes for i in infos),
        )
        return self.engine_info

    def _check_cluster(self) -> None:
        if self._watch is not None and self._watch.lost is not None:
            raise EngineDeadError(self._watch.lost)

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
        defaults.check_vocab(self.engine_info.vocab_size)
        epoch = next(self._epochs)
        source = (_as_row(pos, item, defaults) for pos, item in enumerate(inputs))
        for rep in self._replicas:
            rep.is_told_final = False
        try:
            for _, out in stream_loop(_RayStream(self, epoch, source), idle_s):
                if on_output is not None and out is not None:
                    on_output(out)
                yield out
        finally:
            self._end_stream(epoch)

    def _death_cause(self) -> str:
        """Why no replica is left: the cluster or a node gone, else the replicas' own deaths."""
        address = self.cluster.address
        if not address.startswith("ray://"):
            problem = gcs_problem(address)
            if problem is not None:
                return f"the Ray cluster is gone: its GCS at {address} does not answer ({problem})"
        alive = alive_nodes()
        gone = [name for node, name in self._nodes.items() if node not in alive]
        if gone:
            return (
                f"the Ray node {', '.join(gone)} is gone (its raylet died or the machine left "
                f"the cluster), and its replicas with it ({self._last_error})"
            )
        return f"every Ray replica died ({self._last_error}); no restart is left"

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
    ) -> list[tuple[int, RequestOutput]]:
        """Wait for a poll or a restart probe; returns the rows finished meanwhile."""
        for rep in live:
            if rep.poll is None:
                rep.poll = rep.handle.poll.remote(rep.token, epoch, POLL_WAIT_S)
        by_ref = {rep.poll: rep for rep in live}
        by_ref.update({rep.probe: rep for rep in self._replicas if rep.probe is not None})
        done, _ = ray.wait(list(by_ref), num_returns=1, timeout=timeout)
        finished: list[tuple[int, RequestOutput]] = []
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
                    finished.append((position, out))
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
            # NOTE: the same look-ahead as one local engine (which holds at most max_in_flight
            # rows), split over the replicas: a drain waits for every row sent.
            rep.window = max_in_flight
            rep.seq = itertools.count()
            rep.is_told_final = False
            rep.state = EngineState.LIVE
            if self._is_started:
                self._set_info()

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
        is_lost = self._watch is not None and self._watch.lost is not None
        for rep in self._replicas:
            rep.poll = None
            if is_lost:
                rep.in_flight.clear()
                continue
            if rep.state is EngineState.LIVE and rep.in_flight:
                calls.append(rep.handle.abort.remote(epoch))
            rep.in_flight.clear()
        with contextlib.suppress(RayError, GetTimeoutError):
            ray.get(calls, timeout=_SHUTDOWN_S)

    def shutdown(self) -> None:
        """Stop the replicas, leave the cluster (stopping it if vbatch started it)."""
        is_lost = self._watch is not None and self._watch.lost is not None
        try:
            if not is_lost:
                calls = [
                    rep.handle.shutdown.remote()
                    for rep in self._replicas
                    if rep.state is EngineState.LIVE
                ]
                with contextlib.suppress(RayError):
                    ray.wait(calls, num_returns=len(calls), timeout=_SHUTDOWN_S)
                for rep in self._replicas:
                    with contextlib.suppress(RayError):
                        ray.kill(rep.handle)
        finally:
            for rep in self._replicas:
                rep.state = EngineState.DEAD
            if self._watch is not None:
                self._watch.close()
            self.cluster.stop()


class _RayStream:
    """`StreamEngine` over the replicas for one stream (`epoch`): `queue` holds rows taken
    back from failed replicas, sent again before new input."""

    def __init__(
        self, engines: RayEngines, epoch: int, source: Iterator[tuple[int, Request]]
    ) -> None:
        self.engines = engines
        self.epoch = epoch
        self.source = source
        self.queue: collections.deque[tuple[int, Request]] = collections.deque()
        self.is_exhausted = False
        self.finished: list[tuple[int, RequestOutput]] = []

    def _live(self) -> list[_Replica]:
        return [rep for rep in self.engines._replicas if rep.state is EngineState.LIVE]

    def fill(self) -> bool:
        self.is_exhausted = self.engines._dispatch(
            self.epoch, self.source, self.queue, self.is_exhausted
        )
        return not self.is_exhausted

    def take_finished(self) -> list[tuple[int, RequestOutput]]:
        finished, self.finished = self.finished, []
        return finished

    def is_idle(self) -> bool:
        return not self.queue and not any(rep.in_flight for rep in self._live())

    def wait_limit(self, is_more: bool) -> float | None:
        return _WAIT_CAP_S

    def wait(self, timeout: float | None) -> None:
        engines = self.engines
        engines._check_cluster()
        live = self._live()
        if not live and not engines._is_coming():
            raise EngineDeadError(engines._death_cause())
        wait_s = _WAIT_CAP_S if timeout is None else timeout
        self.finished += engines._wait(self.epoch, live, self.queue, wait_s)


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


def _ignore(text: str) -> None:
    return None


def _never() -> bool:
    return False
