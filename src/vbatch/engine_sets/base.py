"""The interface the job layer drives: a set of engines behind one `stream`.

One engine core (`LLM`), N cores on this machine (`-dp N`) and N Ray replicas (`--ray`) all
implement `EngineSet`; the job layer (`job/execution.py`) does not know which one it drives.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from vbatch.errors import ConfigError
from vbatch.protocol import Ready, SchedulerStats

if TYPE_CHECKING:
    from vbatch.client.outputs import Request, RequestOutput
    from vbatch.client.tokenizer import TextTokenizer
    from vbatch.sampling_params import SamplingParams


class EngineState(enum.Enum):
    STARTING = "starting"
    LIVE = "live"
    RESTARTING = "restarting"
    DEAD = "dead"


@dataclass(frozen=True)
class EngineReport:
    """One engine of a set, as the dashboard shows it: `name` is e.g. "core 1" or "replica 0"."""

    name: str
    state: EngineState
    stats: SchedulerStats | None
    num_in_flight: int


class StartupCancelled(Exception):
    """A stop was asked for (`should_stop`) while an engine set was starting."""


class EngineSet(Protocol):
    """What the job layer needs from its engines.

    `stream` yields finished requests in completion order (None on an idle tick with `idle_s`),
    each `RequestOutput.index` being the position of its input in `inputs`. `latest_stats` is
    the sum over the set's engines, as is `engine_info`'s KV cache; `engine_reports` lists the
    engines one by one.
    """

    engine_info: Ready
    tokenizer: TextTokenizer
    # NOTE: True when `stream` only ever waits in short polls: a stop signal must then set a
    # flag and never raise inside it (the job reads its flags at each item or idle tick).
    waits_briefly: bool

    @property
    def latest_stats(self) -> SchedulerStats | None: ...

    def engine_reports(self) -> list[EngineReport]: ...

    def stream(
        self,
        inputs: Iterable[str | list[dict] | Request],
        sampling_params: SamplingParams | None = None,
        *,
        on_output: Callable[[RequestOutput], None] | None = None,
        idle_s: float | None = None,
    ) -> Iterator[RequestOutput | None]: ...

    def shutdown(self) -> None: ...


def sum_stats(stats: Sequence[SchedulerStats | None]) -> SchedulerStats | None:
    """The engines' stats added field by field (`kv_usage` averaged over KV blocks)."""
    known = [s for s in stats if s is not None]
    if not known:
        return None
    if len(known) == 1:
        return known[0]
    total = SchedulerStats()
    for field in SchedulerStats.__struct_fields__:
        setattr(total, field, sum(getattr(s, field) for s in known))
    blocks = total.num_kv_blocks
    total.kv_usage = (
        sum(s.kv_usage * s.num_kv_blocks for s in known) / blocks
        if blocks
        else sum(s.kv_usage for s in known) / len(known)
    )
    return total


RAY_MISSING = "--ray needs Ray, which is not installed: pip install 'vbatch[ray]'"


@dataclass(frozen=True)
class RaySettings:
    """Where a `--ray` job's replicas run: the cluster, how many, what each one asks Ray for."""

    address: str | None = None
    replicas: int = 1
    gpus_per_replica: float = 0.0
    cpus_per_replica: float = 1.0
    max_restarts: int = 1

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ConfigError(f"--replicas must be at least 1, got {self.replicas}")
        if self.cpus_per_replica <= 0 or self.gpus_per_replica < 0:
            raise ConfigError("--cpus-per-replica must be > 0 and --gpus-per-replica >= 0")
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be >= 0, got {self.max_restarts}")


def require_ray() -> None:
    """Refuse `--ray` in one line when the `ray` extra is not installed."""
    try:
        import ray  # noqa: F401
    except ImportError:
        raise ConfigError(RAY_MISSING) from None
