"""Sequence: one sample of one request as the engine core tracks it (torch-free)."""

from __future__ import annotations

import enum
import itertools
from typing import TYPE_CHECKING

from vbatch.protocol import FinishReason
from vbatch.sampling_params import SamplingParams

if TYPE_CHECKING:
    from xgrammar import GrammarMatcher

_seq_counter = itertools.count()


class SequenceStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


class Sequence:
    """Token ids (prompt then output), KV progress and block table of one sample.

    Invariants: `num_computed_tokens <= num_tokens`; the first `num_computed_tokens` tokens have
    their K/V in the blocks of `block_table`, in order, but those of the first
    `num_dropped_blocks` entries, which are placeholders for blocks released because they lie
    wholly before every layer's sliding window; `num_cached_tokens`, the prompt tokens its
    first admission found in the prefix cache, is below `num_prompt_tokens` and stays as it was
    through preemptions (a re-admission finds the seq's own blocks, output tokens included); a
    sequence samples in a step exactly when that step brings `num_computed_tokens` to `num_tokens`.
    `max_num_tokens` and `finish_token_ids` (set by the scheduler on add) bound the cheap test for
    whether a new token may finish it.

    What is stored is `num_uncomputed_tokens`; `num_computed_tokens` is derived from it, so a
    decode step changes nothing but the token list (see SchedulerOutput, continuing decode
    steps). append_token() appends a token that is not computed yet.
    """

    __slots__ = (
        "argmax_changers",
        "block_row",
        "block_table",
        "cache_salt",
        "finish_reason",
        "finish_token_ids",
        "full_block_hashes",
        "grammar",
        "index",
        "long_rope",
        "lora_id",
        "max_num_tokens",
        "num_cached_tokens",
        "num_dropped_blocks",
        "num_preemptions",
        "num_prompt_tokens",
        "num_uncomputed_tokens",
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
        lora_id: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        self.seq_id = next(_seq_counter)
        self.request_id = request_id
        self.index = index
        # NOTE: the LoRA adapter it runs with (its id in the core), 0 for the base model.
        self.lora_id = lora_id
        self.cache_salt = cache_salt
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_uncomputed_tokens = self.num_prompt_tokens
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.block_table: list[int] = []
        self.block_row = -1  # its row of the BlockManager's tables while it holds blocks
        self.num_dropped_blocks = 0
        # NOTE: the prefix-cache keys of its leading full blocks (for its scheduler's block
        # size), as far as the BlockManager has needed them; a block's key never changes, as a
        # token list only grows.
        self.full_block_hashes: list[bytes] = []
        # NOTE: with longrope, whether its K/V are (to be) made with the long factors: set once
        # it is longer than the pre-training length, and then for good (see Scheduler).
        self.long_rope = False
        self.status = SequenceStatus.WAITING
        self.params = params
        # NOTE: the fields that can change a greedy row's token (SamplingParams.CHANGES_ARGMAX).
        self.argmax_changers = params.argmax_changers()
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | None = None
        # NOTE: max_tokens None (up to the model length) is bounded by Scheduler.add.
        self.max_num_tokens = self.num_prompt_tokens + (params.max_tokens or 2**62)
        self.finish_token_ids: frozenset[int] = frozenset(params.stop_token_ids)
        # NOTE: with structured output, the matcher that has accepted exactly its output tokens.
        self.grammar: GrammarMatcher | None = None

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}#{self.index}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)}, "
            f"{self.status.name})"
        )

    @property
    def num_computed_tokens(self) -> int:
        return len(self.token_ids) - self.num_uncomputed_tokens

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        self.num_uncomputed_tokens = len(self.token_ids) - value

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
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.num_uncomputed_tokens += 1

    def finish(self, reason: FinishReason, stop_reason: int | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def finish_on(self, token_id: int, eos_token_ids: frozenset[int]) -> bool:
        """Finish if the newest token, `token_id`, ends this sample; True if it did."""
        params = self.params
        # NOTE: EOS and stop ids count only after min_tokens other tokens, so the earliest stop is
        # output token min_tokens + 1; this matches the sampler, which bans them until then.
        if len(self.token_ids) - self.num_prompt_tokens > params.min_tokens:
            if token_id in eos_token_ids and not params.ignore_eos:
                self.finish(FinishReason.STOP)
                return True
            if token_id in params.stop_token_ids:
                self.finish(FinishReason.STOP, token_id)
                return True
        if len(self.token_ids) >= self.max_num_tokens:
            self.finish(FinishReason.LENGTH)
            return True
        return False
