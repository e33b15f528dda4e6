"""EncoderCore: the engine of an encoder-only model (BERT, XLM-RoBERTa), beside EngineCore: no
scheduler or KV cache, only embedding requests packed into steps of whole prompts; and
`make_core`, which picks the engine for a model."""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgspec
import torch

from vbatch.config import EngineConfig, resolve_max_model_len
from vbatch.engine.cpu_share import cpu_notes
from vbatch.engine.kv_cache import select_device, select_dtype
from vbatch.engine.pooling import PoolingJob, float32_bytes, too_long_prompt
from vbatch.layers.linear_choice import runs_at_any_thread_count, settle_linears
from vbatch.models.bert import EncoderConfig, load_encoder
from vbatch.models.config import is_encoder_dir
from vbatch.models.loader import resolve_model
from vbatch.models.poolers import finish_embedding, pool, read_pooling_config
from vbatch.pooling_params import PoolingTask
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


def make_core(config: EngineConfig, on_progress: Callable[[str], None] | None = None) -> Any:
    """EncoderCore for an encoder-only model, else EngineCore."""
    if is_encoder_dir(resolve_model(config.model).hf_dir):
        return EncoderCore(config, on_progress)
    from vbatch.engine.core import EngineCore

    return EngineCore(config, on_progress)


class EncoderCore:
    """Embeds requests with an encoder, first in first out, in steps of whole prompts.

    Invariants: a request is in `jobs` from add_request until the step that answers it (a
    PooledOutput and a STOP finish) or its abort; a step takes at least one job and more while
    they fit `max_num_batched_tokens` and `max_num_seqs`. Only EMBED requests are taken.
    """

    def __init__(
        self, config: EngineConfig, on_progress: Callable[[str], None] | None = None
    ) -> None:
        progress = on_progress or (lambda stage: None)
        self.config = config.validate()
        progress("resolving model")
        resolved = resolve_model(config.model)
        encoder_config = EncoderConfig.from_hf_dir(resolved.hf_dir)
        self.max_model_len = resolve_max_model_len(
            config.max_model_len, encoder_config.max_seq_length, "maximum sequence length"
        )
        self.device = select_device(config.device)
        dtype = select_dtype(config.dtype, self.device)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        progress("loading model")
        self.model = load_encoder(resolved.hf_dir, self.device, dtype)
        kernels: list[str] = []
        self.thread_invariant = False
        if self.device.type == "cpu" and dtype == torch.float32:
            if config.linear_backend == "auto":
                progress("choosing kernels")
            settled = settle_linears(
                config.linear_backend,
                self.model,
                self.model.linear_weights(),
                transposed_mlp=False,
                # NOTE: an encoder's steps are long prefills, so one class's copy serves nearly all.
                one_copy=False,
            )
            if settled is not None:
                self.model.use_linear_choice(settled[0])
                kernels.append(settled[1])
                # NOTE: as for a decoder (ModelRunner): native linears and native attention.
                linears_invariant = runs_at_any_thread_count(settled[0])
                native_attention = self.model.native_attention(dtype, self.device)
                self.thread_invariant = linears_invariant and native_attention
        if self.device.type == "cpu":
            kernels += cpu_notes(torch.get_num_threads(), self.thread_invariant)
        self.pooling = read_pooling_config(resolved.hf_dir, "cls")
        self.hidden_size = encoder_config.hidden_size
        self.vocab_size = encoder_config.vocab_size
        self.jobs: OrderedDict[str, PoolingJob] = OrderedDict()
        self.info = Ready(
            max_model_len=self.max_model_len,
            num_kv_blocks=0,
            block_size=config.block_size,
            device=str(self.device),
            dtype=str(dtype).removeprefix("torch."),
            vocab_size=encoder_config.vocab_size,
            kv_cache_bytes=0,
            attention_backend="native"
            if self.model.native_attention(dtype, self.device)
            else "sdpa",
            pid=os.getpid(),
            kernels=kernels,
        )
        self._stats = SchedulerStats()
        # NOTE: the tokens of the last step, which the core process's watchdog reports.
        self.last_step_tokens = 0

    def add_request(self, req: AddRequest) -> list[SampleFinish]:
        request_id = req.request_id
        reason = None
        params = req.pooling
        prompt = unpack_token_ids(req.prompt_token_ids)
        lens = params.prompt_lens if params is not None and params.prompt_lens else [len(prompt)]
        if params is None or params.task != PoolingTask.EMBED:
            reason = "an encoder-only model only embeds (--task embed, LLM.embed)"
        elif request_id in self.jobs:
            reason = f"request id {request_id!r} is already running"
        elif sum(lens) != len(prompt) or not prompt:
            reason = "the prompt is empty" if not prompt else "prompt_lens do not add up"
        elif max(prompt) >= self.vocab_size or min(prompt) < 0:
            reason = f"prompt token ids must lie in [0, {self.vocab_size})"
        elif max(lens) > self.max_model_len:
            reason = too_long_prompt(max(lens), self.max_model_len)
        elif params.dimensions is not None and params.dimensions > self.hidden_size:
            reason = (
                f"dimensions {params.dimensions} exceeds the model's embedding size "
                f"{self.hidden_size}"
            )
        if reason is not None:
            return [SampleFinish(request_id, FinishReason.ERROR, error=reason)]
        assert params is not None
        starts = [sum(lens[:i]) for i in range(len(lens))]
        prompts = [prompt[start : start + n] for start, n in zip(starts, lens, strict=True)]
        self.jobs[request_id] = PoolingJob(request_id, prompts, params)
        return []

    def abort(self, request_ids: list[str], indices: list[int] | None = None) -> list[SampleFinish]:
        aborted = [rid for rid in dict.fromkeys(request_ids) if self.jobs.pop(rid, None)]
        return [SampleFinish(rid, FinishReason.ABORT) for rid in aborted]

    def has_unfinished(self) -> bool:
        return bool(self.jobs)

    def step(self) -> EngineOutputs:
        start = time.perf_counter()
        jobs = self._pick()
        self.last_step_tokens = sum(job.num_tokens for job in jobs)
        if not jobs:
            return EngineOutputs()
        try:
            pooled = self._run(jobs)
        except Exception as e:
            message = f"the engine failed a step: {type(e).__name__}: {e}"
            finished = [SampleFinish(j.request_id, FinishReason.ERROR, error=message) for j in jobs]
            return EngineOutputs(finished=finished)
        stats = self._stats
        stats.num_steps += 1
        num_tokens = sum(job.num_tokens for job in jobs)
        stats.num_prompt_tokens += num_tokens
        stats.num_scheduled_tokens += num_tokens
        elapsed = time.perf_counter() - start
        stats.step_time_s += elapsed
        stats.forward_time_s += elapsed
        finished = [SampleFinish(job.request_id, FinishReason.STOP) for job in jobs]
        return EngineOutputs(pooled=pooled, finished=finished)

    def _pick(self) -> list[PoolingJob]:
        picked: list[PoolingJob] = []
        num_tokens = num_seqs = 0
        for job in self.jobs.values():
            if picked and (
                num_tokens + job.num_tokens > self.config.max_num_batched_tokens
                or num_seqs + len(job.prompts) > self.config.max_num_seqs
            ):
                break
            picked.append(job)
            num_tokens += job.num_tokens
            num_seqs += len(job.prompts)
        for job in picked:
            del self.jobs[job.request_id]
        return picked

    def _run(self, jobs: list[PoolingJob]) -> list[PooledOutput]:
        prompts = [prompt for job in jobs for prompt in job.prompts]
        lens = [len(prompt) for prompt in prompts]
        input_ids = torch.tensor([t for prompt in prompts for t in prompt], device=self.device)
        with torch.inference_mode():
            hidden = self.model(input_ids, lens)
            rows = iter(hidden.split(lens))
            outputs = []
            for job in jobs:
                vectors = torch.stack([pool(next(rows), self.pooling.mode) for _ in job.prompts])
                params = job.params
                normalize = self.pooling.normalize if params.normalize is None else params.normalize
                data = finish_embedding(vectors, params.dimensions, normalize)
                outputs.append(PooledOutput(job.request_id, float32_bytes(data)))
        return outputs

    def stats(self) -> SchedulerStats:
        return msgspec.structs.replace(self._stats, num_waiting=len(self.jobs))

    def shutdown(self) -> None:
        self.jobs.clear()
