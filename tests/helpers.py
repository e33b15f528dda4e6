"""Helpers shared by several test modules: a shared real engine for jobs, JSONL files, process
exits."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson
import psutil


class SharedLLM:
    """The real engine, started once for this module; a job's shutdown() leaves it running."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def __getattr__(self, name: str) -> Any:
        return getattr(self.llm, name)

    def shutdown(self) -> None:
        pass


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def wait_gone(pid: int, timeout: float) -> bool:
    """True once `pid` has exited (a zombie awaiting a reaper counts as exited)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False
