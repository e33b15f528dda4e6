"""EngineCore: the in-process engine; add requests, step, and collect each step's outputs."""

from __future__ import annotations

import itertools
import os
import time
import traceback
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait

from vbatch.config import EngineConfig, resolve_max_model_len
from vbatch.engine.grammar import GrammarCache, GrammarError, new_matcher
from vbatch.engine.model_runner import ModelRunner
from vbatch.engine.pooling import PoolingJob, PoolingQueue
from vbatch.engine.sampler import SamplerOutput
from vbatch.engine.scheduler import Scheduler, SchedulerConfig
from vbatch.engine.sequence import Sequence
from vbatch.engine.steps import SchedulerOutput, StepUpdate
from vbatch.errors import LoraError, VbatchError
from vbatch.lora.request import LoraRef
from vbatch.models.config import HEAD_NAMES, ModelConfig
from vbatch.models.loader import resolve_model
from vbatch.pooling_params import PoolingParams, PoolingTask
from vbatch.protocol import (
    AddRequest,
    EngineOutputs,
    FinishReason,
    PooledOutput,
    Ready,
    SampleFinish,
    SchedulerStats,
    unpack_token_ids,
)

# NOTE: how long an idle step waits for a grammar being compiled before returning.
GRAMMAR_WAIT_S = 0.05
# NOTE: this many failed steps in a row, with no step succeeding in between, mean the engine
# itself is broken rather than one of its requests.
MAX_CONSECUTIVE_STEP_FAILURES = 3
DEAD_END = (
    "no token is left to sample: this request's allowed_token_ids, bad_words, min_tokens (which "
    "bars EOS and the stop token ids) and structured-output constraint together exclude every "
    "token, so generation cannot go on"
)
# NOTE: test-only fault injection (no real way exists to fail a step or wedge the loop once
# requests are validated): "raise:<token id>", "fatal:<token id>", "sleep:<token id>:<s>" or
# "spin:<token id>:<s>" (a step that computes, busy, for that long)
# acts in any step holding a seq whose prompt contains that token id.
FAULTS_ENV = "VBATCH_TEST_FAULTS"
# NOTE: messages of errors after which the device is unusable (a CUDA error poisons its context).
_FATAL_MARKERS = (
    "CUDA error",
    "CUBLAS_STATUS",
    "CUDNN_STATUS",
    "cuDNN error",
    "device-side assert",
    "illegal memory access",
    "unspecified launch failure",
)


class EngineBrokenError(VbatchError):
    """A failure after which the engine cannot go on; the core process exits on it."""


class EngineCore:
    """Schedules requests over the paged KV cache and runs one model step at a time.

    Invariants: every live request id maps to its samples in `requests` (in index order) and to
    how many of them are unfinished in `num_unfinished`, and leaves both once all of them have
    finished. The n samples of one request are n Sequences; the scheduler admits the later ones
    after the first has computed the prompt, so they share its KV blocks.

    Failures: a request that cannot be added, and the request of a step that raises, end with
    an ERROR finish carrying the exception's text, and the engine goes on. A step of several
    requests that raises before its tokens were applied fails none of them: they are computed
    again (from their tokens so far) in groups of half the step's size, halving again while a
    group fails, so that only the request that raises, alone in its step, ends with an ERROR
    (`_retry_apart`). A step raises EngineBrokenError instead when the failure leaves the engine
    unusable: a CUDA error (other than out-of-memory), a non-Exception BaseException, or
    MAX_CONSECUTIVE_STEP_FAILURES failed steps of one request in a row.
    """

    def __init__(
        self, config: EngineConfig, on_progress: Callable[[str], None] | None = None
    ) -> None:
        progress = on_progress or (lambda stage: None)
        self.config = config.validate()
        progress("resolving model")
        resolved = resolve_model(config.model)
        self.model_config = ModelConfig.from_hf_dir(resolved.hf_dir)
        self.max_model_len = resolve_max_model_len(
            config.max_model_len,
            self.model_config.max_position_embeddings,
            "max_position_embeddings",
        )
        self.runner = ModelRunner(config, resolved, self.model_config, progress)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                block_size=config.block_size,
                num_kv_blocks=self.runner.num_kv_blocks,
                enable_prefix_caching=config.enable_prefix_caching,
                sliding_window=_kv_window(self.model_config.sliding_windows),
                long_rope_from=self.model_config.long_rope_from,
                max_loras=config.max_loras if config.enable_lora else 0,
                chunks_end_at_prompt=config.batch_invariant,
            ),
            eos_token_ids=self.model_config.eos_token_ids,
        )
        self.requests: dict[str, list[Sequence]] = {}
        self.pooling = PoolingQueue(
            self.runner,
            self.scheduler.block_manager,
            str(resolved.hf_dir),
            config.max_num_batched_tokens,
            config.max_num_seqs,
            self.max_model_len,
        )
        self.grammars = GrammarCache(
            resolved.hf_dir, self.model_config.vocab_size, self.model_config.eos_token_ids
        )
        # NOTE: requests whose grammar is compiling; they join the scheduler once it is ready.
        self._compiling: dict[str, tuple[list[Sequence], Future]] = {}
        # NOTE: a count, so a finish costs O(1) rather than a scan of the request's n samples.
        self.num_unfinished: dict[str, int] = {}
        self.info = Ready(
            max_model_len=self.max_model_len,
            num_kv_blocks=self.runner.num_kv_blocks,
            block_size=config.block_size,
            device=str(self.runner.device),
            dtype=str(self.runner.dtype).removeprefix("torch."),
            vocab_size=self.model_config.vocab_size,
            kv_cache_bytes=self.runner.kv_cache_bytes,
            attention_backend=self.runner.attn_backend.name,
            pid=os.getpid(),
            kernels=self.runner.kernel_notes,
            kernel_warnings=self.runner.kernel_warnings,
        )
        self._step_time = 0.0
        self._forward_time = 0.0
        self.last_step_tokens = 0
        # NOTE: with async scheduling, the launched step that continues the one step() applied
        # last, with its samples still on the device.
        self._ahead: tuple[SchedulerOutput, SamplerOutput | None] | None = None
        # NOTE: the last output's (step_id, request_ids, indices) when it covered all its seqs.
        self._columns: tuple[int, list[str], list[int]] = (-1, [], [])
        self._num_failed_steps = 0
        # NOTE: the requests of a failed step being run again in smaller groups, and whether the
        # step being run is applying its tokens (a failure then cannot be retried).
        self._suspects: set[str] = set()
        self._is_applying = False
        self._faults = _parse_faults(os.environ.get(FAULTS_ENV))
        for lora_id, (name, path) in enumerate(config.loras, start=1):
            progress(f"loading LoRA adapter {name}")
            assert self.runner.lora is not None, "validate() requires enable_lora with loras"
            self.runner.lora.register(LoraRef(lora_id, name, path))

    def add_request(self, req: AddRequest) -> list[SampleFinish]:
        """Queue a request; a rejected one, or one whose admission raised, comes back as an ERROR
        finish."""
        is_new = req.request_id not in self.requests
        try:
            return self._add_request(req)
        except Exception as e:
            if is_new and req.request_id in self.requests:
                self.abort([req.request_id])
            return [_error(req.request_id, f"the engine could not add the request: {_describe(e)}")]

    def _add_request(self, req: AddRequest) -> list[SampleFinish]:
        prompt_token_ids = unpack_token_ids(req.prompt_token_ids)
        params = req.sampling_params
        if req.request_id in self.requests or req.request_id in self.pooling.jobs:
            return [_error(req.request_id, f"request id {req.request_id!r} is already running")]
        if req.pooling is not None:
            return self._add_pooling(req.request_id, prompt_token_ids, req.pooling)
        if self.model_config.head != "lm":
            return [_error(req.request_id, no_lm_head(self.model_config))]
        reason = self.scheduler.check_prompt(len(prompt_token_ids), params)
        if reason is not None:
            return [_error(req.request_id, reason)]
        vocab_size = self.model_config.vocab_size
        if max(prompt_token_ids) >= vocab_size or min(prompt_token_ids) < 0:
            return [_error(req.request_id, f"prompt token ids must lie in [0, {vocab_size})")]
        if params.max_token_id() >= vocab_size:
            return [
                _error(
                    req.request_id,
                    f"stop_token_ids, logit_bias, allowed_token_ids and bad-word token ids must "
                    f"lie in [0, {vocab_size})",
                )
            ]
        lora_id = 0
        if req.lora is not None:
            if self.runner.lora is None:
                return [
                    _error(
                        req.request_id,
                        "the request names a LoRA adapter; start the engine with enable_lora",
                    )
                ]
            try:
                self.runner.lora.register(req.lora)
            except LoraError as e:
                return [_error(req.request_id, str(e))]
            lora_id = req.lora.lora_id
        seqs = [
            Sequence(req.request_id, prompt_token_ids, params, i, lora_id, req.cache_salt)
            for i in range(params.n)
        ]
        prompt_job = None
        if params.prompt_logprobs is not None:
            if params.structured is not None:
                return [_error(req.request_id, "prompt_logprobs cannot go with structured output")]
            if lora_id:
                return [_error(req.request_id, "prompt_logprobs cannot go with a LoRA adapter")]
            prompt_job = PoolingJob(
                req.request_id,
                [prompt_token_ids],
                PoolingParams(PoolingTask.PROMPT_LOGPROBS, top_logprobs=params.prompt_logprobs),
                then=seqs,
            )
        self.requests[req.request_id] = seqs
        self.num_unfinished[req.request_id] = len(seqs)
        if prompt_job is not None:
            self.pooling.add(prompt_job)
            return []
        if params.structured is not None:
            self._compiling[req.request_id] = (seqs, self.grammars.get(params.structured))
            return []
        for seq in seqs:
            self.scheduler.add(seq)
        return []

    def _add_pooling(
        self, request_id: str, prompt_token_ids: list[int], params: PoolingParams
    ) -> list[SampleFinish]:
        prompts = [prompt_token_ids]
        if params.prompt_lens is not None:
            if sum(params.prompt_lens) != len(prompt_token_ids):
                return [_error(request_id, "prompt_lens do not add up to the prompt's length")]
            ends = list(itertools.accumulate(params.prompt_lens))
            prompts = [prompt_token_ids[end - n : end] for n, end in zip(params.prompt_lens, ends)]
        if not all(prompts):
            return [_error(request_id, "the prompt is empty")]
        vocab_size = self.model_config.vocab_size
        if max(prompt_token_ids) >= vocab_size or min(prompt_token_ids) < 0:
            return [_error(request_id, f"prompt token ids must lie in [0, {vocab_size})")]
        reason = self.pooling.check(prompts, params)
        if reason is not None:
            return [_error(request_id, reason)]
        self.pooling.add(PoolingJob(request_id, prompts, params))
        return []

    def _pooling_step(self) -> tuple[list[PooledOutput], list[SampleFinish]]:
        """Run the next pooling step, if its jobs find blocks: a pooling request ends with its
        PooledOutput and a STOP finish; a generation request's samples are scheduled after
        its prompt logprobs. A failed step fails its jobs' requests alone."""
        jobs = self.pooling.pick()
        if not jobs:
            return [], []
        try:
            pooled = self.pooling.run(jobs)
        except Exception as e:
            if _is_fatal(e):
                raise EngineBrokenError(f"{_describe(e)}; the engine cannot go on after it") from e
            failed = [job.request_id for job in jobs]
            self.abort([job.request_id for job in jobs if job.then])
            message = f"the engine failed a pooling step: {_describe(e)}"
            return [], [_error(rid, message) for rid in failed]
        finished = []
        for job in jobs:
            if not job.then:
                finished.append(SampleFinish(job.request_id, FinishReason.STOP))
            for seq in job.then:
                self.scheduler.add(seq)
        return pooled, finished

    def _admit_compiled(self, block: bool) -> list[SampleFinish]:
        """Schedule the requests whose grammar is ready (waiting a little for one when `block`);
        a grammar that failed to compile is an ERROR finish of its request."""
        if not self._compiling:
            return []
        if block:
            futures = [future for _, future in self._compiling.values()]
            wait(futures, timeout=GRAMMAR_WAIT_S, return_when=FIRST_COMPLETED)
        self.grammars.check_budget()
        errors = []
        for request_id, (seqs, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            try:
                grammar = future.result()
            except GrammarError as e:
                del self.requests[request_id]
                del self.num_unfinished[request_id]
                errors.append(_error(request_id, str(e)))
                continue
            for seq in seqs:
                seq.grammar = new_matcher(grammar)
                self.scheduler.add(seq)
        return errors

    def abort(self, request_ids: list[str], indices: list[int] | None = None) -> list[SampleFinish]:
        """ABORT every unfinished sample of these requests, or with `indices` only sample
        `indices[j]` of `request_ids[j]`; unknown ids and indices, and finished samples, are
        skipped."""
        if indices is None:
            pooled = [rid for rid in dict.fromkeys(request_ids) if self.pooling.remove(rid)]
            live = [rid for rid in dict.fromkeys(request_ids) if rid in self.requests]
            seqs = [seq for rid in live for seq in self.requests.pop(rid)]
            for rid in live:
                self.num_unfinished.pop(rid, None)
                self._compiling.pop(rid, None)
            unfinished = [seq for seq in seqs if not seq.is_finished]
            self.scheduler.abort(unfinished)
            self.runner.release(seqs)
            aborted = [SampleFinish(rid, FinishReason.ABORT) for rid in pooled if rid not in live]
            return aborted + [_finish(seq) for seq in unfinished]
        picked: dict[Sequence, None] = {}
        # NOTE: not strict: a malformed Abort must not end the core's loop.
        for rid, index in zip(request_ids, indices):
            samples = self.requests.get(rid)
            if samples is not None and 0 <= index < len(samples):
                seq = samples[index]
                if not seq.is_finished:
                    picked[seq] = None
        unfinished = list(picked)
        if unfinished:
            self.scheduler.abort(unfinished)
            self.runner.release(unfinished)
            self._forget_finished(unfinished)
        return [_finish(seq) for seq in unfinished]

    def _forget_finished(self, seqs: list[Sequence]) -> None:
        """Count these newly finished seqs; a request whose samples all finished leaves."""
        num_unfinished = self.num_unfinished
        for seq in seqs:
            rid = seq.request_id
            left = num_unfinished.get(rid, 0) - 1
            if left > 0:
                num_unfinished[rid] = left
            elif rid in num_unfinished:
                del num_unfinished[rid]
                del self.requests[rid]

    @property
    def thread_invariant(self) -> bool:
        """Whether this core's results are the same at any thread count (engine/cpu_share.py)."""
        return self.runner.thread_invariant

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self.pooling.jobs) or self._ahead is not None

    def step(self) -> EngineOutputs:
        """Schedule, run and apply one step; an empty EngineOutputs when nothing could run.

        Without `async_scheduling` a step is scheduled, run and applied in turn
        (`_normal_step`); with it, `_overlap_step` launches a decode step that continues this
        one before this one's tokens reach the host. A step that raises ends its requests with
        an ERROR finish (see the class docstring).
        """
        # NOTE: the outputs of this step (and of the one launched ahead of it), for the except.
        planned: list[SchedulerOutput] = []
        try:
            outputs = self._step(planned)
        except Exception as e:
            if not planned or _is_fatal(e):
                raise EngineBrokenError(f"{_describe(e)}; the engine cannot go on after it") from e
            seqs = [seq for out in planned for seq in out.seqs]
            if not self._is_applying and len({seq.request_id for seq in seqs}) > 1:
                return self._retry_apart(seqs)
            self._is_applying = False
            self._num_failed_steps += 1
            if self._num_failed_steps >= MAX_CONSECUTIVE_STEP_FAILURES:
                raise EngineBrokenError(
                    f"{self._num_failed_steps} engine steps in a row failed, the last with "
                    f"{_describe(e)}"
                ) from e
            self._end_retries()
            return self._fail_step(planned, f"the engine failed a step: {_describe(e)}")
        if planned:
            self._num_failed_steps = 0
            if self._suspects and not self._suspects & self.requests.keys():
                self._end_retries()
            self.runner.packed_store.flush()
        return outputs

    def _retry_apart(self, seqs: list[Sequence]) -> EngineOutputs:
        """Run a failed step's requests again, at most half as many seqs to a step, so that the
        request that made it fail ends up alone in a step and fails alone."""
        self._ahead = None
        self._columns = (-1, [], [])
        self.runner.reset_step_state()
        request_ids = dict.fromkeys(seq.request_id for seq in seqs)
        samples = [seq for rid in request_ids for seq in self.requests.get(rid, ())]
        self.scheduler.requeue(samples)
        self._suspects.update(request_ids)
        self.scheduler.max_num_seqs = max(1, len(dict.fromkeys(seqs)) // 2)
        return EngineOutputs()

    def _end_retries(self) -> None:
        """The request that failed was found (or the retried ones all finished): run at full
        size again."""
        self._suspects.clear()
        self.scheduler.max_num_seqs = self.config.max_num_seqs

    def _step(self, planned: list[SchedulerOutput]) -> EngineOutputs:
        start = time.perf_counter()
        errors = self._admit_compiled(
            block=self._ahead is None and not self.scheduler.has_unfinished()
        )
        run_step = self._overlap_step if self.config.async_scheduling else self._normal_step
        outputs = run_step(planned)
        self.last_step_tokens = sum(out.num_batched_tokens for out in planned)
        if self.pooling.jobs:
            pooled, finished = self._pooling_step()
            errors += finished
            if pooled and outputs is None:
                outputs = EngineOutputs()
            if outputs is not None:
                outputs.pooled = pooled
        if outputs is None:
            return EngineOutputs(finished=errors)
        outputs.finished = errors + outputs.finished
        self._step_time += time.perf_counter() - start
        return outputs

    def _normal_step(self, planned: list[SchedulerOutput]) -> EngineOutputs | None:
        """Schedule a step, run it and apply its tokens; None when nothing could be scheduled."""
        out = self._schedule(planned)
        if out is None:
            return None
        return self._apply(out, self._launch(out))

    def _overlap_step(self, planned: list[SchedulerOutput]) -> EngineOutputs | None:
        """Apply the step the last call launched ahead (or schedule and launch one), after
        launching the decode step that continues it, so the device computes that one while this
        one's tokens are applied; the next call applies it. A seq that finishes meanwhile has
        its token of that step dropped. None when nothing could be scheduled."""
        if self._ahead is not None:
            out, sampled = self._ahead
            self._ahead = None
            planned.append(out)
        else:
            out = self._schedule(planned)
            if out is None:
                return None
            sampled = self._launch(out)
        ahead = self.scheduler.schedule_ahead(out)
        if ahead is not None:
            planned.append(ahead)
            self._ahead = (ahead, self._launch(ahead))
        return self._apply(out, sampled)

    def _schedule(self, planned: list[SchedulerOutput]) -> SchedulerOutput | None:
        out = self.scheduler.schedule()
        if out.is_empty:
            return None
        planned.append(out)
        if self._faults is not None:
            _inject_fault(self._faults, out)
        return out

    def _apply(self, out: SchedulerOutput, sampled: SamplerOutput | None) -> EngineOutputs:
        """Wait for `out`'s tokens, apply them, and build the step's EngineOutputs."""
        collect_start = time.perf_counter()
        token_ids, logprobs = self.runner.collect(sampled)
        self._forward_time += time.perf_counter() - collect_start
        self._is_applying = True
        update = self.scheduler.update(out, token_ids, logprobs)
        outputs = self._outputs(out, update)
        self._is_applying = False
        dead_ends = sampled.dead_ends() if sampled is not None else []
        if dead_ends:
            self._end_dead_ends(dead_ends, outputs)
        return outputs

    def _end_dead_ends(self, seqs: list[Sequence], outputs: EngineOutputs) -> None:
        """End the requests of `seqs`, seqs left with no token to sample, with an
        ERROR finish each, in place of their entries and finishes in the step's `outputs` (the
        token sampled from nothing); the rest of the step stands."""
        dropped = dict.fromkeys(seq.request_id for seq in seqs)
        keep = [j for j, rid in enumerate(outputs.request_ids) if rid not in dropped]
        outputs.request_ids = [outputs.request_ids[j] for j in keep]
        outputs.indices = [outputs.indices[j] for j in keep]
        outputs.token_ids = [outputs.token_ids[j] for j in keep]
        if outputs.logprobs is not None:
            outputs.logprobs = [outputs.logprobs[j] for j in keep]
        outputs.finished = [f for f in outputs.finished if f.request_id not in dropped]
        self._columns = (-1, [], [])
        self.abort([rid for rid in dropped if rid in self.requests])
        outputs.finished.extend(_error(rid, DEAD_END) for rid in dropped)

    def _fail_step(self, planned: list[SchedulerOutput], message: str) -> EngineOutputs:
        """End every request with a seq in `planned` with an ERROR finish; reset the state that
        ties one step to the next, so the next step is planned and built afresh."""
        self._ahead = None
        self._columns = (-1, [], [])
        self.runner.reset_step_state()
        request_ids = dict.fromkeys(seq.request_id for out in planned for seq in out.seqs)
        failed = [rid for rid in request_ids if rid in self.requests]
        seqs = [seq for rid in failed for seq in self.requests[rid]]
        # NOTE: abort() also drops the scheduler's and the applier's ties to the failed step.
        self.abort(failed)
        # NOTE: an update() cut short may have finished seqs without freeing them.
        scheduler = self.scheduler
        for seq in seqs:
            if seq.block_table:
                scheduler.block_manager.free(seq)
        scheduler.running = [seq for seq in scheduler.running if seq.finish_reason is None]
        return EngineOutputs(finished=[_error(rid, message) for rid in failed])

    def _launch(self, out: SchedulerOutput) -> SamplerOutput | None:
        launch_start = time.perf_counter()
        sampled = self.runner.launch(out)
        self._forward_time += time.perf_counter() - launch_start
        return sampled

    def _outputs(self, out: SchedulerOutput, update: StepUpdate) -> EngineOutputs:
        seqs = update.seqs
        last_step, request_ids, indices = self._columns
        if out.continues_step == -1 or out.continues_step != last_step or seqs is not out.seqs:
            request_ids = [seq.request_id for seq in seqs]
            indices = [seq.index for seq in seqs]
        # NOTE: a step that continues this one has the same seqs in the same order.
        self._columns = (out.step_id, request_ids, indices) if seqs is out.seqs else (-1, [], [])
        num_cached_tokens: dict[str, int] = {}
        for seq in update.started:
            rid = seq.request_id
            num_cached_tokens[rid] = max(num_cached_tokens.get(rid, 0), seq.num_cached_tokens)
        finished = update.finished
        if finished:
            self.runner.release(finished)
            self._forget_finished(finished)
        return EngineOutputs(
            request_ids=request_ids,
            indices=indices,
            token_ids=update.token_ids,
            logprobs=update.logprobs,
            finished=[_finish(seq) for seq in finished],
            num_cached_tokens=num_cached_tokens,
        )

    def stats(self) -> SchedulerStats:
        stats = self.scheduler.stats()
        stats.num_waiting += len(self.pooling.jobs)
        stats.num_prompt_tokens += self.pooling.num_prompt_tokens
        stats.step_time_s = self._step_time
        stats.forward_time_s = self._forward_time
        return stats

    def shutdown(self) -> None:
        self.abort(list(self.requests))
        self._ahead = None
        self.grammars.shutdown()
        self.runner.grammar_masks.shutdown()
        self.runner.packed_store.close()


def _kv_window(sliding_windows: tuple[int | None, ...]) -> int | None:
    """The window that bounds the keys every layer reads (the widest), None if a layer attends
    globally: Gemma's global layers need every position, so no block is ever released there."""
    if not sliding_windows or None in sliding_windows:
        return None
    return max(w for w in sliding_windows if w is not None)


def _finish(seq: Sequence) -> SampleFinish:
    assert seq.finish_reason is not None
    return SampleFinish(
        seq.request_id,
        seq.finish_reason,
        index=seq.index,
        stop_reason=seq.stop_reason,
        num_cached_tokens=seq.num_cached_tokens,
    )


def no_lm_head(config: ModelConfig) -> str:
    """Why a model without an LM head cannot generate, and what it can do instead."""
    task = "classify" if config.head == "score" else "embed"
    instead = f"--task {task} (LLM.{task})"
    return (
        f"generation needs a model with an LM head; this one has "
        f"{HEAD_NAMES.get(config.head, repr(config.head))}: run it with {instead}"
    )


def _error(request_id: str, message: str) -> SampleFinish:
    return SampleFinish(request_id, FinishReason.ERROR, error=message)


def _describe(e: BaseException) -> str:
    """The exception's type and text, and where it was raised, on one line."""
    text = str(e) if isinstance(e, VbatchError) else f"{type(e).__name__}: {e}"
    frames = traceback.extract_tb(e.__traceback__)
    if frames:
        last = frames[-1]
        text += f" (at {os.path.basename(last.filename)}:{last.lineno} in {last.name})"
    return text


def _is_fatal(e: BaseException) -> bool:
    """Whether `e` leaves the engine unusable whatever request comes next."""
    if not isinstance(e, Exception) or isinstance(e, EngineBrokenError):
        return True
    import torch

    if isinstance(e, torch.cuda.OutOfMemoryError):
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(e, accelerator_error):
        return True
    text = str(e)
    return any(marker in text for marker in _FATAL_MARKERS)


def _parse_faults(spec: str | None) -> dict[int, tuple[str, float]] | None:
    """FAULTS_ENV's comma-separated `action:token_id[:seconds]` items, by token id."""
    if not spec:
        return None
    faults = {}
    for item in spec.split(","):
        action, token_id, *rest = item.strip().split(":")
        if action not in ("raise", "fatal", "sleep", "spin"):
            raise ValueError(f"{FAULTS_ENV}: unknown action {action!r}")
        faults[int(token_id)] = (action, float(rest[0]) if rest else 0.0)
    return faults


def _inject_fault(faults: dict[int, tuple[str, float]], out: SchedulerOutput) -> None:
    for seq in out.seqs:
        for token_id in faults.keys() & set(seq.token_ids[: seq.num_prompt_tokens]):
            action, seconds = faults[token_id]
            if action == "sleep":
                time.sleep(seconds)
            elif action == "spin":
                deadline = time.monotonic() + seconds
                while time.monotonic() < deadline:
                    sum(range(1000))
            elif action == "fatal":
                raise RuntimeError("CUDA error: an illegal memory access was encountered (test)")
            else:
                raise RuntimeError(f"injected fault: prompt token {token_id}")
