"""DataParallelClient: N engine cores on this machine behind the EngineCoreClient interface."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from vbatch.client.core_client import EngineCoreClient, check_request_params
from vbatch.client.placement import LoadBalancer, core_placements
from vbatch.config import CorePlacement, EngineConfig
from vbatch.engine_sets.base import EngineReport, EngineState, sum_stats
from vbatch.errors import EngineDeadError
from vbatch.protocol import AddRequest, EngineOutputs, FinishReason, Ready, SchedulerStats

_WAIT_S = 0.5


class DataParallelClient:
    """Several engine cores, each a full engine in its own process, as one client.

    Invariants: a request id lives on exactly one core, from add_requests until its last sample
    finishes (or an ERROR finish ends it); aborts go to that core only. Every core's socket
    thread sets one shared event after each result it queues, so get_outputs sleeps on that
    event across all cores instead of polling them.
    """

    def __init__(
        self,
        config: EngineConfig,
        num_cores: int,
        on_progress: Callable[[str], None] | None = None,
        *,
        prefix_aware: bool = True,
    ) -> None:
        self.config = config
        self._wake = threading.Event()
        self._clients = _start_cores(core_placements(config, num_cores), self._wake, on_progress)
        infos = [client.info for client in self._clients]
        first = infos[0]
        self.info = Ready(
            max_model_len=min(info.max_model_len for info in infos),
            num_kv_blocks=sum(info.num_kv_blocks for info in infos),
            block_size=first.block_size,
            device=first.device,
            dtype=first.dtype,
            vocab_size=first.vocab_size,
            kv_cache_bytes=sum(info.kv_cache_bytes for info in infos),
            attention_backend=first.attention_backend,
            pid=first.pid,
            kernels=first.kernels,
            kernel_warnings=first.kernel_warnings,
        )
        self._balancer = LoadBalancer(num_cores, first.block_size, prefix_aware)
        # NOTE: request id -> [core, cost, samples not yet finished]
        self._owner: dict[str, list[int]] = {}

    @property
    def pids(self) -> list[int | None]:
        return [client.pid for client in self._clients]

    @property
    def latest_stats(self) -> SchedulerStats | None:
        return sum_stats([client.latest_stats for client in self._clients])

    def engine_reports(self) -> list[EngineReport]:
        return [
            EngineReport(
                f"core {i}",
                EngineState.LIVE if client.is_alive else EngineState.DEAD,
                client.latest_stats,
                self._balancer.num_live[i],
            )
            for i, client in enumerate(self._clients)
        ]

    def add_requests(self, reqs: Sequence[AddRequest]) -> None:
        """Place each request on a core by load (and prompt prefix) and send it there; raises
        SamplingParamsError, sending none of them, if any one's params are invalid now."""
        check_request_params(reqs, self.info.vocab_size)
        groups: list[list[AddRequest]] = [[] for _ in self._clients]
        for req in reqs:
            params = req.sampling_params
            cost = len(req.prompt_token_ids) // 4 + params.n * (
                params.max_tokens or self.info.max_model_len
            )
            core = self._balancer.place(req.prompt_token_ids, cost)
            self._owner[req.request_id] = [core, cost, params.n]
            groups[core].append(req)
        for client, group in zip(self._clients, groups, strict=True):
            if group:
                client.send_checked(group)

    def abort(self, request_ids: Sequence[str], indices: Sequence[int] | None = None) -> None:
        """Abort these requests (with `indices`, only those samples) on the cores holding them."""
        ids: list[list[str]] = [[] for _ in self._clients]
        picked: list[list[int]] = [[] for _ in self._clients]
        for j, rid in enumerate(request_ids):
            entry = self._owner.get(rid)
            if entry is not None:
                ids[entry[0]].append(rid)
                if indices is not None:
                    picked[entry[0]].append(indices[j])
        for client, core_ids, core_indices in zip(self._clients, ids, picked, strict=True):
            if core_ids:
                client.abort(core_ids, core_indices if indices is not None else None)

    def get_outputs(self, timeout: float | None = None) -> list[EngineOutputs]:
        """Outputs of any cores' steps; [] on timeout; raises if a core died."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._wake.clear()
            outputs: list[EngineOutputs] = []
            for i, client in enumerate(self._clients):
                try:
                    while got := client.get_outputs(timeout=0.0):
                        outputs += got
                except EngineDeadError as e:
                    raise EngineDeadError(f"data-parallel core {i}: {e}") from None
            if outputs:
                self._release_finished(outputs)
                return outputs
            wait = _WAIT_S if deadline is None else min(_WAIT_S, deadline - time.monotonic())
            if wait <= 0:
                return []
            self._wake.wait(wait)

    def _release_finished(self, outputs: list[EngineOutputs]) -> None:
        for step in outputs:
            for finish in step.finished:
                entry = self._owner.get(finish.request_id)
                if entry is None:
                    continue
                entry[2] -= 1
                if entry[2] <= 0 or finish.finish_reason == FinishReason.ERROR:
                    del self._owner[finish.request_id]
                    self._balancer.release(entry[0], entry[1])

    def get_stats(self, timeout: float | None = None) -> SchedulerStats:
        """Fresh stats of every core, added up (see EngineCoreClient.get_stats)."""
        total = sum_stats([client.get_stats(timeout) for client in self._clients])
        assert total is not None
        return total

    def shutdown(self, timeout: float = 5.0) -> None:
        """Shut every core down at once (each as EngineCoreClient.shutdown)."""
        threads = [
            threading.Thread(target=client.shutdown, args=(timeout,), daemon=True)
            for client in self._clients
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


def _start_cores(
    placements: list[tuple[EngineConfig, CorePlacement]],
    wake: threading.Event,
    on_progress: Callable[[str], None] | None,
) -> list[EngineCoreClient]:
    """Start every core at once and wait for all to be READY; if one fails (or this thread is
    interrupted), every core is shut down, those still starting too (a core stuck before READY
    would otherwise hold the job until its start-up limit), and the error is raised."""
    clients: list[EngineCoreClient] = []

    def ready(i: int, client: EngineCoreClient) -> EngineCoreClient:
        progress = None
        if on_progress is not None:
            progress = lambda stage: on_progress(f"core {i}: {stage}")  # noqa: E731
        client.wait_ready(progress)
        return client

    try:
        for config, placement in placements:
            clients.append(
                EngineCoreClient(config, placement=placement, on_result=wake.set, wait=False)
            )
        pool = ThreadPoolExecutor(len(clients), thread_name_prefix="vbatch-dp-start")
        futures = [pool.submit(ready, i, client) for i, client in enumerate(clients)]
        pool.shutdown(wait=False)
        return [future.result() for future in futures]
    except BaseException:
        # NOTE: no core has run a request yet, so none has work to finish.
        for client in clients:
            client.shutdown(timeout=0.0)
        raise
