"""LoRARequest (vLLM's name and fields) and LoraRef, the adapter reference a request carries."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import msgspec


@dataclass(frozen=True)
class LoRARequest:
    """One PEFT adapter directory, named: `LoRARequest(name, int_id, path)` as in vLLM.

    `lora_int_id` is the caller's id for the adapter (positive); an LLM checks that one name
    keeps one id and one path.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        # NOTE: as vLLM: 0 and below never name an adapter.
        if (
            not isinstance(self.lora_int_id, int)
            or isinstance(self.lora_int_id, bool)
            or self.lora_int_id < 1
        ):
            raise ValueError(f"lora_int_id must be an int > 0, got {self.lora_int_id!r:.40}")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


class LoraRef(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """The adapter a request runs with, as sent to the core: its id there (positive, one per
    adapter for the LLM's life), its name and its directory."""

    lora_id: int
    name: str
    path: str


def startup_requests(loras: Iterable[Sequence[str]] | None) -> dict[str, LoRARequest]:
    """Name → LoRARequest for an engine's start-up adapters ((name, path) pairs), with the ids
    1, 2, ... the core gives them."""
    return {
        name: LoRARequest(name, lora_id, str(path))
        for lora_id, (name, path) in enumerate(loras or (), start=1)
    }
