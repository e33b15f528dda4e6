"""RunOptions and a job's sampling defaults: the one home of run defaults (light)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from vbatch.engine_sets.base import RaySettings
from vbatch.errors import ConfigError
from vbatch.sampling_params import SamplingParams

# NOTE: a job is greedy (reproducible, so a resumed job equals an uninterrupted one) and allows
# longer outputs than a bare SamplingParams.
JOB_SAMPLING = SamplingParams(max_tokens=256, temperature=0.0)
# NOTE: an OpenAI Batch line that sets no temperature or top_p gets OpenAI's documented defaults,
# as it would from OpenAI; `vbatch run --temperature/--top-p` given on the command line win.
OPENAI_LINE_DEFAULTS = {"temperature": 1.0, "top_p": 1.0}


@dataclass(frozen=True)
class RunOptions:
    """How a job runs (not what it produces); `vbatch resume` may change these."""

    commit_every_rows: int = 5000
    commit_every_seconds: float = 5.0
    max_errors: float | None = None
    drain_timeout_s: float = 30.0
    max_in_flight: int | None = None
    data_parallel_size: int = 1
    display: str = "auto"
    log_interval_s: float = 10.0
    metrics_file: Path | None = None
    clean: bool = False
    ray: RaySettings | None = None

    def __post_init__(self) -> None:
        if self.ray is not None and self.data_parallel_size > 1:
            raise ConfigError(
                "-dp is for engine cores on this machine; a --ray job runs --replicas engines "
                "(each with --cpus-per-replica threads), so drop -dp"
            )

    @classmethod
    def restore(cls, saved: dict[str, Any], overrides: dict[str, Any]) -> RunOptions:
        """The options a resumed job runs with: those it saved (`result_settings`), then
        `overrides` (RunOptions fields, and `ray_address`, which only a `--ray` job takes)."""
        values = {**saved, **overrides}
        settings = values.pop("ray", None)
        address = values.pop("ray_address", None)
        if address is not None:
            if settings is None:
                raise ConfigError("--ray-address is for jobs started with --ray; this one was not")
            settings = replace(settings, address=address)
        return cls(**values, ray=settings)

    def result_settings(self) -> dict[str, Any]:
        """The options a job's manifest keeps, so that a resume goes on with them."""
        return {
            "ray": self.ray,
            "commit_every_rows": self.commit_every_rows,
            "commit_every_seconds": self.commit_every_seconds,
            "max_errors": self.max_errors,
            "drain_timeout_s": self.drain_timeout_s,
            "max_in_flight": self.max_in_flight,
            "data_parallel_size": self.data_parallel_size,
        }
