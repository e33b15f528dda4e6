"""RunOptions and a job's sampling defaults: the one home of run defaults (light)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vbatch.sampling_params import SamplingParams

# NOTE: a job is greedy (reproducible, so a resumed job equals an uninterrupted one) and allows
# longer outputs than a bare SamplingParams.
JOB_SAMPLING = SamplingParams(max_tokens=256, temperature=0.0)


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

    def result_settings(self) -> dict[str, Any]:
        """The options a job's manifest keeps, so that a resume goes on with them."""
        return {
            "commit_every_rows": self.commit_every_rows,
            "commit_every_seconds": self.commit_every_seconds,
            "max_errors": self.max_errors,
            "drain_timeout_s": self.drain_timeout_s,
            "max_in_flight": self.max_in_flight,
            "data_parallel_size": self.data_parallel_size,
        }
