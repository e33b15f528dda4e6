"""One step's plan and what applying it did (SchedulerOutput, StepUpdate), and the DecodeRun that
applies decode steps continuing one another (torch-free)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from vbatch.engine.sequence import Sequence
from vbatch.protocol import TokenLogprobs

_step_ids = itertools.count()


@dataclass
class SchedulerOutput:
    """One step's batch: `seqs[i]` computes `num_new_tokens[i]` tokens from its num_computed_tokens.

    `sampling_mask[i]` says whether seq i samples this step (the step reaches its last token); it is
    fixed at construction, so it stays right after update() has moved the seqs on. When
    `block_tables` is set, seq i's block table is row `block_rows[i]` of it (the BlockManager's
    rows, unchanged while `block_tables_version` is); an output built by hand leaves it None and
    the runner reads the seqs' lists. `step_id` is unique to this output; `continues_step`, when
    not -1, is the step_id of the previous output, whose seqs these are, in the same order, each
    having computed its one token there and taken exactly the token it sampled (a decode-only
    step following one), so a runner may advance that step's batch instead of building a new one.
    """

    seqs: list[Sequence]
    num_new_tokens: list[int]
    preempted: list[Sequence] = field(default_factory=list)
    sampling_mask: list[bool] = field(default_factory=list)
    block_tables: np.ndarray | None = None  # [num_rows, max_num_blocks] int32
    block_rows: list[int] = field(default_factory=list)
    block_tables_version: int = -1  # the BlockManager's tables_version when this was built
    continues_step: int = -1
    step_id: int = field(default_factory=lambda: next(_step_ids))

    def __post_init__(self) -> None:
        if not self.sampling_mask:
            self.sampling_mask = [
                seq.num_computed_tokens + n == seq.num_tokens
                for seq, n in zip(self.seqs, self.num_new_tokens, strict=True)
            ]

    @property
    def sampling_indices(self) -> list[int]:
        return [i for i, is_sampling in enumerate(self.sampling_mask) if is_sampling]

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass
class StepUpdate:
    """What update() applied: `seqs[j]` got token `token_ids[j]` (and `logprobs[j]`), in batch
    order; `finished` ended this step; `started` computed prompt tokens and sampled, so their
    first token (or first after a recompute) is in this step."""

    seqs: list[Sequence]
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None
    finished: list[Sequence]
    started: list[Sequence]


class DecodeRun:
    """Decode steps that continue one another, and what lets update() apply one of them without
    visiting every seq: a decode step changes a seq's token list only (see Sequence).

    Invariants: `token_lists[i]` is `seqs[i].token_ids`, which has taken one token in each of
    the run's `num_steps` steps; no seq can reach its length limit before step `num_safe_steps`,
    nor finish on a token outside `finish_ids`; `rows_by_offset[r]` holds the rows whose token
    count was r modulo block_size when the run started.
    """

    __slots__ = (
        "finish_ids",
        "num_safe_steps",
        "num_steps",
        "rows_by_offset",
        "seqs",
        "step_id",
        "token_lists",
    )

    def __init__(self, seqs: list[Sequence], block_size: int) -> None:
        self.seqs = seqs
        self.step_id = -1
        self.num_steps = 0
        self.token_lists = [seq.token_ids for seq in seqs]
        start_lengths = [len(token_ids) for token_ids in self.token_lists]
        finish_sets = {id(seq.finish_token_ids): seq.finish_token_ids for seq in seqs}
        self.finish_ids: frozenset[int] = frozenset().union(*finish_sets.values())
        self.num_safe_steps = min(
            seq.max_num_tokens - length for seq, length in zip(seqs, start_lengths, strict=True)
        )
        self.rows_by_offset: list[list[int]] = [[] for _ in range(block_size)]
        for row, length in enumerate(start_lengths):
            self.rows_by_offset[length % block_size].append(row)

    def take(self, step_id: int, token_ids: list[int]) -> list[Sequence] | None:
        """Append a step's tokens, one per seq, if none of them can finish a seq; returns the
        seqs whose next token opens a block, or None (nothing appended) if one might finish."""
        step = self.num_steps + 1
        if step >= self.num_safe_steps or not self.finish_ids.isdisjoint(token_ids):
            return None
        for token_ids_of_seq, token_id in zip(self.token_lists, token_ids):
            token_ids_of_seq.append(token_id)
        self.num_steps = step
        self.step_id = step_id
        # NOTE: seq i computed position start + step - 1; its new token opens a block when the
        # step's length before the append, start + step - 1, is a multiple of block_size.
        seqs = self.seqs
        rows_by_offset = self.rows_by_offset
        return [seqs[row] for row in rows_by_offset[(1 - step) % len(rows_by_offset)]]
