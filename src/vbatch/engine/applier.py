"""StepApplier: a step's sampled tokens applied to its seqs (progress, prompt-block caching,
finish rules), with a fast path for decode steps that continue one another (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

from vbatch.engine.block_manager import BlockManager
from vbatch.engine.prefill_claims import PrefillClaims
from vbatch.engine.sequence import Sequence
from vbatch.engine.steps import SchedulerOutput, StepUpdate
from vbatch.protocol import TokenLogprobs


@dataclass
class Applied:
    """What apply() did. `crossing` is set only when every running seq decoded in the step: the
    unfinished ones whose next token opens a block."""

    update: StepUpdate
    crossing: list[Sequence] | None


class DecodeRun:
    """Decode steps that continue one another (see SchedulerOutput), and what lets update() apply
    one of them without visiting every seq.

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


class StepApplier:
    """Applies steps for the Scheduler, which keeps its queues; finished seqs leave here freed.

    Invariants: `num_prompt_tokens` and `num_generation_tokens` count the prompt tokens computed
    and the sampled tokens kept since start; `_run`, when set, holds the seqs of the last applied
    step, which continued the steps before it since the run began.
    """

    def __init__(
        self, block_manager: BlockManager, claims: PrefillClaims, eos_token_ids: frozenset[int]
    ) -> None:
        self.block_manager = block_manager
        self.claims = claims
        self.eos_token_ids = eos_token_ids
        self.block_size = block_manager.block_size
        self.is_caching = block_manager.enable_prefix_caching
        self._run: DecodeRun | None = None
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    def apply(
        self,
        out: SchedulerOutput,
        sampled_token_ids: list[int],
        logprobs: list[TokenLogprobs | None] | None,
        num_running: int,
    ) -> Applied:
        """Apply `out`, planned when `num_running` seqs were running; `sampled_token_ids` align
        with out's sampling seqs, in batch order."""
        if out.continues_step != -1:
            applied = self._apply_run(out, sampled_token_ids, logprobs)
            if applied is not None:
                return applied
        self._run = None
        finished: list[Sequence] = []
        started: list[Sequence] = []
        dropped: list[int] = []  # indices into sampled_token_ids of seqs aborted after schedule()
        crossing: list[Sequence] = []
        is_decode_only = len(sampled_token_ids) == len(out.seqs) == out.num_batched_tokens
        if is_decode_only:
            seqs = self._apply_decodes(
                out.seqs, sampled_token_ids, finished, started, dropped, crossing
            )
        else:
            seqs = self._apply_mixed(out, sampled_token_ids, finished, started, dropped)
        self.num_generation_tokens += len(seqs)
        if dropped:
            is_dropped = set(dropped)
            kept = [k for k in range(len(sampled_token_ids)) if k not in is_dropped]
            sampled_token_ids = [sampled_token_ids[k] for k in kept]
            if logprobs is not None:
                logprobs = [logprobs[k] for k in kept]
        if finished:
            for seq in finished:
                self.forget(seq)
            crossing = [seq for seq in crossing if seq.finish_reason is None]
        # NOTE: out.seqs were running when it was planned and only abort() removes seqs between
        # schedule() and update(), which `dropped` catches.
        is_every_seq_decoding = is_decode_only and not dropped and len(out.seqs) == num_running
        update = StepUpdate(seqs, sampled_token_ids, logprobs, finished, started)
        return Applied(update, crossing if is_every_seq_decoding else None)

    def end_run(self) -> None:
        """The next step cannot continue the last one (seqs left it between steps)."""
        self._run = None

    def forget(self, seq: Sequence) -> None:
        """Drop a finished seq's blocks and claims."""
        self.block_manager.free(seq)
        self.claims.release(seq)

    def _apply_run(
        self,
        out: SchedulerOutput,
        sampled_token_ids: list[int],
        logprobs: list[TokenLogprobs | None] | None,
    ) -> Applied | None:
        """apply() for a decode step that continues the last one, through the DecodeRun; None
        when the general path must apply it (a token may finish a seq, or a seq was aborted)."""
        # NOTE: the decode steady state at its cheapest: one append per seq, no other per-seq
        # work; started seqs and prefill claims cannot occur in a continuing step.
        run = self._run
        if run is None or run.step_id != out.continues_step:
            seqs = out.seqs
            if any(seq.finish_reason is not None for seq in seqs):
                return None
            run = self._run = DecodeRun(seqs, self.block_size)
        crossing = run.take(out.step_id, sampled_token_ids)
        if crossing is None:
            return None
        if self.is_caching:
            for seq in crossing:
                self.block_manager.cache_full_blocks(seq)
        self.num_generation_tokens += len(sampled_token_ids)
        return Applied(StepUpdate(out.seqs, sampled_token_ids, logprobs, [], []), crossing)

    def _apply_decodes(
        self,
        seqs: list[Sequence],
        sampled_token_ids: list[int],
        finished: list[Sequence],
        started: list[Sequence],
        dropped: list[int],
        crossing: list[Sequence],
    ) -> list[Sequence]:
        """apply() for a step in which every seq computed one token and sampled; returns the
        seqs that took their token and adds to `crossing` those whose next token opens a block."""
        # NOTE: the decode steady state, so the per-seq work is cut to what one token can change.
        block_size = self.block_size
        is_caching = self.is_caching
        eos_token_ids = self.eos_token_ids
        is_any_aborted = False
        for seq, token_id in zip(seqs, sampled_token_ids):
            if seq.finish_reason is not None:
                is_any_aborted = True
                continue
            token_ids = seq.token_ids
            num_computed = len(token_ids)
            # NOTE: the seq computed one token and takes one, so its num_computed_tokens (derived
            # from num_uncomputed_tokens, 1 before and after) grows with this append alone.
            token_ids.append(token_id)
            if num_computed <= seq.num_prompt_tokens:
                self.num_prompt_tokens += 1
                started.append(seq)
                self.claims.release(seq)
            if num_computed % block_size == 0:
                crossing.append(seq)
                if is_caching:
                    self.block_manager.cache_full_blocks(seq)
            if (
                token_id in seq.finish_token_ids or len(token_ids) >= seq.max_num_tokens
            ) and seq.finish_on(token_id, eos_token_ids):
                finished.append(seq)
        if not is_any_aborted:
            return seqs
        # NOTE: aborted after schedule() (finished ones this step have a token); theirs is dropped.
        is_finished_now = {id(seq) for seq in finished}
        kept: list[Sequence] = []
        for k, seq in enumerate(seqs):
            if seq.finish_reason is None or id(seq) in is_finished_now:
                kept.append(seq)
            else:
                dropped.append(k)
        return kept

    def _apply_mixed(
        self,
        out: SchedulerOutput,
        sampled_token_ids: list[int],
        finished: list[Sequence],
        started: list[Sequence],
        dropped: list[int],
    ) -> list[Sequence]:
        """apply() for any step; returns the seqs that took a sampled token."""
        block_size = self.block_size
        seqs: list[Sequence] = []
        j = 0
        for seq, num_new, is_sampling in zip(
            out.seqs, out.num_new_tokens, out.sampling_mask, strict=True
        ):
            if seq.finish_reason is not None:
                # NOTE: aborted after schedule(); its sampled token (if any) is dropped.
                if is_sampling:
                    dropped.append(j)
                    j += 1
                continue
            old = seq.num_computed_tokens
            new = old + num_new
            seq.num_uncomputed_tokens -= num_new
            if self.is_caching and new // block_size > old // block_size:
                self.block_manager.cache_full_blocks(seq)
            num_prompt_tokens = seq.num_prompt_tokens
            if old < num_prompt_tokens:
                self.num_prompt_tokens += min(new, num_prompt_tokens) - old
                if new >= num_prompt_tokens:
                    self.claims.release(seq)
                if not is_sampling:
                    continue
                started.append(seq)
            elif not is_sampling:
                continue
            token_id = sampled_token_ids[j]
            j += 1
            seq.append_token(token_id)
            seqs.append(seq)
            # NOTE: most tokens finish nothing; the full rules run only when one may apply.
            if (
                token_id in seq.finish_token_ids or len(seq.token_ids) >= seq.max_num_tokens
            ) and seq.finish_on(token_id, self.eos_token_ids):
                finished.append(seq)
        assert j == len(sampled_token_ids), "one sampled token per sampling seq"
        return seqs
