"""Result types of the Python API and the per-request state that assembles them from outputs."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple

from vbatch.client.detokenizer import IncrementalDetokenizer
from vbatch.client.reasoning import split_reasoning
from vbatch.lora.request import LoRARequest
from vbatch.pooling_params import PoolingParams
from vbatch.protocol import FinishReason, PooledOutput, SampleFinish, TokenLogprobs
from vbatch.sampling_params import SamplingParams


class Logprob(NamedTuple):
    """vLLM's per-token logprob entry: `rank` is 1 for the most likely token; `decoded_token`
    is its text."""

    logprob: float
    rank: int | None
    decoded_token: str | None


@dataclass
class CompletionOutput:
    """One sample. `token_logprobs` is the compact form (sampled logprob plus the top ones);
    `logprobs` gives them as vLLM does, a {token_id: Logprob} per output token."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    token_logprobs: list[TokenLogprobs] | None = None
    # NOTE: with structured output, whether the text is a complete match (it ended on EOS).
    structured_complete: bool | None = None
    # NOTE: with a reasoning parser, the `<think>` part (`text` is then the answer alone).
    reasoning: str | None = None
    decode_token: Callable[[int], str] | None = field(default=None, repr=False, compare=False)

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __getstate__(self) -> dict[str, Any]:
        # NOTE: `decode_token` is the LLM's bound method (sockets, queues): a pickled output (a
        # Ray replica's, say) carries its logprobs decoded instead.
        if self.token_logprobs is not None:
            _ = self.logprobs
        return {**self.__dict__, "decode_token": None}

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the sampled tokens' logprobs; None unless logprobs were asked for."""
        if self.token_logprobs is None:
            return None
        return sum(entry.logprob for entry in self.token_logprobs)

    @cached_property
    def logprobs(self) -> list[dict[int, Logprob]] | None:
        if self.token_logprobs is None:
            return None
        decode = self.decode_token
        result = []
        for token_id, entry in zip(self.token_ids, self.token_logprobs, strict=False):
            # NOTE: alternatives a grammar forbade (-inf) could not be chosen: left out, as in
            # a job's output.
            ranked = {
                t: Logprob(v, rank, decode(t) if decode else None)
                for rank, (t, v) in enumerate(
                    zip(entry.top_token_ids, entry.top_logprobs, strict=True), start=1
                )
                if v != -math.inf
            }
            # NOTE: the sampled token is the first key, whatever its rank, as in vLLM.
            own = ranked.pop(token_id, None) or Logprob(
                entry.logprob, entry.rank or None, decode(token_id) if decode else None
            )
            result.append({token_id: own, **ranked})
        return result


@dataclass
class Request:
    """One input item: a prompt, a conversation or token ids, with optional own sampling params
    and chat-template variables (over the LLM's own, for a conversation); a conversation may
    name its own template, and continue its final message instead of opening a new turn. Every
    per-prompt option of `generate`/`chat` travels here. With `pooling_params`
    it is a prefill-only request (embed, classify, prompt logprobs), whose `prompt` may be a list
    of strings, each pooled on its own."""

    id: Any = None
    index: int | None = None
    prompt: str | list[str] | None = None
    messages: list[dict] | None = None
    prompt_token_ids: list[int] | None = None
    sampling_params: SamplingParams | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    pooling_params: PoolingParams | None = None
    lora_request: LoRARequest | None = None
    # NOTE: a conversation's tool schemas, the chat template's `tools` variable.
    tools: list[dict[str, Any]] | None = None
    # NOTE: "openai" hands the template each message's content as a list of text parts.
    chat_template_content_format: str = "auto"
    # NOTE: vLLM's cache_salt: only requests with the same salt share prefix-cache blocks.
    cache_salt: str | None = None


@dataclass
class RequestOutput:
    """One finished request. `request_id` is its id as text (the index when it has none);
    `prompt` is the prompt text (a chat's rendered template)."""

    request_id: str
    index: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    error: str | None = None
    # NOTE: with SamplingParams.prompt_logprobs, vLLM's list: None, then {token id: Logprob}.
    prompt_logprobs: list[dict[int, Any] | None] | None = None
    # NOTE: vLLM's attributes, for scripts that read them: the adapter the request ran with, and
    # metrics, which vLLM's offline LLM leaves None (its timings are the fields above).
    lora_request: LoRARequest | None = None
    metrics: None = None


@dataclass
class RequestState:
    """A submitted request being assembled from the core's tokens and finishes.

    Invariants: `reasons[i]` is set once sample i finished here (core finish or stop string),
    and `num_open` counts the samples whose reason is not set; `num_core_live` counts samples the
    core still runs, so a request done here with `num_core_live > 0` must be aborted in the core.
    """

    request: Request
    position: int
    prompt_token_ids: list[int]
    detoks: list[IncrementalDetokenizer]
    reasons: list[tuple[str, str | int | None] | None]
    logprobs: list[list[TokenLogprobs] | None]
    num_core_live: int
    arrival_time: float = field(default_factory=time.time)
    first_token_time: float | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    structured: bool = False
    reasoning_parser: str | None = None
    decode_token: Callable[[int], str] | None = None
    prompt_text: str | None = None  # a chat's rendered prompt
    # NOTE: the prompt logprobs the core sent (SamplingParams.prompt_logprobs), before any token.
    pooled: PooledOutput | None = None
    # NOTE: the tokenizer's EOS; a sample the core ended on another EOS id (a generation
    # config's) reports that id as its stop_reason, as vLLM's stop_token_ids from it do.
    eos_token_id: int | None = None
    eos_finished: set[int] = field(default_factory=set)
    num_open: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_open = sum(r is None for r in self.reasons)

    @property
    def is_done(self) -> bool:
        # NOTE: a counter, not a scan of `reasons`: done is asked once per finish, n per request.
        return self.num_open == 0

    def add_token(
        self,
        index: int,
        token_id: int,
        logprobs: TokenLogprobs | None,
        stop_terminated: bool = False,
    ) -> bool:
        """Sample `index` got `token_id` from the core; True if that completed a stop string.

        `stop_terminated`: the core ended the sample on this token (its finish follows)."""
        if self.reasons[index] is not None:
            return False
        if self.first_token_time is None:
            self.first_token_time = time.time()
        if logprobs is not None and self.logprobs[index] is not None:
            self.logprobs[index].append(logprobs)
        stop = self.detoks[index].update((token_id,), stop_terminated)
        if stop is None:
            return False
        self.reasons[index] = ("stop", stop)
        self.num_open -= 1
        return True

    def finish(self, finish: SampleFinish) -> None:
        """The core ended sample `finish.index` (or rejected the whole request)."""
        i = finish.index
        self.num_core_live -= 1
        if finish.finish_reason == FinishReason.ERROR:
            self.error = finish.error or "the engine rejected the request"
            self.reasons = [("error", None)] * len(self.reasons)
            self.num_open = 0
            return
        self.num_cached_tokens = max(self.num_cached_tokens, finish.num_cached_tokens)
        if self.reasons[i] is not None:
            return
        self.num_open -= 1
        detok = self.detoks[i]
        stop = detok.finalize(finish.finish_reason == FinishReason.STOP)
        if stop is not None:
            self.reasons[i] = ("stop", stop)
            return
        stop_reason = finish.stop_reason
        if finish.finish_reason == FinishReason.STOP and stop_reason is None:
            self.eos_finished.add(i)
            last = detok.token_ids[-1] if detok.token_ids else None
            if self.eos_token_id is not None and last != self.eos_token_id:
                stop_reason = last
        self.reasons[i] = (str(finish.finish_reason), stop_reason)

    def to_output(self) -> RequestOutput:
        outputs = error_completions() if self.error is not None else self._completions()
        return make_output(
            self.request,
            self.position,
            self.prompt_token_ids,
            outputs,
            self.error,
            self.arrival_time,
            self.first_token_time,
            self.num_cached_tokens,
            self.prompt_text,
        )

    def _completions(self) -> list[CompletionOutput]:
        outputs = []
        for i, (detok, reason) in enumerate(zip(self.detoks, self.reasons, strict=True)):
            finish_reason, stop_reason = reason or (None, None)
            token_ids = detok.token_ids
            logprobs = self.logprobs[i]
            reasoning, text = None, detok.text
            if self.reasoning_parser is not None:
                reasoning, text = split_reasoning(text, self.reasoning_parser)
            outputs.append(
                CompletionOutput(
                    i,
                    text,
                    list(token_ids),
                    finish_reason,
                    stop_reason,
                    logprobs[: len(token_ids)] if logprobs is not None else None,
                    # NOTE: a grammar allows EOS only where it can end; a stop string or
                    # stop id cut the text, so only an EOS finish completes it.
                    i in self.eos_finished if self.structured else None,
                    reasoning,
                    self.decode_token,
                )
            )
        return outputs


def make_output(
    request: Request,
    position: int,
    prompt_token_ids: list[int],
    outputs: list[CompletionOutput],
    error: str | None,
    arrival_time: float,
    first_token_time: float | None = None,
    num_cached_tokens: int = 0,
    prompt_text: str | None = None,
) -> RequestOutput:
    index = request.index if request.index is not None else position
    return RequestOutput(
        request_id=str(request.id if request.id is not None else index),
        index=index,
        prompt=prompt_text if prompt_text is not None else request.prompt,
        prompt_token_ids=prompt_token_ids,
        outputs=outputs,
        finished=True,
        num_cached_tokens=num_cached_tokens,
        arrival_time=arrival_time,
        first_token_time=first_token_time,
        finish_time=time.time(),
        error=error,
        lora_request=request.lora_request,
    )


def error_output(
    request: Request, position: int, prompt_token_ids: list[int], error: str
) -> RequestOutput:
    return make_output(request, position, prompt_token_ids, error_completions(), error, time.time())


def error_completions() -> list[CompletionOutput]:
    """A failed request's outputs, whatever its n: one, empty, finished with "error"."""
    return [CompletionOutput(0, "", [], "error")]
