"""vLLM's prompt dict types (`vllm.inputs`), as the API reads them (client/prompts.py)."""

from __future__ import annotations

from typing import TypedDict


class TextPrompt(TypedDict):
    """A prompt given as text, tokenized by the model's tokenizer."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt given as token ids, used as they are."""

    prompt_token_ids: list[int]


PromptType = str | TextPrompt | TokensPrompt
