"""ClientLoras: the adapters an LLM has named, each with its id in the cores; torch-free."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from vbatch.errors import LoraError
from vbatch.lora.adapter import read_adapter_config
from vbatch.lora.request import LoraRef, LoRARequest


class ClientLoras:
    """Adapter name → LoraRef. The engine's start-up adapters have ids 1..N in their order;
    a new name gets the next id once its config passes `read_adapter_config` (the core reads
    its tensors when the first request with it arrives). One name keeps one path and one
    caller id."""

    def __init__(
        self, is_enabled: bool, max_lora_rank: int, startup: Iterable[tuple[str, str]] = ()
    ) -> None:
        self.is_enabled = is_enabled
        self.max_lora_rank = max_lora_rank
        self.refs: dict[str, LoraRef] = {}
        self._int_ids: dict[str, int] = {}
        for name, path in startup:
            self.refs[name] = LoraRef(len(self.refs) + 1, name, str(path))

    def ref(self, request: LoRARequest | None) -> LoraRef | None:
        """The core's reference for `request`, or a one-line LoraError."""
        if request is None:
            return None
        if not isinstance(request, LoRARequest):
            raise LoraError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        if not self.is_enabled:
            raise LoraError("a LoRA adapter was requested; create the LLM with enable_lora=True")
        name = request.lora_name
        known = self.refs.get(name)
        int_id = self._int_ids.setdefault(name, request.lora_int_id)
        if int_id != request.lora_int_id:
            raise LoraError(f"LoRA adapter {name!r} has id {int_id}, not {request.lora_int_id}")
        path = request.lora_path
        if known is not None:
            if path and Path(path).resolve() != Path(known.path).resolve():
                raise LoraError(f"LoRA adapter {name!r} is {known.path}, not {path}")
            return known
        if not path:
            raise LoraError(f"LoRA adapter {name!r} is unknown and its request has no path")
        read_adapter_config(name, path, self.max_lora_rank)
        ref = LoraRef(len(self.refs) + 1, name, str(path))
        self.refs[name] = ref
        return ref
