"""Results of prefill-only requests with vLLM's names and shapes (`PoolingRequestOutput`,
`EmbeddingRequestOutput`, `ClassificationRequestOutput`, `ScoringRequestOutput`), prompt
logprobs (vLLM's `Logprob` mappings), and `PoolingState`, which builds a pooling output."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vbatch.client.outputs import Logprob, Request
from vbatch.pooling_params import PoolingParams, PoolingTask
from vbatch.protocol import FinishReason, PooledOutput, SampleFinish

PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class PoolingOutput:
    """`data`: float32, [dim] (or [num_prompts, dim] for a list input) for embeddings and
    classifier logits; for PROMPT_LOGPROBS each prompt position's logprob after the first."""

    data: np.ndarray


@dataclass
class PoolingRequestOutput:
    request_id: str
    index: int
    prompt: str | list[str] | None
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    task: PoolingTask
    finished: bool = True
    # NOTE: the prompts of a list input, their token counts (prompt_token_ids holds them all).
    prompt_lens: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    arrival_time: float = 0.0
    finish_time: float | None = None
    error: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    request_id: Any
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    error: str | None = None


@dataclass
class ClassificationOutput:
    probs: list[float]
    # NOTE: vbatch's addition: the raw logits and the label with the highest probability.
    logits: list[float] = field(default_factory=list)
    label: str | None = None

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    request_id: Any
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True
    error: str | None = None


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    request_id: Any
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
    error: str | None = None


def class_probs(logits: np.ndarray, problem_type: str | None = None) -> np.ndarray:
    """As vLLM's classify, by the model config's `problem_type`: the logits themselves for a
    regression, a sigmoid per label for multi-label classification, else a sigmoid for one
    label and a softmax over several."""
    logits = logits.astype(np.float64)
    if problem_type == "regression":
        return logits
    if logits.shape[-1] == 1 or problem_type == "multi_label_classification":
        return 1.0 / (1.0 + np.exp(-logits))
    shifted = np.exp(logits - logits.max(-1, keepdims=True))
    return shifted / shifted.sum(-1, keepdims=True)


def prompt_logprobs_of(
    pooled: PooledOutput,
    prompt_token_ids: list[int],
    decode: Any,
) -> PromptLogprobs:
    """vLLM's prompt_logprobs: None for the first position, then {token id: Logprob} with the
    prompt token and the top k alternatives the core sent; `decode` maps token ids to texts."""
    logprobs = np.frombuffer(pooled.data, dtype="<f4")
    ranks = np.frombuffer(pooled.ranks, dtype="<i4")
    k = len(pooled.top_token_ids) // 4 // max(1, len(logprobs))
    top_ids = np.frombuffer(pooled.top_token_ids, dtype="<i4").reshape(len(logprobs), k)
    top_values = np.frombuffer(pooled.top_logprobs, dtype="<f4").reshape(len(logprobs), k)
    texts = decode(sorted({*prompt_token_ids[1:], *top_ids.ravel().tolist()}))
    result: PromptLogprobs = [None]
    for pos, token_id in enumerate(prompt_token_ids[1:]):
        entry = {token_id: Logprob(float(logprobs[pos]), int(ranks[pos]), texts.get(token_id))}
        for rank, (alt, value) in enumerate(zip(top_ids[pos], top_values[pos]), start=1):
            entry.setdefault(int(alt), Logprob(float(value), rank, texts.get(int(alt))))
        result.append(entry)
    return result


@dataclass
class PoolingState:
    """A submitted pooling request until its PooledOutput and finish arrive (the client's
    counterpart of RequestState: `add_token` never happens, one finish ends it)."""

    request: Request
    position: int
    prompt_token_ids: list[int]
    params: PoolingParams
    prompt_lens: list[int] | None = None
    arrival_time: float = field(default_factory=time.time)
    pooled: PooledOutput | None = None
    error: str | None = None
    is_done: bool = False
    num_core_live: int = 1
    num_cached_tokens: int = 0

    def add_token(
        self, index: int, token_id: int, logprobs: object, stop_terminated: bool = False
    ) -> bool:
        return False

    def finish(self, finish: SampleFinish) -> None:
        self.num_core_live = 0
        self.is_done = True
        if finish.finish_reason == FinishReason.ERROR:
            self.error = finish.error or "the engine rejected the request"
        elif finish.finish_reason != FinishReason.STOP or self.pooled is None:
            self.error = f"the engine ended the request ({finish.finish_reason}) without a result"

    def to_output(self) -> PoolingRequestOutput:
        # NOTE: a copy: a view of the message's bytes would be read-only, where vLLM's tensor
        # takes in-place operations.
        data = np.frombuffer(self.pooled.data, "<f4").copy() if self.pooled else np.zeros(0, "f4")
        if self.params.task != PoolingTask.PROMPT_LOGPROBS and self.prompt_lens is not None:
            data = data.reshape(len(self.prompt_lens), -1)
        out = pooling_output(
            self.request, self.position, self.prompt_token_ids, self.params.task, self.error, data
        )
        out.prompt_lens = self.prompt_lens
        out.arrival_time = self.arrival_time
        return out


def pooling_output(
    request: Request,
    position: int,
    prompt_token_ids: list[int],
    task: PoolingTask,
    error: str | None,
    data: np.ndarray | None = None,
) -> PoolingRequestOutput:
    """The output of `request` (an error output without `data`)."""
    index = request.index if request.index is not None else position
    now = time.time()
    return PoolingRequestOutput(
        request_id=str(request.id if request.id is not None else index),
        index=index,
        prompt=request.prompt,
        prompt_token_ids=prompt_token_ids,
        outputs=PoolingOutput(np.zeros(0, "f4") if data is None else data),
        task=task,
        arrival_time=now,
        finish_time=now,
        error=error,
    )


def perplexity_of(token_logprobs: np.ndarray) -> tuple[float, float]:
    """(the sum of the logprobs, exp of minus their mean); (0, nan) with no scored token."""
    if token_logprobs.size == 0:
        return 0.0, math.nan
    total = float(token_logprobs.astype(np.float64).sum())
    return total, math.exp(-total / token_logprobs.size)
