"""RunOptions: how a job runs, and the one home of its defaults (light: the CLI imports it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class RunOptions:
    """How a job runs (not what it produces); `vbatch resume` may change these."""

    commit_every_rows: int = 5000
    commit_every_seconds: float = 5.0
    max_errors: float | None = None
    drain_timeout: float = 30.0
    max_in_flight: int | None = None
    data_parallel_size: int = 1
    display: str = "auto"
    log_interval: float = 10.0
    metrics_file: Path | None = None
    clean: bool = False

    def result_settings(self) -> dict[str, Any]:
        return {
            "commit_every_rows": self.commit_every_rows,
            "commit_every_seconds": self.commit_every_seconds,
            "max_errors": self.max_errors,
            "drain_timeout": self.drain_timeout,
            "max_in_flight": self.max_in_flight,
            "data_parallel_size": self.data_parallel_size,
        }
