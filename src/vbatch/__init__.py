"""vbatch: batch offline inference for Llama-family models."""

from typing import TYPE_CHECKING, Any

from vbatch.errors import (
    ConfigError,
    EngineDeadError,
    EngineStartupError,
    SamplingParamsError,
    VbatchError,
)
from vbatch.sampling_params import SamplingParams
from vbatch.structured import GuidedDecodingParams, StructuredOutput, StructuredOutputsParams

__version__ = "0.1.0"

if TYPE_CHECKING:
    from vbatch.engine_args import EngineArgs
    from vbatch.llm import LLM, CompletionOutput, RequestOutput
    from vbatch.lora.request import LoRARequest

__all__ = [
    "LLM",
    "CompletionOutput",
    "ConfigError",
    "EngineArgs",
    "EngineDeadError",
    "EngineStartupError",
    "GuidedDecodingParams",
    "LoRARequest",
    "RequestOutput",
    "SamplingParams",
    "SamplingParamsError",
    "StructuredOutput",
    "StructuredOutputsParams",
    "VbatchError",
]


def __getattr__(name: str) -> Any:
    # NOTE: lazy so that `import vbatch` (and `vbatch --help`) never pulls in transformers or zmq.
    if name in ("LLM", "RequestOutput", "CompletionOutput"):
        from vbatch import llm

        return getattr(llm, name)
    if name == "EngineArgs":
        from vbatch.engine_args import EngineArgs

        return EngineArgs
    if name == "LoRARequest":
        from vbatch.lora.request import LoRARequest

        return LoRARequest
    raise AttributeError(name)
