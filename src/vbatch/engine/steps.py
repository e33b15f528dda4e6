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
    the runner reads the seqs' lists. `step_id` is unique to this output. `kv_copies` lists
    (source block, destination block, n): the first n token slots' K/V of every layer to copy
    before the forward pass (BlockManager.match_partial).

    Continuing decode steps (the fast path every part below refers to): `continues_step`, when
    not -1, is the step_id of the previous output, whose seqs these are, in the same order, each
    having computed its one token there and taken exactly the token it sampled (a decode-only
    step following one). Such a step is planned, built and applied from the last one instead of
    from the seqs:
    - Sequence stores its uncomputed token count, so a decode step changes only its token list;
    - Scheduler._continue reuses the last output's lists (schedule_ahead plans one before the
      last one's tokens are known, under async scheduling);
    - StepApplier applies it through a DecodeRun: one append per seq, the general path only
      when a token or the step count might finish a seq;
    - the ModelRunner's DecodeBatch advances the kept HostBatch in place (the native
      `vbatch::advance_decode` op on CPU, else advance_host_arrays plus a device copy of the
      sampled ids), and a plain-greedy SamplingMetadata is reused;
    - EngineCore._outputs reuses the last step's request id and index columns.
    Any other step (an admission, a prefill chunk, a preemption, a finish) ends the run, and the
    next step is built afresh.
    """

    seqs: list[Sequence]
    num_new_tokens: list[int]
    preempted: list[Sequence] = field(default_factory=list)
    sampling_mask: list[bool] = field(default_factory=list)
    block_tables: np.ndarray | None = None  # [num_rows, max_num_blocks] int32
    block_rows: list[int] = field(default_factory=list)
    block_tables_version: int = -1  # the BlockManager's tables_version when this was built
    continues_step: int = -1
    kv_copies: list[tuple[int, int, int]] = field(default_factory=list)
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
