"""LoRA adapters: the request type, PEFT adapter reading, and the engine's adapter slots."""

from vbatch.lora.request import LoRARequest

__all__ = ["LoRARequest"]
