"""LLM's prefill-only side: `encode`, `embed`, `classify`, `reward`, `score` with vLLM's names and
output shapes, the submission of pooling requests, and prompt logprobs on generation outputs."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from vbatch.client.outputs import Request, RequestOutput, RequestState
from vbatch.client.pooling_outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    PoolingState,
    ScoringOutput,
    ScoringRequestOutput,
    class_probs,
    pooling_output,
    prompt_logprobs_of,
)
from vbatch.client.prompts import UseTqdm, is_conversation, to_request
from vbatch.errors import LoraError, PromptTypeError, PromptValueError
from vbatch.lora.request import LoRARequest
from vbatch.models.config import (
    SentenceBertConfig,
    declared_head,
    read_id2label,
    read_problem_type,
)
from vbatch.pooling_params import PoolingParams, PoolingTask
from vbatch.protocol import AddRequest, pack_token_ids
from vbatch.sampling_params import SamplingParams

if TYPE_CHECKING:
    from vbatch.client.tokenizer import TextTokenizer
    from vbatch.models.loader import ResolvedModel

# NOTE: the wire needs sampling params; a pooling request samples nothing, and its one token
# is what data-parallel placement counts it for besides its prompt.
_PREFILL_ONLY = SamplingParams(max_tokens=1)
PromptInput = str | list[str] | list[Mapping[str, Any]] | Request
# NOTE: one text of LLM.score: a string, or a {"prompt"} or {"prompt_token_ids"} dict.
ScoreInput = str | Mapping[str, Any]
POOLING_ACCEPTED = (
    "a prompt string, a list of them (pooled each on its own), a {'prompt'} or "
    "{'prompt_token_ids'} dict, a conversation (a list of {'role', 'content'} messages) or a "
    "vbatch.llm.Request"
)
CROSS_ENCODER = (
    "score with a classifier (cross-encoder) model is not supported: vbatch scores the cosine of "
    "two embeddings, which would leave this model's classifier head out; score with an "
    "embedding model, or classify the pairs"
)


class PoolingMethods:
    """Mixed into LLM; relies on its tokenizer, client, request ids and `_stream`."""

    tokenizer: TextTokenizer
    model: ResolvedModel
    _sentence_bert: SentenceBertConfig
    _client: Any
    _request_ids: Any
    _stream: Any
    _tokenize: Any
    _collect_all: Any
    _kept_prompt_tokens: Any

    def encode(
        self,
        prompts: PromptInput | Iterable[PromptInput],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: UseTqdm = True,
        pooling_task: str | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[PoolingRequestOutput]:
        """Run every prompt through the model without generating; results in input order.

        A prompt is a string, a list of strings (pooled each on its own), {"prompt": str},
        {"prompt_token_ids": [int]}, a conversation (its chat template applied) or a Request.
        `pooling_params` default to an embedding; `pooling_task` ("embed", "classify", ...) sets
        their task, and `truncate_prompt_tokens` their truncation, as in vLLM. A classify
        request's data are its class probabilities, as LLM.classify's (vLLM's default), or the
        head's logits with `use_activation=False`."""
        _refuse_lora(lora_request)
        items = _prompt_items(prompts)
        per_prompt = _per_prompt(pooling_params, len(items))
        changes = {
            name: value
            for name, value in (
                ("task", pooling_task),
                ("truncate_prompt_tokens", truncate_prompt_tokens),
            )
            if value is not None
        }
        if changes:
            per_prompt = [msgspec.structs.replace(p, **changes) for p in per_prompt]
        requests = [
            _pooling_request(item, params) for item, params in zip(items, per_prompt, strict=True)
        ]
        outs = self._collect_all(requests, use_tqdm)
        for out, params in zip(outs, per_prompt, strict=True):
            activate = params.task == PoolingTask.CLASSIFY and params.use_activation is not False
            if activate and out.outputs.data.size:
                probs = class_probs(out.outputs.data, self._problem_type)
                out.outputs.data = probs.astype(np.float32)
        return outs

    def embed(
        self,
        prompts: PromptInput | Iterable[PromptInput],
        *,
        dimensions: int | None = None,
        normalize: bool | None = None,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: UseTqdm = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """Embeddings; `pooling_params` (vLLM's form) give dimensions and normalize where the
        keywords do not."""
        params = _task_params(
            PoolingTask.EMBED,
            pooling_params,
            dimensions=dimensions,
            normalize=normalize,
            truncate_prompt_tokens=truncate_prompt_tokens,
        )
        return [
            EmbeddingRequestOutput(
                out.request_id,
                EmbeddingOutput(out.outputs.data.tolist()),
                out.prompt_token_ids,
                error=out.error,
            )
            for out in self.encode(prompts, params, use_tqdm=use_tqdm, lora_request=lora_request)
        ]

    def classify(
        self,
        prompts: PromptInput | Iterable[PromptInput],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: UseTqdm = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[ClassificationRequestOutput]:
        """Class probabilities from the classifier head (softmax; a sigmoid for one label or a
        multi-label `problem_type`; the logits for a regression), as vLLM's; the logits again
        for pooling params with `use_activation=False`."""
        params = _task_params(
            PoolingTask.CLASSIFY, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens
        )
        raw = _task_params(PoolingTask.CLASSIFY, params, use_activation=False)
        items = _prompt_items(prompts)
        if any(isinstance(item, list) and not is_conversation(item) for item in items):
            raise PromptTypeError(
                "classify takes one text per prompt; a list of strings is one prompt pooled "
                "string by string (LLM.encode): give the strings as prompts of their own"
            )
        labels = self.id2label()
        results = []
        outs = self.encode(items, raw, use_tqdm=use_tqdm, lora_request=lora_request)
        for i, out in enumerate(outs):
            own = params[i] if isinstance(params, list) else params
            logits = out.outputs.data
            is_active = own.use_activation is not False and logits.size
            probs = class_probs(logits, self._problem_type) if is_active else logits
            label = labels.get(int(np.argmax(probs))) if probs.size else None
            results.append(
                ClassificationRequestOutput(
                    out.request_id,
                    ClassificationOutput(probs.tolist(), logits.tolist(), label),
                    out.prompt_token_ids,
                    error=out.error,
                )
            )
        return results

    def reward(
        self,
        prompts: PromptInput | Iterable[PromptInput],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: UseTqdm = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[PoolingRequestOutput]:
        """A reward model's raw scores (the classifier head's logits)."""
        params = _task_params(
            PoolingTask.CLASSIFY,
            pooling_params,
            truncate_prompt_tokens=truncate_prompt_tokens,
            use_activation=False,
        )
        return self.encode(prompts, params, use_tqdm=use_tqdm, lora_request=lora_request)

    def score(
        self,
        text_1: ScoreInput | Sequence[ScoreInput],
        text_2: ScoreInput | Sequence[ScoreInput],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: UseTqdm = True,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[ScoringRequestOutput]:
        """Cosine similarity of the embeddings of text_1 and text_2 pairwise (one text_1 against
        every text_2), as vLLM scores with an embedding model; each text is a string or a
        {"prompt"} or {"prompt_token_ids"} dict. A classifier (cross-encoder) model gets error
        outputs: its head scores a pair, which this cosine would leave out."""
        _refuse_lora(lora_request)
        firsts = _score_inputs(text_1, "text_1")
        seconds = _score_inputs(text_2, "text_2")
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds):
            raise PromptValueError(
                f"score: {len(firsts)} text_1 against {len(seconds)} text_2; give one text_1, "
                "or one per text_2"
            )
        if declared_head(self.model.local_path) == "score":
            return [
                ScoringRequestOutput(str(i), ScoringOutput(float("nan")), [], error=CROSS_ENCODER)
                for i in range(len(firsts))
            ]
        outs = self.embed(
            [*firsts, *seconds],
            normalize=True,
            truncate_prompt_tokens=truncate_prompt_tokens,
            use_tqdm=use_tqdm,
            pooling_params=pooling_params,
        )
        results = []
        for i, (first, second) in enumerate(zip(outs, outs[len(firsts) :], strict=False)):
            error = first.error or second.error
            value = float("nan")
            if error is None:
                a = np.asarray(first.outputs.embedding, dtype=np.float64)
                value = float(a @ np.asarray(second.outputs.embedding, dtype=np.float64))
            ids = first.prompt_token_ids + second.prompt_token_ids
            results.append(ScoringRequestOutput(str(i), ScoringOutput(value), ids, error=error))
        return results

    @functools.cached_property
    def _problem_type(self) -> str | None:
        return read_problem_type(self.model.hf_dir)

    def id2label(self) -> dict[int, str]:
        """The classifier's label names from config.json (empty without them)."""
        return read_id2label(self.model.hf_dir)

    def _submit_pooling(
        self,
        batch: list[tuple[int, Request]],
        live: dict[str, Any],
        ready: list[tuple[int, Any]],
    ) -> None:
        """Tokenize pooling requests (each string of a list prompt on its own; lowercased first
        where the model's sentence-transformers config says) and send them."""
        pieces: list[Request] = []
        for _, req in batch:
            if isinstance(req.prompt, list):
                pieces.extend(Request(prompt=text) for text in req.prompt)
            else:
                pieces.append(req)
        if self._sentence_bert.do_lower_case:
            pieces = [_lowercased(piece) for piece in pieces]
        tokenized = iter(ids for ids, _ in self._tokenize(pieces))
        adds = []
        for position, req in batch:
            params = req.pooling_params
            assert params is not None
            count = len(req.prompt) if isinstance(req.prompt, list) else 1
            prompts = [next(tokenized) for _ in range(count)]
            problem = next((p for p in prompts if isinstance(p, str)), None)
            if not prompts:
                problem = "the input list is empty"
            elif problem is None and not all(prompts):
                problem = "the prompt is empty"
            elif problem is None and req.lora_request is not None:
                problem = "LoRA adapters run with generation only, not with pooling tasks"
            if problem is not None:
                ready.append((position, pooling_output(req, position, [], params.task, problem)))
                continue
            is_text = req.prompt is not None and req.prompt_token_ids is None
            try:
                keep = self._kept_prompt_tokens(params.truncate_prompt_tokens)
                limit = self._sentence_bert.max_seq_length
                cut = params.truncate_prompt_tokens
                if cut == -1 and params.task == PoolingTask.EMBED and limit and keep:
                    # NOTE: as vLLM, whose model length for an embedder is its max_seq_length.
                    keep = min(keep, limit)
                token_lists = [
                    self.tokenizer.keep_last_tokens(list(p), keep, is_text) if keep else list(p)
                    for p in prompts
                ]
            except ValueError as e:
                ready.append((position, pooling_output(req, position, [], params.task, str(e))))
                continue
            prompt_lens = [len(p) for p in token_lists] if isinstance(req.prompt, list) else None
            prompt_ids = [t for p in token_lists for t in p]
            rid = str(next(self._request_ids))
            live[rid] = PoolingState(req, position, prompt_ids, params, prompt_lens)
            wire = msgspec.structs.replace(params, prompt_lens=prompt_lens)
            adds.append(
                AddRequest(rid, pack_token_ids(prompt_ids), _PREFILL_ONLY, time.time(), wire)
            )
        if adds:
            self._client.add_requests(adds)

    def _with_prompt_logprobs(self, entry: RequestState, out: RequestOutput) -> RequestOutput:
        """`out` with vLLM's prompt_logprobs when its request asked for them."""
        if entry.pooled is not None and out.error is None:
            out.prompt_logprobs = prompt_logprobs_of(
                entry.pooled, entry.prompt_token_ids, self._token_texts
            )
        return out

    def _token_texts(self, token_ids: list[int]) -> dict[int, str]:
        """Each token's text as the sampled tokens' logprobs give it (" capital", not the
        vocabulary's "Ġcapital")."""
        return {t: self.tokenizer.decode([t], skip_special_tokens=False) for t in token_ids}


def _task_params(
    task: PoolingTask, given: PoolingParams | Sequence[PoolingParams] | None, **settings: Any
) -> PoolingParams | list[PoolingParams]:
    """`given` (or default) params for `task`, with each setting that is not None applied; one
    per prompt where `given` is a list."""
    changes = {name: value for name, value in settings.items() if value is not None}
    if isinstance(given, Sequence):
        return [
            msgspec.structs.replace(p, task=task, **changes) for p in _per_prompt(given, len(given))
        ]
    return msgspec.structs.replace(given or PoolingParams(), task=task, **changes)


def _per_prompt(
    given: PoolingParams | Sequence[PoolingParams] | None, num_prompts: int
) -> list[PoolingParams]:
    """The params of each of `num_prompts` prompts: `given` for all, or one each (vLLM's list)."""
    if given is None or isinstance(given, PoolingParams):
        return [given or PoolingParams()] * num_prompts
    if isinstance(given, (str, bytes)) or not isinstance(given, Sequence):
        raise PromptTypeError(
            f"pooling_params must be a PoolingParams or a list of one per prompt, got "
            f"{type(given).__name__}"
        )
    if len(given) != num_prompts:
        raise PromptValueError(
            f"pooling_params is a list of {len(given)}, for {num_prompts} prompts: give one "
            "PoolingParams, or one per prompt"
        )
    for p in given:
        if not isinstance(p, PoolingParams):
            raise PromptTypeError(f"pooling_params must hold PoolingParams, got {type(p).__name__}")
    return list(given)


def _refuse_lora(lora_request: LoRARequest | Sequence[LoRARequest | None] | None) -> None:
    """vLLM's pooling calls take lora_request; vbatch runs adapters with generation only."""
    given = lora_request if isinstance(lora_request, Sequence) else [lora_request]
    if any(r is not None for r in given):
        raise LoraError("LoRA adapters run with generation only, not with pooling tasks")


def _prompt_items(prompts: Any) -> list[Any]:
    """The items of a pooling call's prompts: one prompt or an iterable of them."""
    if isinstance(prompts, (str, Request, Mapping)) or is_conversation(prompts):
        return [prompts]
    if prompts is None or isinstance(prompts, bytes) or not isinstance(prompts, Iterable):
        raise PromptTypeError(
            f"prompts must be {POOLING_ACCEPTED}, or a list of them; got {prompts!r:.80}"
        )
    return list(prompts)


def _score_inputs(texts: Any, name: str) -> list[Any]:
    """score's text_1 or text_2: one text (a string or a prompt dict) or a list of them."""
    items = _prompt_items(texts)
    for item in items:
        if not isinstance(item, (str, Mapping)):
            raise PromptTypeError(
                f"{name} must hold strings or {{'prompt'}} / {{'prompt_token_ids'}} dicts, "
                f"got {type(item).__name__}"
            )
    if not items:
        raise PromptValueError(f"score: {name} is empty")
    return items


def _pooling_request(item: PromptInput | Mapping[str, Any], params: PoolingParams) -> Request:
    if isinstance(item, Mapping):
        item = to_request(item)
    if isinstance(item, Request):
        if item.pooling_params is None:
            item = Request(**{**item.__dict__, "pooling_params": params})
        return item
    if is_conversation(item):
        return Request(messages=item, pooling_params=params)
    if isinstance(item, str) or (
        isinstance(item, list) and all(isinstance(text, str) for text in item)
    ):
        return Request(prompt=item, pooling_params=params)
    if isinstance(item, list):
        raise PromptTypeError(
            "a list inside the prompts must hold strings (pooled each on its own) or be a "
            "conversation's {'role', 'content'} messages"
        )
    raise PromptTypeError(f"each input must be {POOLING_ACCEPTED}, got {type(item).__name__}")


def _lowercased(req: Request) -> Request:
    """`req` with its text lowercased, as sentence-transformers does for a `do_lower_case`
    model: a prompt, or a conversation's message texts (not the template's own tokens)."""
    if isinstance(req.prompt, str):
        return dataclasses.replace(req, prompt=req.prompt.lower())
    if req.messages is not None:
        messages = [_lowercased_message(message) for message in req.messages]
        return dataclasses.replace(req, messages=messages)
    return req


def _lowercased_message(message: Any) -> Any:
    content = message.get("content") if isinstance(message, Mapping) else None
    if isinstance(content, str):
        return {**message, "content": content.lower()}
    if isinstance(content, list):
        parts = [
            {**part, "text": part["text"].lower()}
            if isinstance(part, Mapping) and isinstance(part.get("text"), str)
            else part
            for part in content
        ]
        return {**message, "content": parts}
    return message
