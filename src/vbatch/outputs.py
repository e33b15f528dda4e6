"""The API's result types under vLLM's module name (`vllm.outputs`)."""

from vbatch.client.outputs import CompletionOutput, RequestOutput
from vbatch.client.pooling_outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)

__all__ = [
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "PoolingOutput",
    "PoolingRequestOutput",
    "RequestOutput",
    "ScoringOutput",
    "ScoringRequestOutput",
]
