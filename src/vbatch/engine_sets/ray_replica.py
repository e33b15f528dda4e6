"""ReplicaEngine: one `vbatch.LLM` inside a Ray actor, fed and drained in batches (`--ray`)."""

from __future__ import annotations

import collections
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

from vbatch.client.outputs import Request, RequestOutput
from vbatch.protocol import Ready, SchedulerStats

# NOTE: after the first finished row, a poll waits this long for the rest of that engine step's
# rows, so results cross to the driver in batches rather than one call per row.
POLL_LINGER_S = 0.01
_TICK_S = 0.25


class ReplicaEngine:
    """An engine whose rows arrive by `submit` and leave by `poll`, both from other threads.

    Invariants: one inner `LLM.stream` at a time runs on the engine thread, pulling rows from
    the inbox and blocking while it is empty, until the driver marked its input final; each row
    carries the driver's position, returned beside its output. `token` names this incarnation:
    rows sent to an earlier one (before a restart) are refused.
    """

    def __init__(self, model: str | None, engine_args: dict[str, Any]) -> None:
        from vbatch.llm import LLM

        self.llm = LLM(model, **engine_args)
        self.token = uuid.uuid4().hex
        self._cond = threading.Condition()
        self._inbox: collections.deque[tuple[int, int, Request]] = collections.deque()
        self._outbox: list[tuple[int, int, RequestOutput]] = []
        self._epoch = -1
        self._last_seq = -1
        self._is_final = False
        self._is_stopping = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="vbatch-replica", daemon=True)
        self._thread.start()

    def ready(self) -> tuple[str, Ready, int]:
        """This incarnation's token, its engine facts and how many rows it keeps in flight."""
        return self.token, self.llm.engine_info, self.llm.max_in_flight

    def submit(
        self, token: str, epoch: int, seq: int, rows: list[tuple[int, Request]], is_final: bool
    ) -> bool:
        """Queue rows of the driver's stream `epoch`; False if they were meant for another
        incarnation. `is_final` of the highest `seq` says whether more rows will follow."""
        if token != self.token:
            return False
        with self._cond:
            if epoch != self._epoch:
                self._start_epoch(epoch)
            self._inbox.extend((epoch, position, req) for position, req in rows)
            if seq > self._last_seq:
                self._last_seq, self._is_final = seq, is_final
            self._cond.notify_all()
        return True

    def poll(
        self, token: str, epoch: int, max_wait: float
    ) -> tuple[list[tuple[int, RequestOutput]], SchedulerStats | None] | None:
        """The finished rows of stream `epoch` (waiting up to `max_wait` for one), and the
        engine's latest stats; None if `token` names an earlier incarnation, whose rows this one
        never got. Raises the engine's error once it failed."""
        if token != self.token:
            return None
        deadline = time.monotonic() + max_wait
        with self._cond:
            while not self._has_output(epoch) and self._error is None:
                left = deadline - time.monotonic()
                if left <= 0 or epoch != self._epoch:
                    break
                self._cond.wait(left)
            if self._error is not None:
                raise self._error
            if self._has_output(epoch):
                linger = time.monotonic() + POLL_LINGER_S
                while (left := linger - time.monotonic()) > 0 and self._error is None:
                    self._cond.wait(left)
            found = [(position, out) for e, position, out in self._outbox if e == epoch]
            self._outbox = [entry for entry in self._outbox if entry[0] > epoch]
        return found, self.llm.latest_stats

    def abort(self, epoch: int) -> None:
        """The driver's stream `epoch` ended early: drop its queued rows and stop its live ones."""
        with self._cond:
            if epoch == self._epoch:
                self._start_epoch(epoch + 1)
                self._is_final = True
            self._cond.notify_all()

    def shutdown(self) -> None:
        with self._cond:
            self._is_stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=30)
        self.llm.shutdown()

    def _start_epoch(self, epoch: int) -> None:
        self._epoch = epoch
        self._last_seq = -1
        self._is_final = False
        self._inbox.clear()
        self._outbox.clear()

    def _has_output(self, epoch: int) -> bool:
        return any(e == epoch for e, _, _ in self._outbox)

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._inbox and not self._is_stopping:
                        self._cond.wait()
                    if self._is_stopping:
                        return
                    epoch = self._epoch
                self._stream(epoch)
        except BaseException as e:
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _stream(self, epoch: int) -> None:
        """One inner stream over the inbox, until the input is final and every row finished."""
        positions: dict[int, int] = {}
        stream = self.llm.stream(self._rows(epoch, positions), idle_s=_TICK_S)
        try:
            for out in stream:
                with self._cond:
                    if self._epoch != epoch or self._is_stopping:
                        return
                    if out is not None:
                        position = positions.pop(out.index)
                        self._outbox.append((epoch, position, out))
                        self._cond.notify_all()
        finally:
            stream.close()

    def _rows(self, epoch: int, positions: dict[int, int]) -> Iterator[Request | None]:
        """The inbox's rows for the inner stream. While rows are in flight and the inbox is
        empty, None after a short wait: the stream then moves their outputs to the outbox,
        which is what brings the driver's next rows (blocking here deadlocked the two)."""
        while True:
            with self._cond:
                if not self._inbox and not self._is_final and not self._is_stopping:
                    self._cond.wait(POLL_LINGER_S if positions else None)
                if self._is_stopping or self._epoch != epoch:
                    return
                if not self._inbox and self._is_final:
                    return
                entry = self._inbox.popleft() if self._inbox else None
            if entry is None:
                yield None
                continue
            _, position, req = entry
            positions[req.index] = position
            yield req
