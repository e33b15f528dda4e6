"""Helpers shared by the job-layer tests: a shared real engine, JSONL files in and out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson


class SharedLLM:
    """The real engine, started once for this module; a job's shutdown() leaves it running."""

    def __init__(self, llm: Any) -> None:
        self._llm = llm

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    def shutdown(self) -> None:
        pass


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]
