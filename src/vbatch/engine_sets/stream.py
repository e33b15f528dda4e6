"""The stream loop every engine set shares: fill, hand back finished rows, idle ticks, wait."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from vbatch.client.outputs import RequestOutput


class StreamEngine(Protocol):
    """One stream's view of its engines, as `stream_loop` drives it."""

    def fill(self) -> bool:
        """Send inputs as far as the look-ahead allows; whether more input may follow."""
        ...

    def take_finished(self) -> list[tuple[int, RequestOutput]]:
        """The rows finished since the last call, each with its input position."""
        ...

    def is_idle(self) -> bool:
        """Whether no row is in flight or waiting to be sent."""
        ...

    def wait_limit(self, is_more: bool) -> float | None:
        """The longest the next wait may block (None: until a row finishes)."""
        ...

    def wait(self, timeout: float | None) -> None:
        """Wait up to `timeout` for rows to finish, collecting them for `take_finished`."""
        ...


def stream_loop(
    engine: StreamEngine, idle_s: float | None
) -> Iterator[tuple[int, RequestOutput | None]]:
    """Yield (position, output) as rows finish; with `idle_s`, also (-1, None) each time
    `idle_s` seconds pass without a finished row. Ends when the input is used up and every row
    has finished, or when the feed raises (after the rows finished by then); closing it early
    is the caller's to clean up."""
    idle_deadline = None if idle_s is None else time.monotonic() + idle_s
    while True:
        try:
            is_more = engine.fill()
        except Exception:
            # NOTE: a feed that fails (its file went away, an input no prompt) ends the stream,
            # after the rows already finished are handed back.
            yield from engine.take_finished()
            raise
        finished = engine.take_finished()
        yield from finished
        if finished and idle_s is not None:
            idle_deadline = time.monotonic() + idle_s
        if engine.is_idle() and not is_more:
            return
        timeout = engine.wait_limit(is_more)
        if idle_s is not None and idle_deadline is not None:
            if time.monotonic() >= idle_deadline:
                yield -1, None
                idle_deadline = time.monotonic() + idle_s
            left = max(0.0, idle_deadline - time.monotonic())
            timeout = left if timeout is None else min(timeout, left)
        engine.wait(timeout)
