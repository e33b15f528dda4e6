"""Sequence: one sample of one request as the engine core tracks it (torch-free)."""

from __future__ import annotations

import enum
import itertools

from vbatch.protocol import FinishReason, TokenLogprobs
from vbatch.sampling_params import SamplingParams

_seq_counter = itertools.count()


class SequenceStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


class Sequence:
    """Token ids (prompt then output), KV progress and block table of one sample.

    Invariants: `num_cached_tokens <= num_computed_tokens <= num_tokens`; the first
    `num_computed_tokens` tokens have their K/V in the blocks of `block_table`, in order; a
    sequence samples in a step exactly when that step brings `num_computed_tokens` to `num_tokens`.
    """

    __slots__ = (
        "arrival_time",
        "block_table",
        "finish_reason",
        "index",
        "last_emitted",
        "new_logprobs",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_prompt_tokens",
        "params",
        "request_id",
        "seq_id",
        "status",
        "stop_reason",
        "token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        index: int = 0,
        arrival_time: float = 0.0,
    ) -> None:
        self.seq_id = next(_seq_counter)
        self.request_id = request_id
        self.index = index
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        self.status = SequenceStatus.WAITING
        self.params = params
        self.arrival_time = arrival_time
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | None = None
        self.last_emitted = self.num_prompt_tokens
        self.new_logprobs: list[TokenLogprobs] = []

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}#{self.index}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)}, "
            f"{self.status.name})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def is_prefill(self) -> bool:
        """True while more than the last sampled token still needs computing."""
        return self.num_uncomputed_tokens > 1

    def num_blocks_needed(self, block_size: int, num_tokens: int | None = None) -> int:
        n = self.num_tokens if num_tokens is None else num_tokens
        return (n + block_size - 1) // block_size

    def append_token(self, token_id: int, logprobs: TokenLogprobs | None = None) -> None:
        self.token_ids.append(token_id)
        if logprobs is not None:
            self.new_logprobs.append(logprobs)

    def take_new_tokens(self) -> tuple[list[int], list[TokenLogprobs] | None]:
        """Output tokens not yet sent to the client, and their logprobs."""
        new = self.token_ids[self.last_emitted :]
        self.last_emitted = len(self.token_ids)
        logprobs = self.new_logprobs or None
        self.new_logprobs = []
        return new, logprobs
