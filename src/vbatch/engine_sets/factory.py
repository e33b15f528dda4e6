"""open_engine_set: the one place an engine set is built, whichever kind a job asks for."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vbatch.engine.preload import discard_preloaded
from vbatch.engine_sets.base import EngineSet, RaySettings, require_ray


def open_engine_set(
    model: str | None,
    *,
    ray: RaySettings | None = None,
    data_parallel_size: int = 1,
    max_in_flight: int | None = None,
    on_progress: Callable[[str], None] | None = None,
    on_notice: Callable[[str], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    **engine_args: Any,
) -> EngineSet:
    """Ray replicas with `ray`, else one `LLM` over `data_parallel_size` local cores. Either of
    the first two frees the CPU of a core the CLI preloaded (engine/preload.py): none adopts it.

    `on_notice` takes lines worth showing the user (which Ray cluster is used, replicas waiting
    for resources); `should_stop` is polled while a start-up that `starts_briefly` says waits
    only in short polls, which then raises StartupCancelled."""
    if ray is not None or data_parallel_size > 1:
        discard_preloaded()
    if ray is not None:
        require_ray()
        from vbatch.engine_sets.ray import RayEngines

        return RayEngines(
            model,
            ray,
            max_in_flight=max_in_flight,
            on_progress=on_progress,
            on_notice=on_notice,
            should_stop=should_stop,
            **engine_args,
        )
    from vbatch.llm import LLM

    return LLM(
        model,
        max_in_flight=max_in_flight,
        data_parallel_size=data_parallel_size,
        on_progress=on_progress,
        **engine_args,
    )


def starts_briefly(ray: RaySettings | None) -> bool:
    """Whether `open_engine_set` for these settings waits only in short polls (see
    `EngineSet.waits_briefly`): then a stop signal must not raise while it runs."""
    return ray is not None
