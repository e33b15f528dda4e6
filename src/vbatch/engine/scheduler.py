"""Scheduler: picks each step's batch under a token budget, preempts when KV blocks run out, and
applies sampled tokens and finish rules (torch-free)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from vbatch.engine.block_manager import BlockManager
from vbatch.engine.sequence import Sequence, SequenceStatus
from vbatch.engine.steps import DecodeRun, SchedulerOutput, StepUpdate
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


class Scheduler:
    """FCFS continuous batching on one BlockManager, with chunked prefill and recompute preemption.

    Invariants: every unfinished seq is in exactly one of `waiting` (no blocks, nothing computed) or
    `running` (admission order, newest last); a step never exceeds max_num_batched_tokens tokens or
    max_num_seqs seqs; finished seqs hold no blocks and are in neither queue.
    """

    def __init__(self, config: SchedulerConfig, eos_token_ids: Iterable[int]) -> None:
        self.config = config
        self.block_manager = BlockManager(
            config.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # NOTE: with prefix caching, the hash of each prompt block a running seq is computing and
        # not yet caching -> that seq; a waiting seq whose next uncached block is one of them waits
        # (and the queue behind it, FCFS) to reuse the block instead of computing it again.
        self._prefilling: dict[int, Sequence] = {}
        self._prefill_hashes: dict[int, list[int]] = {}  # seq_id -> its keys in _prefilling
        # NOTE: set by a decode-only update() that every running seq took part in: each then has
        # one uncomputed token, and these (in running order) need a new block for it.
        self._decode_crossing: list[Sequence] | None = None
        # NOTE: the step_id of the last output if the next decode-only step continues it (a
        # decode-only update() that every running seq took part in and none finished), else -1.
        self._continuable_step = -1
        # NOTE: a step continuing the last output has its seqs, token counts and block rows.
        self._last_output: SchedulerOutput | None = None
        # NOTE: set while updates apply continuing decode steps through it; step_id is the last.
        self._run: DecodeRun | None = None
        self.num_preemptions = 0
        self.num_steps = 0
        self.num_scheduled_tokens = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

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
        max_num_tokens = min(num_prompt_tokens + params.max_tokens, max_model_len)
        num_blocks = -(-max_num_tokens // self.config.block_size)
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
            seq.num_prompt_tokens + params.max_tokens, self.config.max_model_len
        )
        eos_token_ids = frozenset() if params.ignore_eos else self.eos_token_ids
        # NOTE: seqs without stop ids share one set, which then stays in cache for update().
        seq.finish_token_ids = (
            eos_token_ids.union(params.stop_token_ids) if params.stop_token_ids else eos_token_ids
        )
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
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
                and (not self.waiting or len(running) >= self.config.max_num_seqs)
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
            seqs,
            num_new_tokens,
            preempted,
            sampling_mask,
            self.block_manager.tables,
            block_rows,
            self.block_manager.tables_version,
            continues_step,
        )
        self._last_output = out
        return out

    def schedule_ahead(self, out: SchedulerOutput) -> SchedulerOutput | None:
        """The step after `out`, planned before update() applies `out` (async scheduling): every
        seq of `out` computes the token `out` samples for it. None unless `out` is a decode step
        of every running seq, nothing waits for admission, no seq can reach its length limit in
        `out`, and no seq's sampling reads its output tokens (penalties, min_tokens)."""
        seqs = out.seqs
        running = self.running
        if not seqs or len(seqs) != len(running) or out.num_batched_tokens != len(seqs):
            return None
        if self.waiting and len(running) < self.config.max_num_seqs:
            return None
        for seq in seqs:
            if (
                seq.finish_reason is not None
                or len(seq.token_ids) + 1 >= seq.max_num_tokens
                or _reads_output_tokens(seq)
            ):
                return None
        if not self.block_manager.append_blocks(seqs, lookahead=1):
            return None
        # NOTE: a continuation of `out`; `out`'s update() then leaves the seqs as this expects.
        return self._continue(out)

    def _continue(self, last: SchedulerOutput) -> SchedulerOutput:
        """The output continuing `last`: the same seqs, one token each, nothing to admit."""
        # NOTE: its lists are last's; no output's lists are changed once it is returned.
        num_seqs = len(last.seqs)
        self.num_steps += 1
        self.num_scheduled_tokens += num_seqs
        out = SchedulerOutput(
            last.seqs,
            last.num_new_tokens,
            [],
            last.sampling_mask,
            self.block_manager.tables,
            last.block_rows,
            self.block_manager.tables_version,
            last.step_id,
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
        if out.continues_step != -1:
            update = self._apply_run(out, sampled_token_ids, logprobs)
            if update is not None:
                return update
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
                self._forget(seq)
            self.running = [seq for seq in self.running if seq.finish_reason is None]
            crossing = [seq for seq in crossing if seq.finish_reason is None]
        # NOTE: out.seqs are running seqs, so with none aborted, equal counts mean every running
        # seq took part.
        is_every_seq_decoding = (
            is_decode_only and not dropped and len(self.running) == len(seqs) - len(finished)
        )
        self._decode_crossing = crossing if is_every_seq_decoding else None
        self._continuable_step = out.step_id if is_every_seq_decoding and not finished else -1
        return StepUpdate(seqs, sampled_token_ids, logprobs, finished, started)

    def _apply_run(
        self,
        out: SchedulerOutput,
        sampled_token_ids: list[int],
        logprobs: list[TokenLogprobs | None] | None,
    ) -> StepUpdate | None:
        """update() for a decode step that continues the last one, through the DecodeRun; None
        when the general path must apply it (a token may finish a seq, or a seq was aborted)."""
        # NOTE: the decode steady state at its cheapest: one append per seq, no other per-seq
        # work; started seqs and prefill claims cannot occur in a continuing step.
        run = self._run
        if run is None or run.step_id != out.continues_step:
            seqs = out.seqs
            if any(seq.finish_reason is not None for seq in seqs):
                return None
            run = self._run = DecodeRun(seqs, self.config.block_size)
        crossing = run.take(out.step_id, sampled_token_ids, self.config.block_size)
        if crossing is None:
            return None
        if self.config.enable_prefix_caching:
            for seq in crossing:
                self.block_manager.cache_full_blocks(seq)
        self.num_generation_tokens += len(sampled_token_ids)
        self._decode_crossing = crossing
        self._continuable_step = out.step_id
        return StepUpdate(out.seqs, sampled_token_ids, logprobs, [], [])

    def _apply_decodes(
        self,
        seqs: list[Sequence],
        sampled_token_ids: list[int],
        finished: list[Sequence],
        started: list[Sequence],
        dropped: list[int],
        crossing: list[Sequence],
    ) -> list[Sequence]:
        """update() for a step in which every seq computed one token and sampled; returns the
        seqs that took their token and adds to `crossing` those whose next token opens a block."""
        # NOTE: the decode steady state, so the per-seq work is cut to what one token can change.
        block_size = self.config.block_size
        is_caching = self.config.enable_prefix_caching
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
                self._release_prefill(seq)
            if num_computed % block_size == 0:
                crossing.append(seq)
                if is_caching:
                    self.block_manager.cache_full_blocks(seq)
            if (
                token_id in seq.finish_token_ids or len(token_ids) >= seq.max_num_tokens
            ) and self._check_finish(seq, token_id):
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
        """update() for any step; returns the seqs that took a sampled token."""
        block_size = self.config.block_size
        is_caching = self.config.enable_prefix_caching
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
            if is_caching and new // block_size > old // block_size:
                self.block_manager.cache_full_blocks(seq)
            num_prompt_tokens = seq.num_prompt_tokens
            if old < num_prompt_tokens:
                self.num_prompt_tokens += min(new, num_prompt_tokens) - old
                if new >= num_prompt_tokens:
                    self._release_prefill(seq)
                if not is_sampling:
                    continue
                started.append(seq)
            elif not is_sampling:
                continue
            token_id = sampled_token_ids[j]
            j += 1
            seq.append_token(token_id)
            token_ids = seq.token_ids
            seqs.append(seq)
            # NOTE: most tokens finish nothing; the full rules run only when one may apply.
            if (
                token_id in seq.finish_token_ids or len(token_ids) >= seq.max_num_tokens
            ) and self._check_finish(seq, token_id):
                finished.append(seq)
        assert j == len(sampled_token_ids), "one sampled token per sampling seq"
        return seqs

    def abort(self, seqs: Iterable[Sequence]) -> None:
        """Finish these seqs with ABORT, waiting or running; finished ones are left alone."""
        aborted = [seq for seq in seqs if seq.finish_reason is None]
        self._run = None
        self._decode_crossing = None
        self._continuable_step = -1
        for seq in aborted:
            self._finish(seq, FinishReason.ABORT)
            self._forget(seq)
        if aborted:
            self.waiting = deque(seq for seq in self.waiting if seq.finish_reason is None)
            self.running = [seq for seq in self.running if seq.finish_reason is None]

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
        block_size = self.config.block_size
        is_sharing_prompts = self.config.enable_prefix_caching
        waiting = self.waiting
        while waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = waiting[0]
            cached_blocks = block_manager.match_prefix(seq)
            if self._prefilling and self._is_prefix_being_computed(seq, cached_blocks):
                break
            num_uncomputed = seq.num_tokens - len(cached_blocks) * block_size
            num_new = num_uncomputed if num_uncomputed < budget else budget
            if not block_manager.can_allocate(num_new, cached_blocks):
                break
            waiting.popleft()
            block_manager.allocate(seq, num_new, cached_blocks)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if is_sharing_prompts:
                self._claim_prefill(seq, cached_blocks)
            seqs.append(seq)
            num_new_tokens.append(num_new)
            sampling_mask.append(num_new == num_uncomputed)
            budget -= num_new
        return budget

    def _is_prefix_being_computed(self, seq: Sequence, cached_blocks: list[int]) -> bool:
        """Whether another running seq is computing the block after `seq`'s cached ones."""
        # NOTE: so the samples of one request, and requests sharing a system prompt, compute
        # it once: the first admitted computes it, the others wait a step and hit the cache.
        next_hashes = self.block_manager.uncached_prompt_hashes(seq, cached_blocks, limit=1)
        owner = self._prefilling.get(next_hashes[0]) if next_hashes else None
        return owner is not None and owner is not seq

    def _claim_prefill(self, seq: Sequence, cached_blocks: list[int]) -> None:
        claimed = [
            block_hash
            for block_hash in self.block_manager.uncached_prompt_hashes(seq, cached_blocks)
            if self._prefilling.setdefault(block_hash, seq) is seq
        ]
        if claimed:
            self._prefill_hashes[seq.seq_id] = claimed

    def _release_prefill(self, seq: Sequence) -> None:
        """Drop `seq`'s claims: its prompt is computed (so cached), or it left the running set."""
        if self._prefill_hashes:
            for block_hash in self._prefill_hashes.pop(seq.seq_id, ()):
                del self._prefilling[block_hash]

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self._release_prefill(seq)
        self.num_preemptions += 1

    def _check_finish(self, seq: Sequence, token_id: int) -> bool:
        """Finish `seq` if its newest token `token_id` ends it; True if it did."""
        params = seq.params
        num_output_tokens = len(seq.token_ids) - seq.num_prompt_tokens
        # NOTE: EOS and stop ids count only after min_tokens other tokens, so the earliest stop is
        # output token min_tokens + 1; this matches the sampler, which bans them until then.
        if num_output_tokens > params.min_tokens:
            if token_id in self.eos_token_ids and not params.ignore_eos:
                self._finish(seq, FinishReason.STOP)
                return True
            if token_id in params.stop_token_ids:
                self._finish(seq, FinishReason.STOP, token_id)
                return True
        if (
            num_output_tokens >= params.max_tokens
            or len(seq.token_ids) >= self.config.max_model_len
        ):
            self._finish(seq, FinishReason.LENGTH)
            return True
        return False

    def _finish(self, seq: Sequence, reason: FinishReason, stop_reason: int | None = None) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason

    def _forget(self, seq: Sequence) -> None:
        """Drop a finished seq's blocks and bookkeeping."""
        self.block_manager.free(seq)
        self._release_prefill(seq)


def _reads_output_tokens(seq: Sequence) -> bool:
    """Whether sampling for `seq` depends on its output so far (penalties, a min_tokens ban)."""
    params = seq.params
    return params.has_penalties or seq.num_output_tokens < params.min_tokens
