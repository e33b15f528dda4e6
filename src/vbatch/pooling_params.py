"""PoolingParams: what a prefill-only request returns instead of tokens (an embedding, the
classifier's logits, or its prompt's log-probabilities); also its wire form."""

from __future__ import annotations

import enum

import msgspec

from vbatch.errors import SamplingParamsError

MAX_PROMPT_LOGPROBS = 20


class PoolingTask(enum.IntEnum):
    EMBED = 0
    CLASSIFY = 1
    PROMPT_LOGPROBS = 2

    def __str__(self) -> str:
        return self.name.lower()


# NOTE: vLLM's task names; "encode" is its generic pooling task, an embedding here.
TASK_NAMES = {
    "embed": PoolingTask.EMBED,
    "encode": PoolingTask.EMBED,
    "classify": PoolingTask.CLASSIFY,
    "prompt_logprobs": PoolingTask.PROMPT_LOGPROBS,
}


def pooling_task(task: object) -> PoolingTask:
    """`task` as a PoolingTask: a member, or one of TASK_NAMES (vLLM's `task="embed"`)."""
    if isinstance(task, PoolingTask):
        return task
    if isinstance(task, str) and task.lower() in TASK_NAMES:
        return TASK_NAMES[task.lower()]
    raise SamplingParamsError(
        f"task must be a PoolingTask or one of {', '.join(map(repr, TASK_NAMES))}, got {task!r:.80}"
    )


class PoolingParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One pooling request's settings.

    Invariants after validate(): `dimensions` is None or >= 1 (Matryoshka: the embedding's
    leading `dimensions` values, normalized afterwards when the model normalizes); `normalize`
    None means the checkpoint's own choice (its sentence-transformers Normalize module);
    `top_logprobs` (PROMPT_LOGPROBS) is how many alternatives each prompt position also returns;
    `prompt_lens`, when set, splits the request's token array into that many prompts, each
    pooled on its own (an OpenAI embeddings line with a list `input`); a prompt longer than
    `truncate_prompt_tokens` keeps its last that many tokens, and is an error without it when
    it exceeds the model's length; `use_activation` (vLLM's) False makes LLM.encode's CLASSIFY
    data the head's logits rather than its class probabilities.
    """

    task: PoolingTask = PoolingTask.EMBED
    dimensions: int | None = None
    normalize: bool | None = None
    top_logprobs: int = 0
    prompt_lens: list[int] | None = None
    # NOTE: applied by the client: each prompt keeps its last this many tokens (as vLLM).
    truncate_prompt_tokens: int | None = None
    use_activation: bool | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> PoolingParams:
        def bad_int(value: object) -> bool:
            return not isinstance(value, int) or isinstance(value, bool)

        self.task = pooling_task(self.task)

        if self.dimensions is not None and (bad_int(self.dimensions) or self.dimensions < 1):
            raise SamplingParamsError(
                f"dimensions must be a positive integer, got {self.dimensions!r:.80}"
            )
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise SamplingParamsError(
                f"normalize must be true or false, got {self.normalize!r:.80}"
            )
        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise SamplingParamsError(
                f"use_activation must be true or false, got {self.use_activation!r:.80}"
            )
        if bad_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_PROMPT_LOGPROBS:
            raise SamplingParamsError(
                f"prompt_logprobs must be an integer in [0, {MAX_PROMPT_LOGPROBS}], "
                f"got {self.top_logprobs!r:.80}"
            )
        truncate = self.truncate_prompt_tokens
        if truncate is not None and (bad_int(truncate) or (truncate < 1 and truncate != -1)):
            raise SamplingParamsError(
                f"truncate_prompt_tokens must be a positive integer or -1 (the model's length), "
                f"got {truncate!r:.80}"
            )
        lens = self.prompt_lens
        if lens is not None and (not lens or any(bad_int(n) or n < 1 for n in lens)):
            raise SamplingParamsError(f"prompt_lens must be positive integers, got {lens!r:.80}")
        return self
