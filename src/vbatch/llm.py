"""LLM: the Python API (generate, chat, stream) over the engine-core subprocess."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import msgspec

from vbatch.client.core_client import EngineCoreClient
from vbatch.client.detokenizer import IncrementalDetokenizer
from vbatch.client.hf_tokenizer import HFTokenizer
from vbatch.client.loras import ClientLoras
from vbatch.client.outputs import (
    CompletionOutput,
    Request,
    RequestOutput,
    RequestState,
    error_output,
)
from vbatch.client.pooling_outputs import PoolingState
from vbatch.client.prompts import (
    UseTqdm,
    chat_conversations,
    check_params_type,
    check_priority,
    generate_inputs,
    per_prompt_params,
    to_request,
)
from vbatch.client.reasoning import check_reasoning_parser, sample_parser
from vbatch.client.tokenizer import CONTENT_FORMATS, TextTokenizer, check_template_kwargs
from vbatch.config import EngineConfig
from vbatch.engine_args import default_sampling_params, map_llm_args
from vbatch.engine_sets.base import EngineReport, EngineState
from vbatch.engine_sets.data_parallel import DataParallelClient
from vbatch.engine_sets.stream import stream_loop
from vbatch.errors import (
    ConfigError,
    InputError,
    LoraError,
    ModelLoadError,
    PromptTypeError,
    PromptValueError,
    SamplingParamsError,
    VbatchError,
)
from vbatch.llm_pooling import PoolingMethods
from vbatch.lora.request import LoRARequest
from vbatch.models.config import read_sentence_bert_config
from vbatch.protocol import (
    AddRequest,
    EngineOutputs,
    FinishReason,
    Ready,
    SchedulerStats,
    pack_token_ids,
)
from vbatch.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "Request", "RequestOutput"]

TOKENIZE_BATCH = 64
BAD_WORDS_CACHE = 64
_MAIN_GUARD_MESSAGE = (
    "vbatch.LLM was created while multiprocessing re-imported your script to start the engine "
    "core (the 'spawn' start method runs the main module again in the child). Put the code that "
    'creates the LLM under `if __name__ == "__main__":` and run it again.'
)


_LLM_PARAMS = frozenset(
    {
        "model",
        "max_in_flight",
        "on_progress",
        "chat_template_kwargs",
        "reasoning_parser",
        "data_parallel_size",
        "prefix_placement",
    }
)


def _with_loras(
    requests: list[Request], lora_request: LoRARequest | Sequence[LoRARequest | None]
) -> list[Request]:
    """`requests`, each carrying its adapter (one for all, or one per request)."""
    if isinstance(lora_request, LoRARequest):
        loras: list[LoRARequest | None] = [lora_request] * len(requests)
    else:
        if isinstance(lora_request, Mapping) or not isinstance(lora_request, Iterable):
            raise PromptTypeError(
                "lora_request must be a LoRARequest or a list of them (None for no adapter), "
                f"got {type(lora_request).__name__}"
            )
        loras = list(lora_request)
        if len(loras) != len(requests):
            raise PromptValueError(
                f"lora_request has {len(loras)} entries for {len(requests)} prompts; give one "
                "per prompt or a single one"
            )
    return [
        dataclasses.replace(request, lora_request=lora)
        for request, lora in zip(requests, loras, strict=True)
    ]


def start_core(model: str | None, **engine_args: Any) -> EngineCoreClient:
    """Spawn one engine core for `model` and return without waiting for it, so it imports
    torch and loads the model while the caller reads its input; pass it to LLM(started_core=)."""
    from vbatch.models.loader import resolve_model

    settings = map_llm_args(engine_args, _LLM_PARAMS)
    resolved = resolve_model(_model_arg(model))
    config = EngineConfig.from_dict({**settings.engine, "model": str(resolved.local_path)})
    return EngineCoreClient(config, wait=False)


def _model_arg(model: Any, name: str = "model") -> str | os.PathLike[str] | None:
    """`model` (or `tokenizer`) as LLM takes it: a path, a hub id or None; ConfigError if not."""
    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise ConfigError(
            f"{name} must be a path, a hub id (org/name) or None, got {type(model).__name__}"
        )
    return model


def _check_main_guard() -> None:
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__mp_main__":
            raise VbatchError(_MAIN_GUARD_MESSAGE)
        frame = frame.f_back


FEED_POLL_S = 0.01


class _LocalStream:
    """`StreamEngine` over this process's core client: inputs tokenized in batches of
    TOKENIZE_BATCH, at most `max_in_flight` requests in the core. An input of None means that
    none is ready yet: the batch goes as it is, and the next fill asks again."""

    def __init__(
        self,
        llm: LLM,
        inputs: Iterable[str | list[dict] | Request | None],
        defaults: SamplingParams,
        live: dict[str, RequestState | PoolingState],
    ) -> None:
        self.llm = llm
        self.source = iter(inputs)
        self.num_taken = 0
        self.defaults = defaults
        self.live = live
        self.ready: list[tuple[int, RequestOutput]] = []
        self.is_exhausted = False
        self.is_feed_waiting = False

    def fill(self) -> bool:
        room = self.llm.max_in_flight - len(self.live)
        self.is_feed_waiting = False
        if not self.is_exhausted and room > 0:
            wanted = min(room, TOKENIZE_BATCH)
            batch = []
            for item in itertools.islice(self.source, wanted):
                if item is None:
                    self.is_feed_waiting = True
                    break
                batch.append((self.num_taken, item))
                self.num_taken += 1
            else:
                self.is_exhausted = len(batch) < wanted
            self.llm._submit(batch, self.defaults, self.live, self.ready)
        return not self.is_exhausted

    def take_finished(self) -> list[tuple[int, RequestOutput]]:
        ready, self.ready = self.ready, []
        return ready

    def is_idle(self) -> bool:
        return not self.live

    def wait_limit(self, is_more: bool) -> float | None:
        if not is_more or len(self.live) >= self.llm.max_in_flight:
            return None
        # NOTE: a feed with nothing ready is asked again after a short wait for outputs, not
        # at once in a loop that would take a whole CPU from the engine.
        return FEED_POLL_S if self.is_feed_waiting else 0.0

    def wait(self, timeout: float | None) -> None:
        self.llm._collect(self.llm._client.get_outputs(timeout=timeout), self.live, self.ready)


class LLM(PoolingMethods):
    """Offline generation over one engine-core subprocess, or `data_parallel_size` of them.

    Invariants: at most `max_in_flight` requests are in the core at once; one stream runs at a
    time (a second concurrent stream raises); request ids sent to the core are unique per LLM,
    so late outputs of aborted requests are recognised and dropped.

    `chat_template_kwargs` are extra chat-template variables for every conversation (a
    `Request`'s own are merged over them); `reasoning_parser` (see `REASONING_PARSERS`) splits
    each output's `<think>` part into `CompletionOutput.reasoning`. With several cores each
    request goes to one of them (by load, and by prompt prefix unless `prefix_placement` is
    False); tokenizing, detokenizing and stop strings stay here, once.

    vLLM's `LLM` arguments are taken too (see docs/python-api.md): those vbatch has by the same
    or another name are mapped, `tensor_parallel_size` > 1 and the like raise ConfigError naming
    the vbatch equivalent, and settings that only matter to vLLM are ignored with one warning.
    """

    # NOTE: a stop signal may raise out of this stream's waits (see EngineSet.waits_briefly).
    waits_briefly = False

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
        started_core: EngineCoreClient | None = None,
        **engine_args: Any,
    ) -> None:
        """`started_core` is a core start_core() began for the same model and engine args; it
        is used (and owned from here on) when its config is the one this LLM builds, else shut
        down."""
        _check_main_guard()
        if isinstance(data_parallel_size, bool) or not isinstance(data_parallel_size, int):
            raise ConfigError(f"data_parallel_size must be an integer, got {data_parallel_size!r}")
        if data_parallel_size < 1:
            raise ConfigError(f"data_parallel_size must be at least 1, got {data_parallel_size}")
        if max_in_flight is not None and (
            isinstance(max_in_flight, bool)
            or not isinstance(max_in_flight, int)
            or max_in_flight < 1
        ):
            raise ConfigError(
                f"max_in_flight must be an integer of at least 1, got {max_in_flight!r}"
            )
        from vbatch.models.loader import resolve_model

        if started_core is not None and not isinstance(started_core, EngineCoreClient):
            what = type(started_core).__name__
            raise ConfigError(f"started_core must be what start_core() returned, got {what}")
        try:
            if on_progress is not None and not callable(on_progress):
                raise ConfigError(f"on_progress must be callable, got {type(on_progress).__name__}")
            settings = map_llm_args(engine_args, _LLM_PARAMS)
            self.chat_template_kwargs = check_template_kwargs(chat_template_kwargs or {})
            self.reasoning_parser = check_reasoning_parser(reasoning_parser)
            _model_arg(settings.tokenizer, "tokenizer")

            if on_progress is not None:
                on_progress("resolving model")
            resolved = resolve_model(_model_arg(model))
            self.model = resolved
            config = EngineConfig.from_dict({**settings.engine, "model": str(resolved.local_path)})
            tokenizer_dir = _tokenizer_dir(settings.tokenizer, model, resolved)
            self.loras = ClientLoras(config.enable_lora, config.max_lora_rank, config.loras)
        except BaseException:
            # NOTE: a core handed over is this LLM's from the start: a failed check stops it.
            if started_core is not None:
                started_core.shutdown(timeout=0.0)
            raise
        self._client: EngineCoreClient | DataParallelClient
        if data_parallel_size > 1:
            if started_core is not None:
                started_core.shutdown(timeout=0.0)
            self._load_client_side(tokenizer_dir, resolved.hf_dir, settings.generation_config)
            self._client = DataParallelClient(
                config, data_parallel_size, on_progress, prefix_aware=prefix_placement
            )
        else:
            if started_core is not None and started_core.config != config:
                started_core.shutdown(timeout=0.0)
                started_core = None
            # NOTE: the core imports torch and loads the model while the tokenizer loads here.
            self._client = started_core or EngineCoreClient(config, wait=False)
            try:
                self._load_client_side(tokenizer_dir, resolved.hf_dir, settings.generation_config)
            except BaseException:
                self._client.shutdown()
                raise
            self._client.wait_ready(on_progress)
        self.engine_info: Ready = self._client.info
        for warning in self.engine_info.kernel_warnings:
            logging.getLogger("vbatch").warning(warning)
        # NOTE: each running sequence holds at least one KV block, so more than
        # num_kv_blocks (summed over the cores) can never run together; twice that keeps the
        # schedulers fed.
        max_num_seqs = config.max_num_seqs * data_parallel_size
        # NOTE: an encoder's engine has no KV blocks (num_kv_blocks 0).
        default = 2 * min(max_num_seqs, self.engine_info.num_kv_blocks or max_num_seqs)
        self.max_in_flight = max_in_flight if max_in_flight is not None else max(1, default)
        self._request_ids = itertools.count()
        self._bad_words_cache: dict[tuple[str, ...], list[list[int]]] = {}
        # NOTE: held by the one stream running; a lock, so that two threads cannot both start
        # one (they would take each other's outputs, and one would wait for ever).
        self._streaming = threading.Lock()
        self._live: dict[str, RequestState | PoolingState] = {}

    def _load_client_side(self, tokenizer_dir: Path, hf_dir: Path, generation_config: str) -> None:
        self.tokenizer = TextTokenizer.from_dir(tokenizer_dir)
        self.default_sampling_params = default_sampling_params(hf_dir, generation_config)
        # NOTE: read here, so that a bad file fails the start-up rather than the first rows.
        self._sentence_bert = read_sentence_bert_config(hf_dir)

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

    def get_default_sampling_params(self) -> SamplingParams:
        """A fresh copy of the defaults `generate` and `chat` use when given no params: the
        model's generation_config.json values (as vLLM), else SamplingParams()'s."""
        return self.default_sampling_params.clone()

    def beam_search(self, *args: Any, **kwargs: Any) -> NoReturn:
        """vLLM's beam search, which vbatch does not have: raises, naming what it has."""
        raise NotImplementedError(
            "vbatch has no beam search: sample several with SamplingParams(n=..., seed=...) and "
            "keep the best by cumulative_logprob (logprobs=0), or decode greedily "
            "(temperature=0)"
        )

    @property
    def llm_engine(self) -> NoReturn:
        """vLLM's engine object, which vbatch does not expose: raises, naming what it has."""
        raise AttributeError(
            "vbatch has no llm_engine: its engine runs in a subprocess; use get_tokenizer(), "
            "get_default_sampling_params() and get_stats() on the LLM itself"
        )

    def get_tokenizer(self) -> HFTokenizer:
        """The model's tokenizer, with transformers' `encode`/`decode`/`apply_chat_template`."""
        return HFTokenizer(self.tokenizer)

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: UseTqdm = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; results come back in input order.

        `prompts` is one prompt or a list: strings, {"prompt": str}, {"prompt_token_ids":
        [int]}, conversations (lists of messages; prefer `chat`) or `Request`s.
        `sampling_params` is one SamplingParams for all, or a list with one per prompt (default:
        `get_default_sampling_params()`). Anything else raises TypeError/ValueError (as
        PromptTypeError/PromptValueError) before any prompt runs. `lora_request`
        (LLM(enable_lora=True)) runs every prompt with one adapter, or, a list, each prompt with
        its own (None: the base model). `priority` (vLLM's, one per prompt) must be all 0:
        vbatch schedules first come, first served, as vLLM does by default.
        """
        requests = [to_request(item) for item in generate_inputs(prompts)]
        check_priority(priority, len(requests))
        if lora_request is not None:
            requests = _with_loras(requests, lora_request)
        return self._run(requests, sampling_params, use_tqdm)

    def chat(
        self,
        messages: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: UseTqdm = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them (lists of {"role",
        "content"} messages), rendered with the model's chat template or `chat_template`;
        `RequestOutput.prompt` is the rendered text. `continue_final_message` continues the
        last (assistant) message instead of opening a new turn. `tools` (JSON schemas) go to the
        template as its `tools` variable; the reply is text (no tool-call parsing).
        `lora_request` as in `generate`. `chat_template_content_format` "openai" gives the
        template each message's content as a list of text parts ("auto", "string": as text).
        The arguments are in vLLM's order, and as there `chat_template_kwargs` may set
        `chat_template`, `add_generation_prompt`, `continue_final_message` and `tools`."""
        kwargs = None
        if chat_template_kwargs:
            if not isinstance(chat_template_kwargs, Mapping):
                raise PromptTypeError(
                    "chat_template_kwargs must be a dict of template variables, got "
                    f"{chat_template_kwargs!r:.80}"
                )
            kwargs = dict(chat_template_kwargs)
            chat_template = kwargs.pop("chat_template", chat_template)
            add_generation_prompt = kwargs.pop("add_generation_prompt", add_generation_prompt)
            continue_final_message = kwargs.pop("continue_final_message", continue_final_message)
            tools = kwargs.pop("tools", tools)
            try:
                kwargs = check_template_kwargs(kwargs) if kwargs else None
            except InputError as e:
                raise PromptValueError(str(e)) from None
        if add_generation_prompt and continue_final_message:
            raise PromptValueError(
                "continue_final_message continues the last message, so it needs "
                "add_generation_prompt=False"
            )
        if chat_template_content_format not in CONTENT_FORMATS:
            raise PromptValueError(
                "chat_template_content_format must be one of "
                f"{', '.join(CONTENT_FORMATS)}, got {chat_template_content_format!r:.40}"
            )
        requests = [
            Request(
                messages=conversation,
                chat_template_kwargs=kwargs,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                chat_template_content_format=chat_template_content_format,
            )
            for conversation in chat_conversations(messages)
        ]
        if lora_request is not None:
            requests = _with_loras(requests, lora_request)
        return self._run(requests, sampling_params, use_tqdm)

    def _run(
        self,
        requests: list[Request],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: UseTqdm,
    ) -> list[RequestOutput]:
        params = per_prompt_params(sampling_params, len(requests), self.default_sampling_params)
        checked: dict[int, str | None] = {}
        for k, (req, p) in enumerate(zip(requests, params, strict=True)):
            if req.sampling_params is None:
                requests[k] = req = dataclasses.replace(req, sampling_params=p)
            problem = self._check_params(req.sampling_params, checked)
            if problem is not None:
                raise SamplingParamsError(problem)
        return self._collect_all(requests, use_tqdm, self.default_sampling_params)

    def _collect_all(
        self, requests: list[Request], use_tqdm: UseTqdm, defaults: SamplingParams | None = None
    ) -> list[Any]:
        """Every request's output, in input order, with a progress bar if `use_tqdm` (True:
        tqdm's; a callable: the bar it makes from tqdm's arguments, as vLLM takes)."""
        results: list[Any] = [None] * len(requests)
        stream = self._stream(requests, defaults, None)
        bar = None
        if use_tqdm:
            make_bar = use_tqdm
            if not callable(make_bar):
                from tqdm.auto import tqdm as make_bar
            bar = make_bar(total=len(requests), desc="Processed prompts", dynamic_ncols=True)
        try:
            for position, out in stream:
                results[position] = out
                if bar is not None:
                    bar.update(1)
        finally:
            # NOTE: at once, not when the traceback that holds it goes: an exception from the
            # loop's body left the stream open, and the LLM "already streaming".
            stream.close()
            if bar is not None:
                bar.close()
        return results

    def stream(
        self,
        inputs: Iterable[str | list[dict] | Request | None],
        sampling_params: SamplingParams | None = None,
        *,
        on_output: Callable[[RequestOutput], None] | None = None,
        idle_s: float | None = None,
    ) -> Iterator[RequestOutput | None]:
        """Yield finished requests in completion order, pulling `inputs` lazily. An input of
        None says that no prompt is ready yet (a feed that waits on others): the stream goes on
        with the requests it has and asks again, so their outputs are not held up.

        Closing the generator early aborts everything still in flight. Per-request failures are
        yielded as outputs with `.error` set. `on_output` runs on its own thread. With `idle_s`,
        None is also yielded each time `idle_s` seconds pass without a finished request, so the
        caller can do periodic work (a job commits) while slow requests run or the engine stalls.
        A single prompt (a string, a Request, a dict) is one input, as `generate` takes it.
        """
        if isinstance(inputs, (str, Request, Mapping)):
            inputs = [inputs]
        if isinstance(inputs, (bytes, bytearray)) or not isinstance(inputs, Iterable):
            raise PromptTypeError(
                "stream takes an iterable of prompts (strings, prompt dicts, conversations, "
                f"Requests or None) or one prompt; got {type(inputs).__name__}"
            )
        if on_output is not None and not callable(on_output):
            raise PromptTypeError(f"on_output must be callable, got {type(on_output).__name__}")
        if idle_s is not None and (
            isinstance(idle_s, bool) or not isinstance(idle_s, (int, float)) or not idle_s > 0
        ):
            raise PromptValueError(f"idle_s must be a number of seconds > 0, got {idle_s!r:.40}")
        inner = self._stream(inputs, sampling_params, on_output, idle_s)
        try:
            for _, out in inner:
                yield out
        finally:
            inner.close()

    def _stream(
        self,
        inputs: Iterable[str | list[dict] | Request | None],
        sampling_params: SamplingParams | None,
        on_output: Callable[[RequestOutput], None] | None,
        idle_s: float | None = None,
    ) -> Iterator[tuple[int, RequestOutput | None]]:
        if not self._streaming.acquire(blocking=False):
            raise VbatchError("this LLM is already streaming; finish or close that stream first")
        try:
            defaults = sampling_params or self.default_sampling_params
            check_params_type(defaults)
            defaults.check_vocab(self.engine_info.vocab_size)
            live: dict[str, RequestState | PoolingState] = {}
            self._live = live
            callbacks = _CallbackThread(on_output, self.max_in_flight) if on_output else None
            try:
                stream = _LocalStream(self, inputs, defaults, live)
                for position, out in stream_loop(stream, idle_s):
                    if callbacks is not None and out is not None:
                        callbacks.put(out)
                    yield position, out
                    if callbacks is not None:
                        callbacks.raise_error()
                if callbacks is not None:
                    callbacks.close()
            finally:
                if live:
                    self._client.abort(list(live))
                    live.clear()
                if callbacks is not None:
                    callbacks.close(raise_error=False)
        finally:
            self._streaming.release()

    def _submit(
        self,
        batch: list[tuple[int, Any]],
        defaults: SamplingParams,
        live: dict[str, RequestState | PoolingState],
        ready: list[tuple[int, RequestOutput]],
    ) -> None:
        """Tokenize a batch and send it to the core; requests that cannot run go straight to
        `ready` as error outputs, and an input that is no prompt raises."""
        requests = []
        pooling = []
        # NOTE: each distinct params object is checked once per batch.
        checked: dict[int, str | None] = {id(defaults): None}
        for position, item in batch:
            req = to_request(item)
            if req.pooling_params is not None:
                pooling.append((position, req))
                continue
            problem = self._check_params(req.sampling_params or defaults, checked)
            if problem is None:
                try:
                    lora = self.loras.ref(req.lora_request)
                except LoraError as e:
                    problem = str(e)
            if problem is not None:
                ready.append((position, error_output(req, position, [], problem)))
                continue
            requests.append((position, req, lora))
        adds = []
        decode_token = functools.partial(decode_one, self.tokenizer)
        # NOTE: a prompt that is not truncated must leave room for one output token.
        limits = [
            None
            if (req.sampling_params or defaults).truncate_prompt_tokens is not None
            else self.engine_info.max_model_len - 1
            for _, req, _ in requests
        ]
        tokenized = self._tokenize([req for _, req, _ in requests], limits)
        for (position, req, lora), (prompt_ids, prompt_text) in zip(
            requests, tokenized, strict=True
        ):
            params = req.sampling_params or defaults
            if isinstance(prompt_ids, str):
                ready.append((position, error_output(req, position, [], prompt_ids)))
                continue
            try:
                keep = self._kept_prompt_tokens(params.truncate_prompt_tokens)
                if keep is not None:
                    from_text = isinstance(req.prompt, str) and req.prompt_token_ids is None
                    prompt_ids = self.tokenizer.keep_last_tokens(prompt_ids, keep, from_text)
            except ValueError as e:
                ready.append((position, error_output(req, position, [], str(e))))
                continue
            if params.bad_words:
                # NOTE: on a copy: the caller's params may change, or go to another model.
                params = msgspec.structs.replace(
                    params, bad_words_token_ids=self._bad_words_ids(params.bad_words)
                )
            rid = str(next(self._request_ids))
            live[rid] = RequestState(
                request=req,
                position=position,
                prompt_token_ids=prompt_ids,
                prompt_text=prompt_text,
                detoks=[
                    IncrementalDetokenizer(self.tokenizer, params, prompt_ids)
                    for _ in range(params.n)
                ],
                reasons=[None] * params.n,
                logprobs=[[] if params.logprobs is not None else None for _ in range(params.n)],
                num_core_live=params.n,
                structured=params.structured is not None,
                reasoning_parser=sample_parser(
                    self.reasoning_parser, params.structured is not None
                ),
                decode_token=decode_token,
                eos_token_id=self.tokenizer.eos_token_id,
            )
            adds.append(
                AddRequest(
                    rid,
                    pack_token_ids(prompt_ids),
                    params,
                    time.time(),
                    lora=lora,
                    cache_salt=req.cache_salt,
                )
            )
        if adds:
            self._client.add_requests(adds)
        if pooling:
            self._submit_pooling(pooling, live, ready)

    def _check_params(self, params: Any, checked: dict[int, str | None]) -> str | None:
        """Why `params` cannot be sent to the core, or None; memoized in `checked` by id."""
        key = id(params)
        if key not in checked:
            check_params_type(params)
            try:
                params.check_vocab(self.engine_info.vocab_size)
                checked[key] = None
            except SamplingParamsError as e:
                checked[key] = str(e)
        return checked[key]

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word's token ids, and those of its form after a space where that is as many
        tokens and starts with another one (as vLLM), remembered for the last BAD_WORDS_CACHE
        lists (a job's rows share a few)."""
        key = tuple(words)
        ids = self._bad_words_cache.pop(key, None)
        if ids is None:
            variants = [v for w in words for v in (w.lstrip(), " " + w.lstrip())]
            encoded = self.tokenizer.encode_batch(variants, add_special_tokens=False)
            found: dict[tuple[int, ...], None] = {}
            for bare, spaced in zip(encoded[::2], encoded[1::2], strict=True):
                if not bare:
                    continue
                found[tuple(bare)] = None
                if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
                    found[tuple(spaced)] = None
            ids = [list(word) for word in found]
            if len(self._bad_words_cache) >= BAD_WORDS_CACHE:
                del self._bad_words_cache[next(iter(self._bad_words_cache))]
        self._bad_words_cache[key] = ids
        return ids

    def _kept_prompt_tokens(self, truncate_prompt_tokens: int | None) -> int | None:
        """How many last prompt tokens truncate_prompt_tokens keeps (-1: the model's length); a
        ValueError, as vLLM's, for more than the model's length."""
        max_model_len = self.engine_info.max_model_len
        if truncate_prompt_tokens == -1:
            return max_model_len
        if truncate_prompt_tokens is not None and truncate_prompt_tokens > max_model_len:
            raise ValueError(
                f"truncate_prompt_tokens={truncate_prompt_tokens} is more than the maximum model "
                f"length of {max_model_len}; choose at most that, or -1 for it"
            )
        return truncate_prompt_tokens

    def _tokenize(
        self, requests: list[Request], limits: Sequence[int | None] | None = None
    ) -> list[tuple[list[int] | str, str | None]]:
        """Prompt token ids per request, or an error message, with a chat's rendered text; one
        encode_batch call per kind. A text that surely encodes to more than its request's limit
        (`limits`, None: no limit) is an error without being encoded."""
        results: list[tuple[list[int] | str, str | None]] = [("", None) for _ in requests]
        plain: tuple[list[int], list[str]] = ([], [])
        chats: tuple[list[int], list[str]] = ([], [])
        for k, req in enumerate(requests):
            if req.prompt_token_ids is not None:
                ids = list(req.prompt_token_ids)
                vocab_size = self.engine_info.vocab_size
                # NOTE: the core refuses them too, but the detokenizer and the int32 wire form
                # raised on some first (a negative id, one past 2^31), failing the whole call.
                if ids and (min(ids) < 0 or max(ids) >= vocab_size):
                    results[k] = (f"prompt token ids must lie in [0, {vocab_size})", None)
                else:
                    results[k] = (ids, None)
            elif req.messages is not None:
                try:
                    kwargs = self.chat_template_kwargs
                    if req.chat_template_kwargs is not None:
                        kwargs = {**kwargs, **check_template_kwargs(req.chat_template_kwargs)}
                    if req.tools is not None:
                        kwargs = {**kwargs, "tools": req.tools}
                    chats[1].append(
                        self.tokenizer.apply_chat_template(
                            req.messages,
                            req.add_generation_prompt,
                            kwargs,
                            chat_template=req.chat_template,
                            continue_final_message=req.continue_final_message,
                            content_format=req.chat_template_content_format,
                        )
                    )
                    chats[0].append(k)
                except VbatchError as e:
                    results[k] = (str(e), None)
            elif isinstance(req.prompt, str):
                plain[0].append(k)
                plain[1].append(req.prompt)
            else:
                results[k] = ("a request needs a prompt string, messages or prompt_token_ids", None)
        if limits is not None:
            for ks, texts in (plain, chats):
                problems = [
                    self._surely_too_long(text, limits[k])
                    for k, text in zip(ks, texts, strict=True)
                ]
                for k, problem in zip(ks, problems, strict=True):
                    if problem is not None:
                        results[k] = (problem, None)
                kept = [i for i, problem in enumerate(problems) if problem is None]
                ks[:] = [ks[i] for i in kept]
                texts[:] = [texts[i] for i in kept]
        # NOTE: chat templates carry their own BOS, so rendered chats get no special tokens.
        for (ks, texts), add_special, is_chat in ((plain, True, False), (chats, False, True)):
            if texts:
                encoded = self.tokenizer.encode_batch(texts, add_special_tokens=add_special)
                for k, ids, text in zip(ks, encoded, texts, strict=True):
                    results[k] = (ids, text if is_chat else None)
        return results

    def _surely_too_long(self, text: str, limit: int | None) -> str | None:
        """Why `text` cannot run, where it surely has more than `limit` tokens; else None."""
        fewest = self.tokenizer.fewest_tokens(text)
        if limit is None or fewest <= limit:
            return None
        return (
            f"the prompt has at least {fewest} tokens ({len(text)} characters), which leaves no "
            f"room for output within the maximum model length of {self.engine_info.max_model_len} "
            "tokens"
        )

    def _collect(
        self,
        steps: list[EngineOutputs],
        live: dict[str, RequestState | PoolingState],
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
            for pooled in step.pooled:
                entry = live.get(pooled.request_id)
                if entry is not None:
                    entry.pooled = pooled
            for rid, num_cached in step.num_cached_tokens.items():
                entry = live.get(rid)
                if entry is not None:
                    entry.num_cached_tokens = max(entry.num_cached_tokens, num_cached)
            logprobs = step.logprobs or itertools.repeat(None)
            ended_at = _stop_terminated_positions(step)
            for j, (rid, index, token_id, token_logprobs) in enumerate(
                zip(step.request_ids, step.indices, step.token_ids, logprobs)
            ):
                entry = live.get(rid)
                if entry is not None and entry.add_token(
                    index, token_id, token_logprobs, j in ended_at
                ):
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
                out = entry.to_output()
                if isinstance(entry, RequestState):
                    out = self._with_prompt_logprobs(entry, out)
                ready.append((entry.position, out))
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


def _tokenizer_dir(tokenizer: str | None, model: str | None, resolved: Any) -> Path:
    """The folder of the tokenizer: the model's, or vLLM's `tokenizer=` argument's."""
    if tokenizer is None or tokenizer in (model, str(resolved.local_path)):
        return resolved.hf_dir
    path = Path(tokenizer)
    if not (path / "tokenizer.json").is_file():
        raise ModelLoadError(
            f"tokenizer={tokenizer!r} must be a folder holding a tokenizer.json (or the model's "
            "own path); vbatch reads fast tokenizers from local folders"
        )
    return path


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
        if self._error is None:
            self._queue.put(out)

    def raise_error(self) -> None:
        """Raise what the callback raised, if it has."""
        if self._error is not None:
            raise self._error

    def close(self, raise_error: bool = True) -> None:
        """Wait for the callback to finish; raise what it raised, or with `raise_error` False
        (a stream closed early, by its consumer or an error of its own) log it."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        if self._error is None:
            return
        if raise_error:
            raise self._error
        logging.getLogger("vbatch").warning(
            "on_output raised %r; the stream ended without raising it", self._error
        )

    def _run(self) -> None:
        while (out := self._queue.get()) is not None:
            if self._error is None:
                try:
                    self._fn(out)
                except BaseException as e:
                    self._error = e


def decode_one(tokenizer: Any, token_id: int) -> str:
    """One token's text, special tokens kept. An output's logprobs decode through it, holding the
    tokenizer alone: a kept result must not keep its LLM (and engine core) alive."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _stop_terminated_positions(step: EngineOutputs) -> set[int]:
    """Where in `step`'s columns a sample took the token the core stopped it on (EOS or a stop
    id): its last token in `step`, since that finish comes with the token."""
    ended = {(f.request_id, f.index) for f in step.finished if f.finish_reason == FinishReason.STOP}
    if not ended:
        return set()
    last_at = {}
    for j, key in enumerate(zip(step.request_ids, step.indices)):
        if key in ended:
            last_at[key] = j
    return set(last_at.values())
