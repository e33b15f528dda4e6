"""LLM: the Python API (generate, stream) over the engine-core subprocess."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from vbatch.client.core_client import EngineCoreClient
from vbatch.client.detokenizer import IncrementalDetokenizer
from vbatch.client.loras import ClientLoras
from vbatch.client.outputs import (
    CompletionOutput,
    Request,
    RequestOutput,
    RequestState,
    error_output,
)
from vbatch.client.reasoning import check_reasoning_parser
from vbatch.client.tokenizer import TextTokenizer, check_template_kwargs
from vbatch.config import EngineConfig
from vbatch.engine_sets.base import EngineReport, EngineState
from vbatch.engine_sets.data_parallel import DataParallelClient
from vbatch.errors import ConfigError, LoraError, SamplingParamsError, VbatchError
from vbatch.lora.request import LoRARequest
from vbatch.protocol import (
    AddRequest,
    EngineOutputs,
    Ready,
    SchedulerStats,
    pack_token_ids,
)
from vbatch.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "Request", "RequestOutput"]

TOKENIZE_BATCH = 64
_MAIN_GUARD_MESSAGE = (
    "vbatch.LLM was created while multiprocessing re-imported your script to start the engine "
    "core (the 'spawn' start method runs the main module again in the child). Put the code that "
    'creates the LLM under `if __name__ == "__main__":` and run it again.'
)


def _as_request(item: str | list[dict] | Request) -> Request:
    if isinstance(item, Request):
        return item
    if isinstance(item, str):
        return Request(prompt=item)
    if isinstance(item, list):
        return Request(messages=item)
    raise VbatchError(
        f"each input must be a prompt string, a messages list or a vbatch.llm.Request, "
        f"got {type(item).__name__}"
    )


def _with_loras(
    items: list[Any], lora_request: LoRARequest | list[LoRARequest | None]
) -> list[Any]:
    """`items` as Requests carrying their adapter (one for all, or one per item)."""
    if isinstance(lora_request, LoRARequest):
        loras: list[LoRARequest | None] = [lora_request] * len(items)
    else:
        loras = list(lora_request)
        if len(loras) != len(items):
            raise LoraError(
                f"lora_request has {len(loras)} entries for {len(items)} prompts; give one "
                "per prompt or a single one"
            )
    with_loras = []
    for item, lora in zip(items, loras, strict=True):
        try:
            request = _as_request(item)
        except VbatchError:
            with_loras.append(item)
            continue
        with_loras.append(dataclasses.replace(request, lora_request=lora))
    return with_loras


def _check_main_guard() -> None:
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__mp_main__":
            raise VbatchError(_MAIN_GUARD_MESSAGE)
        frame = frame.f_back


class LLM:
    """Offline generation over one engine-core subprocess, or `data_parallel_size` of them.

    Invariants: at most `max_in_flight` requests are in the core at once; one stream runs at a
    time (a second concurrent stream raises); request ids sent to the core are unique per LLM,
    so late outputs of aborted requests are recognised and dropped.

    `chat_template_kwargs` are extra chat-template variables for every conversation (a
    `Request`'s own are merged over them); `reasoning_parser` (see `REASONING_PARSERS`) splits
    each output's `<think>` part into `CompletionOutput.reasoning`. With several cores each
    request goes to one of them (by load, and by prompt prefix unless `prefix_placement` is
    False); tokenizing, detokenizing and stop strings stay here, once.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        max_in_flight: int | None = None,
        on_progress: Callable[[str], None] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        reasoning_parser: str | None = None,
        data_parallel_size: int = 1,
        prefix_placement: bool = True,
        **engine_args: Any,
    ) -> None:
        _check_main_guard()
        if isinstance(data_parallel_size, bool) or not isinstance(data_parallel_size, int):
            raise ConfigError(f"data_parallel_size must be an integer, got {data_parallel_size!r}")
        if data_parallel_size < 1:
            raise ConfigError(f"data_parallel_size must be at least 1, got {data_parallel_size}")
        from vbatch.models.loader import resolve_model

        self.chat_template_kwargs = check_template_kwargs(chat_template_kwargs or {})
        self.reasoning_parser = check_reasoning_parser(reasoning_parser)

        if on_progress is not None:
            on_progress("resolving model")
        resolved = resolve_model(model)
        self.model = resolved
        config = EngineConfig.from_dict({**engine_args, "model": str(resolved.local_path)})
        self.tokenizer = TextTokenizer.from_dir(resolved.hf_dir)
        self.loras = ClientLoras(config.enable_lora, config.max_lora_rank, config.loras)
        self._client: EngineCoreClient | DataParallelClient
        if data_parallel_size > 1:
            self._client = DataParallelClient(
                config, data_parallel_size, on_progress, prefix_aware=prefix_placement
            )
        else:
            self._client = EngineCoreClient(config, on_progress=on_progress)
        self.engine_info: Ready = self._client.info
        # NOTE: each running sequence holds at least one KV block, so more than
        # num_kv_blocks (summed over the cores) can never run together; twice that keeps the
        # schedulers fed.
        max_num_seqs = config.max_num_seqs * data_parallel_size
        default = 2 * min(max_num_seqs, self.engine_info.num_kv_blocks)
        self.max_in_flight = max(1, max_in_flight if max_in_flight is not None else default)
        self._request_ids = itertools.count()
        self._is_streaming = False
        self._live: dict[str, RequestState] = {}

    @property
    def latest_stats(self) -> SchedulerStats | None:
        return self._client.latest_stats

    def get_stats(self) -> SchedulerStats:
        return self._client.get_stats()

    def engine_reports(self) -> list[EngineReport]:
        if isinstance(self._client, DataParallelClient):
            return self._client.engine_reports()
        stats = self._client.latest_stats
        return [EngineReport("core 0", EngineState.LIVE, stats, len(self._live))]

    def generate(
        self,
        prompts: str | Request | Iterable[str | list[dict] | Request],
        sampling_params: SamplingParams | None = None,
        *,
        use_progress: bool = False,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; results come back in input order. `lora_request`
        (LLM(enable_lora=True)) runs every prompt with one adapter, or, a list, each prompt with
        its own (None: the base model)."""
        items = [prompts] if isinstance(prompts, (str, Request)) else list(prompts)
        if lora_request is not None:
            items = _with_loras(items, lora_request)
        results: list[RequestOutput | None] = [None] * len(items)
        stream = self._stream(items, sampling_params, None)
        if not use_progress:
            for position, out in stream:
                results[position] = out
            return results  # type: ignore[return-value]
        from rich.progress import Progress

        with Progress(transient=False) as progress:
            task = progress.add_task("generating", total=len(items))
            for position, out in stream:
                results[position] = out
                progress.advance(task)
        return results  # type: ignore[return-value]

    def stream(
        self,
        inputs: Iterable[str | list[dict] | Request],
        sampling_params: SamplingParams | None = None,
        *,
        on_output: Callable[[RequestOutput], None] | None = None,
        idle_s: float | None = None,
    ) -> Iterator[RequestOutput | None]:
        """Yield finished requests in completion order, pulling `inputs` lazily.

        Closing the generator early aborts everything still in flight. Per-request failures are
        yielded as outputs with `.error` set. `on_output` runs on its own thread. With `idle_s`,
        None is also yielded each time `idle_s` seconds pass without a finished request, so the
        caller can do periodic work (a job commits) while slow requests run or the engine stalls.
        """
        inner = self._stream(inputs, sampling_params, on_output, idle_s)
        try:
            for _, out in inner:
                yield out
        finally:
            inner.close()

    def _stream(
        self,
        inputs: Iterable[str | list[dict] | Request],
        sampling_params: SamplingParams | None,
        on_output: Callable[[RequestOutput], None] | None,
        idle_s: float | None = None,
    ) -> Iterator[tuple[int, RequestOutput | None]]:
        if self._is_streaming:
            raise VbatchError("this LLM is already streaming; finish or close that stream first")
        defaults = sampling_params or SamplingParams()
        if not isinstance(defaults, SamplingParams):
            raise SamplingParamsError(
                f"sampling_params must be a SamplingParams, got {type(defaults).__name__}"
            )
        # NOTE: again here, not only at construction: a field may have been set since.
        defaults.validate(self.engine_info.vocab_size)
        self._is_streaming = True
        source = enumerate(inputs)
        live: dict[str, RequestState] = {}
        self._live = live
        ready: list[tuple[int, RequestOutput]] = []
        callbacks = _CallbackThread(on_output, self.max_in_flight) if on_output else None
        is_exhausted = False
        idle_deadline = None if idle_s is None else time.monotonic() + idle_s
        try:
            while True:
                room = self.max_in_flight - len(live)
                if not is_exhausted and room > 0:
                    batch = list(itertools.islice(source, min(room, TOKENIZE_BATCH)))
                    is_exhausted = len(batch) < min(room, TOKENIZE_BATCH)
                    self._submit(batch, defaults, live, ready)
                for position, out in ready:
                    if callbacks is not None:
                        callbacks.put(out)
                    yield position, out
                if ready and idle_s is not None:
                    idle_deadline = time.monotonic() + idle_s
                ready.clear()
                if not live:
                    if is_exhausted:
                        break
                    continue
                is_filling = not is_exhausted and len(live) < self.max_in_flight
                timeout = 0.0 if is_filling else None
                if idle_s is not None and idle_deadline is not None:
                    if time.monotonic() >= idle_deadline:
                        yield -1, None
                        idle_deadline = time.monotonic() + idle_s
                    left = max(0.0, idle_deadline - time.monotonic())
                    timeout = left if timeout is None else min(timeout, left)
                steps = self._client.get_outputs(timeout=timeout)
                self._collect(steps, live, ready)
            if callbacks is not None:
                callbacks.close()
        finally:
            self._is_streaming = False
            if live:
                self._client.abort(list(live))
            if callbacks is not None:
                callbacks.close(raise_error=False)

    def _submit(
        self,
        batch: list[tuple[int, Any]],
        defaults: SamplingParams,
        live: dict[str, RequestState],
        ready: list[tuple[int, RequestOutput]],
    ) -> None:
        """Tokenize a batch and send it to the core; unusable items go straight to `ready`."""
        requests = []
        # NOTE: each distinct params object is validated once per batch (tens of microseconds).
        checked: dict[int, str | None] = {id(defaults): None}
        for position, item in batch:
            try:
                req = _as_request(item)
            except VbatchError as e:
                ready.append((position, error_output(Request(), position, [], str(e), 1)))
                continue
            problem = self._check_params(req.sampling_params or defaults, checked)
            if problem is None:
                try:
                    lora = self.loras.ref(req.lora_request)
                except LoraError as e:
                    problem = str(e)
            if problem is not None:
                ready.append((position, error_output(req, position, [], problem, 1)))
                continue
            requests.append((position, req, lora))
        adds = []
        tokenized = self._tokenize([req for _, req, _ in requests])
        for (position, req, lora), prompt_ids in zip(requests, tokenized, strict=True):
            params = req.sampling_params or defaults
            if isinstance(prompt_ids, str):
                ready.append((position, error_output(req, position, [], prompt_ids, params.n)))
                continue
            rid = str(next(self._request_ids))
            live[rid] = RequestState(
                request=req,
                position=position,
                prompt_token_ids=prompt_ids,
                detoks=[IncrementalDetokenizer(self.tokenizer, params) for _ in range(params.n)],
                reasons=[None] * params.n,
                logprobs=[[] if params.logprobs is not None else None for _ in range(params.n)],
                num_core_live=params.n,
                structured=params.structured is not None,
                reasoning_parser=self.reasoning_parser,
            )
            adds.append(AddRequest(rid, pack_token_ids(prompt_ids), params, time.time(), lora))
        if adds:
            self._client.add_requests(adds)

    def _check_params(self, params: Any, checked: dict[int, str | None]) -> str | None:
        """Why `params` cannot be sent to the core, or None; memoized in `checked` by id."""
        key = id(params)
        if key not in checked:
            if not isinstance(params, SamplingParams):
                checked[key] = (
                    f"sampling_params must be a SamplingParams, got {type(params).__name__}"
                )
            else:
                try:
                    params.validate(self.engine_info.vocab_size)
                    checked[key] = None
                except SamplingParamsError as e:
                    checked[key] = str(e)
        return checked[key]

    def _tokenize(self, requests: list[Request]) -> list[list[int] | str]:
        """Prompt token ids per request, or an error message; one encode_batch call per kind."""
        results: list[list[int] | str] = ["" for _ in requests]
        plain: tuple[list[int], list[str]] = ([], [])
        chats: tuple[list[int], list[str]] = ([], [])
        for k, req in enumerate(requests):
            if req.prompt_token_ids is not None:
                results[k] = list(req.prompt_token_ids)
            elif req.messages is not None:
                try:
                    kwargs = self.chat_template_kwargs
                    if req.chat_template_kwargs is not None:
                        kwargs = {**kwargs, **check_template_kwargs(req.chat_template_kwargs)}
                    chats[1].append(self.tokenizer.apply_chat_template(req.messages, True, kwargs))
                    chats[0].append(k)
                except VbatchError as e:
                    results[k] = str(e)
            elif isinstance(req.prompt, str):
                plain[0].append(k)
                plain[1].append(req.prompt)
            else:
                results[k] = "a request needs a prompt string, messages or prompt_token_ids"
        # NOTE: chat templates carry their own BOS, so rendered chats get no special tokens.
        for (ks, texts), add_special in ((plain, True), (chats, False)):
            if texts:
                encoded = self.tokenizer.encode_batch(texts, add_special_tokens=add_special)
                for k, ids in zip(ks, encoded, strict=True):
                    results[k] = ids
        return results

    def _collect(
        self,
        steps: list[EngineOutputs],
        live: dict[str, RequestState],
        ready: list[tuple[int, RequestOutput]],
    ) -> None:
        """Apply the core's outputs; finished requests move to `ready`.

        The core is told to stop what the client will not keep: a request done here that the
        core still runs is aborted, and so is each sample that completed a stop string while its
        siblings go on (only that sample).
        """
        aborts = []
        stopped: list[tuple[str, int]] = []
        done: list[str] = []
        for step in steps:
            for rid, num_cached in step.num_cached_tokens.items():
                entry = live.get(rid)
                if entry is not None:
                    entry.num_cached_tokens = max(entry.num_cached_tokens, num_cached)
            logprobs = step.logprobs or itertools.repeat(None)
            for rid, index, token_id, token_logprobs in zip(
                step.request_ids, step.indices, step.token_ids, logprobs
            ):
                entry = live.get(rid)
                if entry is not None and entry.add_token(index, token_id, token_logprobs):
                    done.append(rid)
                    stopped.append((rid, index))
            for finish in step.finished:
                entry = live.get(finish.request_id)
                if entry is not None:
                    entry.finish(finish)
                    done.append(finish.request_id)
            for rid in done:
                entry = live.get(rid)
                if entry is None or not entry.is_done:
                    continue
                del live[rid]
                if entry.num_core_live > 0:
                    aborts.append(rid)
                ready.append((entry.position, entry.to_output()))
            done.clear()
        if aborts:
            self._client.abort(aborts)
        # NOTE: a request that left `live` was aborted whole above, or the core finished it.
        stopped = [(rid, index) for rid, index in stopped if rid in live]
        if stopped:
            self._client.abort([rid for rid, _ in stopped], [index for _, index in stopped])

    def shutdown(self) -> None:
        self._client.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class _CallbackThread:
    """Runs `on_output` off the consuming thread so a slow callback doesn't delay submissions.

    The queue is bounded, so a callback slower than generation eventually applies backpressure
    instead of letting finished outputs pile up in memory.
    """

    def __init__(self, fn: Callable[[RequestOutput], None], max_pending: int) -> None:
        self._fn = fn
        self._queue: queue.Queue[RequestOutput | None] = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="vbatch-on-output", daemon=True)
        self._thread.start()

    def put(self, out: RequestOutput) -> None:
        if self._error is not None:
            raise self._error
        self._queue.put(out)

    def close(self, raise_error: bool = True) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        if raise_error and self._error is not None:
            raise self._error

    def _run(self) -> None:
        while (out := self._queue.get()) is not None:
            if self._error is None:
                try:
                    self._fn(out)
                except BaseException as e:
                    self._error = e
