"""The engine core: scheduler, KV-cache blocks, model runner and sampler (torch lives here)."""

from typing import Any

__all__ = ["EngineCore"]


def __getattr__(name: str) -> Any:
    if name == "EngineCore":
        from vbatch.engine.core import EngineCore

        return EngineCore
    raise AttributeError(name)
