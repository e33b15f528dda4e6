"""Scheduler: picks each step's batch under a token budget, preempts when KV blocks run out, and
keeps the waiting and running queues as steps are applied (torch-free)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from vbatch.engine.applier import StepApplier
from vbatch.engine.block_manager import BlockManager
from vbatch.engine.prefill_claims import PrefillClaims
from vbatch.engine.sequence import Sequence, SequenceStatus
from vbatch.engine.steps import SchedulerOutput, StepUpdate
from vbatch.protocol import FinishReason, SchedulerStats, TokenLogprobs
from vbatch.sampling_params import SamplingParams


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    enable_prefix_caching: bool = True
    # NOTE: set only when every layer attends within a window (the largest of them): blocks
    # before it are then released as sequences move on.
    sliding_window: int | None = None
    # NOTE: set for a longrope model: its pre-training length. A longer seq runs on the long
    # factors, every position of it (as transformers); one that grows past it is recomputed.
    long_rope_from: int | None = None
    # NOTE: with LoRA, how many adapters may run at once (the engine's adapter slots); 0: no
    # limit (no adapters).
    max_loras: int = 0
    # NOTE: batch-invariant mode: a chunk ends where the prompt does, so a preempted seq
    # recomputes its prompt and its outputs in separate chunks (the outputs row by row, as
    # they were decoded: see input_batch.build_host_batch); the prefix cache shares prompt
    # blocks only (BlockManager.prompt_blocks_only).
    chunks_end_at_prompt: bool = False


# NOTE: with LoRA, how far down the waiting queue admission looks past seqs whose adapter finds
# no slot.
MAX_LORA_LOOKAHEAD = 256


class Scheduler:
    """FCFS continuous batching on one BlockManager, with chunked prefill and recompute preemption.

    Invariants: every unfinished seq is in exactly one of `waiting` (no blocks, nothing computed) or
    `running` (admission order, newest last); a step never exceeds max_num_batched_tokens tokens or
    max_num_seqs seqs; finished seqs hold no blocks and are in neither queue.

    `max_num_seqs` starts as the config's; the engine lowers it for a while to run the requests
    of a failed step in smaller groups (see EngineCore).
    """

    def __init__(self, config: SchedulerConfig, eos_token_ids: Iterable[int]) -> None:
        self.config = config
        self.block_manager = BlockManager(
            config.num_kv_blocks,
            config.block_size,
            config.enable_prefix_caching,
            config.sliding_window,
            prompt_blocks_only=config.chunks_end_at_prompt,
        )
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_num_seqs = config.max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # NOTE: with prefix caching, a waiting seq whose next uncached prompt block a running seq
        # is computing waits (and the queue behind it, FCFS) to reuse the block from the cache.
        self._claims = PrefillClaims(self.block_manager)
        self._applier = StepApplier(self.block_manager, self._claims, self.eos_token_ids)
        # NOTE: set by a decode-only update() that every running seq took part in: each then has
        # one uncomputed token, and these (in running order) need a new block for it.
        self._decode_crossing: list[Sequence] | None = None
        # NOTE: the step_id of the last output if the next decode-only step continues it (a
        # decode-only update() that every running seq took part in and none finished), else -1.
        self._continuable_step = -1
        # NOTE: a step continuing the last output has its seqs, token counts and block rows.
        self._last_output: SchedulerOutput | None = None
        self.num_preemptions = 0
        self.num_steps = 0
        self.num_scheduled_tokens = 0

    @property
    def num_prompt_tokens(self) -> int:
        return self._applier.num_prompt_tokens

    @property
    def num_generation_tokens(self) -> int:
        return self._applier.num_generation_tokens

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def max_live_blocks(self) -> int:
        """With a sliding window, the most blocks one seq holds at once: those after the window
        of its next query and a full step's tokens, plus one a decode step releases late (at
        its next block), plus one planned ahead."""
        config = self.config
        assert config.sliding_window is not None
        return -(-(config.sliding_window + config.max_num_batched_tokens) // config.block_size) + 3

    def check_prompt(self, num_prompt_tokens: int, params: SamplingParams) -> str | None:
        """Why a prompt of this length can never run here, or None if it can."""
        max_model_len = self.config.max_model_len
        if num_prompt_tokens < 1:
            return "the prompt is empty"
        if num_prompt_tokens + 1 > max_model_len:
            return (
                f"the prompt has {num_prompt_tokens} tokens, which leaves no room for output "
                f"within the maximum model length of {max_model_len} tokens"
            )
        max_num_tokens = min(
            num_prompt_tokens + (params.max_tokens or max_model_len), max_model_len
        )
        num_blocks = -(-max_num_tokens // self.config.block_size)
        if self.config.sliding_window is not None:
            num_blocks = min(num_blocks, self.max_live_blocks)
        if num_blocks > self.config.num_kv_blocks:
            return (
                f"the prompt and its output need up to {max_num_tokens} tokens ({num_blocks} KV "
                f"blocks) but the KV cache has only {self.config.num_kv_blocks} blocks"
            )
        return None

    def add(self, seq: Sequence) -> None:
        assert seq.status == SequenceStatus.WAITING and not seq.block_table
        params = seq.params
        seq.max_num_tokens = min(
            seq.num_prompt_tokens + (params.max_tokens or self.config.max_model_len),
            self.config.max_model_len,
        )
        long_from = self.config.long_rope_from
        seq.long_rope = long_from is not None and seq.num_tokens > long_from
        eos_token_ids = frozenset() if params.ignore_eos else self.eos_token_ids
        # NOTE: seqs without stop ids share one set, which then stays in cache for update().
        seq.finish_token_ids = (
            eos_token_ids.union(params.stop_token_ids) if params.stop_token_ids else eos_token_ids
        )
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        # NOTE: update() unpins after a step with copies; a step that failed before its update
        # leaves its pins to here, after which no copy of it can run.
        self.block_manager.unpin()
        budget = self.config.max_num_batched_tokens
        seqs: list[Sequence] = []
        num_new_tokens: list[int] = []
        sampling_mask: list[bool] = []
        preempted: list[Sequence] = []
        running = self.running
        continues_step = self._continuable_step
        self._continuable_step = -1
        last = self._last_output
        # NOTE: admission spends budget on every seq it adds, so len(running) <= budget here.
        if self._reserve_decode_slots():
            if (
                last is not None
                and continues_step == last.step_id
                and (not self.waiting or len(running) >= self.max_num_seqs)
            ):
                return self._continue(last)
            seqs = running.copy()
            num_new_tokens = [1] * len(seqs)
            sampling_mask = [True] * len(seqs)
            budget -= len(seqs)
        else:
            continues_step = -1
            budget = self._schedule_running(budget, seqs, num_new_tokens, sampling_mask, preempted)
        num_scheduled_running = len(seqs)
        if not preempted:
            budget = self._admit_waiting(budget, seqs, num_new_tokens, sampling_mask)
        if len(seqs) != num_scheduled_running:
            continues_step = -1
        if seqs:
            self.num_steps += 1
            self.num_scheduled_tokens += self.config.max_num_batched_tokens - budget
        if last is not None and continues_step == last.step_id:
            block_rows = last.block_rows
        else:
            block_rows = [seq.block_row for seq in seqs]
        out = SchedulerOutput(
            seqs=seqs,
            num_new_tokens=num_new_tokens,
            preempted=preempted,
            sampling_mask=sampling_mask,
            block_tables=self.block_manager.tables,
            block_rows=block_rows,
            block_tables_version=self.block_manager.tables_version,
            continues_step=continues_step,
            kv_copies=self.block_manager.take_copies(),
        )
        self._last_output = out
        return out

    def schedule_ahead(self, out: SchedulerOutput) -> SchedulerOutput | None:
        """The step after `out`, planned before update() applies `out` (async scheduling): every
        seq of `out` computes the token `out` samples for it. None unless `out` is a decode step
        of every running seq (each computes one token and samples), nothing waits for admission,
        no seq can reach its length limit in `out`, and no seq's sampling reads its output tokens
        (penalties, min_tokens)."""
        seqs = out.seqs
        running = self.running
        if not seqs or len(seqs) != len(running) or out.num_batched_tokens != len(seqs):
            return None
        # NOTE: a one-token prefill chunk that does not sample also computes one token; a step
        # continuing it would recompute its position and sample it a second time.
        if not all(out.sampling_mask):
            return None
        if self.waiting and len(running) < self.max_num_seqs:
            return None
        long_from = self.config.long_rope_from
        for seq in seqs:
            if (
                seq.finish_reason is not None
                or len(seq.token_ids) + 1 >= seq.max_num_tokens
                or _reads_output_tokens(seq)
                or (long_from is not None and _will_pass(seq, long_from))
            ):
                return None
        if not self.block_manager.append_blocks(seqs, lookahead=1):
            return None
        # NOTE: a continuation of `out`; `out`'s update() then leaves the seqs as this expects.
        return self._continue(out)

    def _continue(self, last: SchedulerOutput) -> SchedulerOutput:
        """The output continuing `last` (see SchedulerOutput): the same seqs, one token each,
        nothing to admit."""
        # NOTE: its lists are last's; no output's lists are changed once it is returned.
        num_seqs = len(last.seqs)
        self.num_steps += 1
        self.num_scheduled_tokens += num_seqs
        out = SchedulerOutput(
            seqs=last.seqs,
            num_new_tokens=last.num_new_tokens,
            sampling_mask=last.sampling_mask,
            block_tables=self.block_manager.tables,
            block_rows=last.block_rows,
            block_tables_version=self.block_manager.tables_version,
            continues_step=last.step_id,
        )
        self._last_output = out
        return out

    def update(
        self,
        out: SchedulerOutput,
        sampled_token_ids: list[int],
        logprobs: list[TokenLogprobs | None] | None = None,
    ) -> StepUpdate:
        """Apply one step: `sampled_token_ids` align with out's sampling seqs, in batch order."""
        if out.kv_copies:
            self.block_manager.unpin()
        applied = self._applier.apply(out, sampled_token_ids, logprobs, len(self.running))
        if self.config.sliding_window is not None:
            # NOTE: in a decode step only the seqs opening a block release (each does once in
            # block_size steps), so the steady state costs no pass over the seqs. A step planned
            # ahead reads none of the released blocks: its queries follow this step's.
            crossing = applied.crossing
            self.block_manager.release_out_of_window(out.seqs if crossing is None else crossing)
        update = applied.update
        if update.finished:
            self.running = [seq for seq in self.running if seq.finish_reason is None]
        crossing = applied.crossing
        long_from = self.config.long_rope_from
        if long_from is not None and self._recompute_past(update.seqs, long_from):
            crossing = None
        self._decode_crossing = crossing
        is_continuable = crossing is not None and not update.finished
        self._continuable_step = out.step_id if is_continuable else -1
        return update

    def abort(self, seqs: Iterable[Sequence]) -> None:
        """Finish these seqs with ABORT, waiting or running; finished ones are left alone."""
        aborted = [seq for seq in seqs if seq.finish_reason is None]
        self._applier.end_run()
        self._decode_crossing = None
        self._continuable_step = -1
        for seq in aborted:
            seq.finish(FinishReason.ABORT)
            self._applier.forget(seq)
        if aborted:
            self.waiting = deque(seq for seq in self.waiting if seq.finish_reason is None)
            self.running = [seq for seq in self.running if seq.finish_reason is None]

    def requeue(self, seqs: Iterable[Sequence]) -> None:
        """Put these running seqs back at the head of the waiting queue, in order, to be computed
        again from their tokens (a failed step's seqs, before its tokens were applied)."""
        requeued = [seq for seq in seqs if seq.status == SequenceStatus.RUNNING]
        self._applier.end_run()
        self._decode_crossing = None
        self._continuable_step = -1
        self._last_output = None
        if not requeued:
            return
        leaving = set(requeued)
        self.running = [seq for seq in self.running if seq not in leaving]
        for seq in reversed(requeued):
            self._preempt(seq)

    def stats(self) -> SchedulerStats:
        """Gauges now plus counters since start (step_time_s is the caller's to fill)."""
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_usage=self.block_manager.usage,
            num_kv_blocks=self.config.num_kv_blocks,
            prefix_cache_queries=self.block_manager.num_prefix_queries,
            prefix_cache_hits=self.block_manager.num_prefix_hits,
            num_preemptions=self.num_preemptions,
            num_steps=self.num_steps,
            num_scheduled_tokens=self.num_scheduled_tokens,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
        )

    def _reserve_decode_slots(self) -> bool:
        """If every running seq has exactly one uncomputed token, give each room for it; False
        (growing no table) otherwise."""
        # NOTE: the decode steady state; only one step in block_size crosses a block boundary.
        crossing = self._decode_crossing
        self._decode_crossing = None
        if crossing is None:
            if any(seq.num_uncomputed_tokens != 1 for seq in self.running):
                return False
            crossing = self.running
        return self.block_manager.append_blocks(crossing)

    def _schedule_running(
        self,
        budget: int,
        seqs: list[Sequence],
        num_new_tokens: list[int],
        sampling_mask: list[bool],
        preempted: list[Sequence],
    ) -> int:
        block_size = self.config.block_size
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            num_uncomputed = seq.num_uncomputed_tokens
            num_computed = len(seq.token_ids) - num_uncomputed
            num_new = num_uncomputed if num_uncomputed < budget else budget
            if self.config.chunks_end_at_prompt and num_computed < seq.num_prompt_tokens:
                num_new = min(num_new, seq.num_prompt_tokens - num_computed)
            # NOTE: inlines append_slots' "already fits" test; this loop runs per seq per step.
            if num_computed + num_new > len(seq.block_table) * block_size and not (
                self._reserve_slots(seq, num_new, preempted)
            ):
                break
            seqs.append(seq)
            num_new_tokens.append(num_new)
            sampling_mask.append(num_new == num_uncomputed)
            budget -= num_new
            i += 1
        return budget

    def _reserve_slots(self, seq: Sequence, num_new: int, preempted: list[Sequence]) -> bool:
        """Give `seq` room for num_new tokens, preempting the newest running seqs as needed.

        False when `seq` had to preempt itself (it was the newest).
        """
        while not self.block_manager.append_slots(seq, num_new):
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _admit_waiting(
        self,
        budget: int,
        seqs: list[Sequence],
        num_new_tokens: list[int],
        sampling_mask: list[bool],
    ) -> int:
        block_manager = self.block_manager
        is_sharing_prompts = self.config.enable_prefix_caching
        waiting = self.waiting
        active_loras = self._active_loras() if self.config.max_loras and waiting else None
        position = 0
        while position < len(waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = waiting[position]
            if active_loras is not None and not _gets_lora_slot(seq, active_loras, self.config):
                # NOTE: FCFS but for adapters: a seq whose adapter cannot get a slot lets
                # later seqs of resident adapters (or the base model) go first.
                position += 1
                if position >= MAX_LORA_LOOKAHEAD:
                    break
                continue
            cached_blocks = block_manager.match_prefix(seq)
            if self._claims.is_computing_next(seq, cached_blocks):
                break
            partial = block_manager.match_partial(seq, cached_blocks)
            num_uncomputed, num_new = self._admission_size(seq, cached_blocks, partial, budget)
            if not block_manager.can_allocate(num_new, cached_blocks, partial):
                if not partial[1]:
                    break
                # NOTE: a partial hit pins its source block beside the copy; a seq that needs
                # the whole pool then fits only without it (else it waits on nothing forever).
                partial = (-1, 0)
                num_uncomputed, num_new = self._admission_size(seq, cached_blocks, partial, budget)
                if not block_manager.can_allocate(num_new, cached_blocks, partial):
                    break
            del waiting[position]
            if active_loras is not None and seq.lora_id:
                active_loras.add(seq.lora_id)
            block_manager.allocate(seq, num_new, cached_blocks, partial)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if is_sharing_prompts:
                self._claims.claim(seq, cached_blocks)
            seqs.append(seq)
            num_new_tokens.append(num_new)
            sampling_mask.append(num_new == num_uncomputed)
            budget -= num_new
        return budget

    def _admission_size(
        self, seq: Sequence, cached_blocks: list[int], partial: tuple[int, int], budget: int
    ) -> tuple[int, int]:
        """(tokens `seq` has left to compute past its cache hits, how many of them it computes
        in this step) when admitted with `cached_blocks` and `partial` under `budget`."""
        num_computed = len(cached_blocks) * self.config.block_size + partial[1]
        num_uncomputed = seq.num_tokens - num_computed
        num_new = num_uncomputed if num_uncomputed < budget else budget
        if self.config.chunks_end_at_prompt and num_computed < seq.num_prompt_tokens:
            num_new = min(num_new, seq.num_prompt_tokens - num_computed)
        return num_uncomputed, num_new

    def _active_loras(self) -> set[int]:
        return {seq.lora_id for seq in self.running if seq.lora_id}

    def _recompute_past(self, seqs: list[Sequence], long_from: int) -> bool:
        """Requeue, at the head, the unfinished `seqs` that have just grown past the pre-training
        length `long_from` with K/V made on longrope's short factors, to recompute them all on
        the long ones (as transformers drops its cache there); True if any was."""
        passed = [
            seq
            for seq in seqs
            if not seq.long_rope and seq.finish_reason is None and len(seq.token_ids) > long_from
        ]
        if not passed:
            return False
        self._applier.end_run()
        is_passed = {id(seq) for seq in passed}
        self.running = [seq for seq in self.running if id(seq) not in is_passed]
        for seq in reversed(passed):
            self.block_manager.free(seq)
            self._claims.release(seq)
            seq.num_computed_tokens = 0
            # NOTE: counted as preempted, so re-admission keeps its first prompt-cache hit count.
            seq.num_preemptions += 1
            seq.long_rope = True
            seq.full_block_hashes.clear()
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self._claims.release(seq)
        self.num_preemptions += 1


def _gets_lora_slot(seq: Sequence, active_loras: set[int], config: SchedulerConfig) -> bool:
    """Whether `seq` may run beside the running seqs' adapters."""
    lora_id = seq.lora_id
    return not lora_id or lora_id in active_loras or len(active_loras) < config.max_loras


def _will_pass(seq: Sequence, long_from: int) -> bool:
    """Whether the token `seq` samples next takes it past longrope's short factors."""
    return not seq.long_rope and len(seq.token_ids) + 1 > long_from


def _reads_output_tokens(seq: Sequence) -> bool:
    """Whether sampling for `seq` depends on its output so far (penalties, a min_tokens ban,
    bad words, a grammar's mask)."""
    params = seq.params
    return (
        params.has_penalties
        or seq.num_output_tokens < params.min_tokens
        or seq.grammar is not None
        or bool(params.bad_words_token_ids)
    )
