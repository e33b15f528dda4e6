"""The environment the engine core is spawned with."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from vbatch.client.core_client import EngineCoreClient
from vbatch.config import EngineConfig


@pytest.fixture
def no_policy() -> Iterator[None]:
    saved = os.environ.pop("OMP_WAIT_POLICY", None)
    yield
    os.environ.pop("OMP_WAIT_POLICY", None)
    if saved is not None:
        os.environ["OMP_WAIT_POLICY"] = saved


def core_environ(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode().split("=", 1) for entry in entries if b"=" in entry)


@pytest.mark.parametrize("chosen", [None, "ACTIVE"])
def test_core_threads_wait_passively_unless_the_user_chose(
    chosen: str | None, no_policy: None, tiny_model_dir: Path
) -> None:
    if chosen is not None:
        os.environ["OMP_WAIT_POLICY"] = chosen
    client = EngineCoreClient(EngineConfig(model=str(tiny_model_dir), device="cpu", num_threads=1))
    try:
        assert client.pid is not None
        assert core_environ(client.pid)["OMP_WAIT_POLICY"] == (chosen or "PASSIVE")
    finally:
        client.shutdown()
