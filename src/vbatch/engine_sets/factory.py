"""open_engine_set: the one place an engine set is built, whichever kind a job asks for."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vbatch.engine_sets.base import EngineSet, RaySettings, require_ray


def open_engine_set(
    model: str | None,
    *,
    ray: RaySettings | None = None,
    data_parallel_size: int = 1,
    max_in_flight: int | None = None,
    on_progress: Callable[[str], None] | None = None,
    **engine_args: Any,
) -> EngineSet:
    """Ray replicas with `ray`, else one `LLM` over `data_parallel_size` local cores."""
    if ray is not None:
        require_ray()
        from vbatch.engine_sets.ray import RayEngines

        return RayEngines(
            model, ray, max_in_flight=max_in_flight, on_progress=on_progress, **engine_args
        )
    from vbatch.llm import LLM

    return LLM(
        model,
        max_in_flight=max_in_flight,
        data_parallel_size=data_parallel_size,
        on_progress=on_progress,
        **engine_args,
    )
