"""The prompt forms `LLM.generate`, `LLM.stream` and `LLM.chat` take, turned into `Request`s; an
input the API cannot use raises, naming what was passed and what is accepted."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from vbatch.client.outputs import Request
from vbatch.errors import PromptTypeError, PromptValueError
from vbatch.sampling_params import SamplingParams

ACCEPTED = (
    "a prompt string, {'prompt': str}, {'prompt_token_ids': [int, ...]}, a conversation (a list "
    "of {'role', 'content'} messages) or a vbatch.llm.Request"
)
# NOTE: vLLM's use_tqdm: a bool, or a callable that makes the progress bar from tqdm's arguments.
UseTqdm = bool | Callable[..., Any]
_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"})


def _describe(item: Any) -> str:
    text = repr(item)
    return f"{type(item).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"


def is_message(item: Any) -> bool:
    return isinstance(item, Mapping) and "role" in item


def is_conversation(item: Any) -> bool:
    return isinstance(item, list) and bool(item) and all(is_message(m) for m in item)


def _from_dict(item: Mapping[str, Any]) -> Request:
    if is_message(item):
        raise PromptValueError(
            f"got one chat message, {_describe(item)}; pass conversations (lists of messages) "
            "to LLM.chat"
        )
    keys = set(item)
    unknown = sorted(str(k) for k in keys - _PROMPT_KEYS)
    if unknown or not keys & {"prompt", "prompt_token_ids"}:
        raise PromptValueError(
            f"a prompt dict takes 'prompt' (str) or 'prompt_token_ids' (list of int), and "
            f"optionally 'cache_salt' (str); got keys "
            f"{sorted(map(str, keys))}"
            + (
                " (multi-modal inputs are not supported: vbatch runs text models)"
                if "multi_modal_data" in keys
                else ""
            )
        )
    prompt = item.get("prompt")
    ids = item.get("prompt_token_ids")
    if prompt is not None and not isinstance(prompt, str):
        raise PromptTypeError(f"'prompt' must be a string, got {_describe(prompt)}")
    if ids is not None:
        if not isinstance(ids, Sequence) or isinstance(ids, str) or not ids:
            raise PromptTypeError(
                f"'prompt_token_ids' must be a non-empty list of int, got {_describe(ids)}"
            )
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise PromptTypeError(f"'prompt_token_ids' must hold ints, got {_describe(ids)}")
        ids = list(ids)
    salt = item.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise PromptTypeError(f"'cache_salt' must be a non-empty string, got {_describe(salt)}")
    return Request(prompt=prompt, prompt_token_ids=ids, cache_salt=salt)


def to_request(item: Any) -> Request:
    """One input of `generate`/`stream` as a Request; raises PromptTypeError/PromptValueError."""
    if isinstance(item, Request):
        return item
    if isinstance(item, str):
        return Request(prompt=item)
    if isinstance(item, Mapping):
        return _from_dict(item)
    if is_conversation(item):
        return Request(messages=item)
    if isinstance(item, list) and item and all(isinstance(t, int) for t in item):
        raise PromptTypeError(
            f"got a list of ints, {_describe(item)}; pass token ids as "
            "{'prompt_token_ids': [...]}"
        )
    raise PromptTypeError(f"each prompt must be {ACCEPTED}; got {_describe(item)}")


def generate_inputs(prompts: Any) -> list[Any]:
    """The items of `generate`'s first argument: one prompt or a list of them."""
    if isinstance(prompts, (str, Mapping, Request)):
        return [prompts]
    if is_conversation(prompts):
        raise PromptValueError(
            "generate got one conversation (a list of {'role', 'content'} messages); use "
            "LLM.chat(messages) for it, or pass generate a list of conversations"
        )
    if not isinstance(prompts, Iterable) or isinstance(prompts, bytes):
        raise PromptTypeError(
            f"prompts must be {ACCEPTED}, or a list of them; got {_describe(prompts)}"
        )
    return list(prompts)


def chat_conversations(messages: Any) -> list[Any]:
    """`chat`'s first argument, one conversation or a list of them, as a list of them. A list
    holding a list is a list of conversations, any other non-empty list one conversation; each
    is checked on its own later, so a malformed one is an error output in its place."""
    if isinstance(messages, list) and messages:
        if any(isinstance(item, list) for item in messages):
            return messages
        return [messages]
    raise PromptTypeError(
        "chat takes one conversation (a list of {'role', 'content'} messages) or a list of "
        f"them; got {_describe(messages)}"
    )


def per_prompt_params(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    num_prompts: int,
    default: SamplingParams,
) -> list[SamplingParams]:
    """One SamplingParams per prompt: the same for all, or a list of one per prompt."""
    if sampling_params is None:
        return [default] * num_prompts
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    if isinstance(sampling_params, Sequence) and not isinstance(sampling_params, str):
        params = list(sampling_params)
        if len(params) != num_prompts:
            raise PromptValueError(
                f"got {len(params)} SamplingParams for {num_prompts} prompts; pass one, or one "
                "per prompt"
            )
        for p in params:
            check_params_type(p)
        return params
    raise PromptTypeError(
        f"sampling_params must be a SamplingParams or a list of them, got "
        f"{_describe(sampling_params)}"
    )


def check_params_type(params: Any) -> None:
    if not isinstance(params, SamplingParams):
        raise PromptTypeError(f"sampling_params must be a SamplingParams, got {_describe(params)}")


def check_priority(priority: Sequence[int] | None, num_prompts: int) -> None:
    """vLLM's per-prompt `priority`: one int per prompt, all 0, as vbatch (like vLLM's default
    policy) serves requests first come, first served."""
    if priority is None:
        return
    if isinstance(priority, (str, bytes)) or not isinstance(priority, Sequence):
        raise PromptTypeError(f"priority must be a list of ints, got {_describe(priority)}")
    if len(priority) != num_prompts:
        raise PromptValueError(f"got {len(priority)} priorities for {num_prompts} prompts")
    if any(p != 0 for p in priority):
        raise PromptValueError(
            "priority scheduling is not supported: vbatch serves requests first come, first "
            "served (vLLM's default policy), so every priority must be 0"
        )
