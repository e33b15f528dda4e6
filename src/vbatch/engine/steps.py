"""One step's plan and what applying it did: SchedulerOutput and StepUpdate (torch-free)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from vbatch.engine.sequence import Sequence
from vbatch.protocol import TokenLogprobs

_step_ids = itertools.count()


@dataclass(kw_only=True)
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
