"""vbatch: batch offline inference for Llama-family models."""

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from vbatch.engine_args import EngineArgs
    from vbatch.errors import (
        ConfigError,
        EngineDeadError,
        EngineStartupError,
        SamplingParamsError,
        VbatchError,
    )
    from vbatch.inputs import TextPrompt, TokensPrompt
    from vbatch.llm import LLM
    from vbatch.lora.request import LoRARequest
    from vbatch.outputs import (
        ClassificationRequestOutput,
        CompletionOutput,
        EmbeddingRequestOutput,
        PoolingRequestOutput,
        RequestOutput,
        ScoringRequestOutput,
    )
    from vbatch.pooling_params import PoolingParams
    from vbatch.sampling_params import SamplingParams
    from vbatch.structured import (
        GuidedDecodingParams,
        StructuredOutput,
        StructuredOutputsParams,
    )

# NOTE: vbatch.outputs' names that `vbatch` gives as vLLM's top level does.
_OUTPUTS = (
    "ClassificationRequestOutput",
    "CompletionOutput",
    "EmbeddingRequestOutput",
    "PoolingRequestOutput",
    "RequestOutput",
    "ScoringRequestOutput",
)

__all__ = [
    "LLM",
    "ClassificationRequestOutput",
    "CompletionOutput",
    "ConfigError",
    "EmbeddingRequestOutput",
    "EngineArgs",
    "EngineDeadError",
    "EngineStartupError",
    "GuidedDecodingParams",
    "LoRARequest",
    "PoolingParams",
    "PoolingRequestOutput",
    "RequestOutput",
    "SamplingParams",
    "SamplingParamsError",
    "ScoringRequestOutput",
    "StructuredOutput",
    "StructuredOutputsParams",
    "TextPrompt",
    "TokensPrompt",
    "VbatchError",
]


# NOTE: every public name is imported on first use, so that `import vbatch` (and the `vbatch`
# command before its Ctrl-C handling is in place) loads nothing: not msgspec, transformers or zmq.
_HOMES = {
    "LLM": "vbatch.llm",
    "EngineArgs": "vbatch.engine_args",
    "LoRARequest": "vbatch.lora.request",
    "PoolingParams": "vbatch.pooling_params",
    "SamplingParams": "vbatch.sampling_params",
    "TextPrompt": "vbatch.inputs",
    "TokensPrompt": "vbatch.inputs",
    **dict.fromkeys(
        ("ConfigError", "EngineDeadError", "EngineStartupError", "SamplingParamsError"),
        "vbatch.errors",
    ),
    "VbatchError": "vbatch.errors",
    **dict.fromkeys(
        ("GuidedDecodingParams", "StructuredOutput", "StructuredOutputsParams"), "vbatch.structured"
    ),
    **dict.fromkeys(_OUTPUTS, "vbatch.outputs"),
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'vbatch' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
