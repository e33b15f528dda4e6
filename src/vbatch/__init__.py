"""vbatch: batch offline inference for Llama-family models."""

from typing import TYPE_CHECKING, Any

from vbatch.errors import (
    ConfigError,
    EngineDeadError,
    EngineStartupError,
    SamplingParamsError,
    VbatchError,
)
from vbatch.inputs import TextPrompt, TokensPrompt
from vbatch.pooling_params import PoolingParams
from vbatch.sampling_params import SamplingParams
from vbatch.structured import GuidedDecodingParams, StructuredOutput, StructuredOutputsParams

__version__ = "0.1.0"

if TYPE_CHECKING:
    from vbatch.engine_args import EngineArgs
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


def __getattr__(name: str) -> Any:
    # NOTE: lazy so that `import vbatch` (and `vbatch --help`) never pulls in transformers or zmq.
    if name == "LLM":
        from vbatch.llm import LLM

        return LLM
    if name in _OUTPUTS:
        from vbatch import outputs

        return getattr(outputs, name)
    if name == "EngineArgs":
        from vbatch.engine_args import EngineArgs

        return EngineArgs
    if name == "LoRARequest":
        from vbatch.lora.request import LoRARequest

        return LoRARequest
    raise AttributeError(name)
