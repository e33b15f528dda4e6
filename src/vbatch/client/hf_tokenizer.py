"""HFTokenizer: what `LLM.get_tokenizer()` returns, the model's tokenizer with the
transformers-style calls vLLM scripts make (`tokenizer(text)`, `encode`, `decode`,
`batch_decode`, `apply_chat_template`, the special tokens)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vbatch.client.tokenizer import SPECIAL_TOKEN_NAMES, TextTokenizer
from vbatch.errors import InputError, PromptValueError

# NOTE: transformers' apply_chat_template options for tensors, padding and truncation.
_TENSOR_OPTIONS = (
    "return_tensors",
    "padding",
    "truncation",
    "max_length",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
)


class HFTokenizer:
    """A transformers-like face on a `TextTokenizer` (torch-free); `backend` is the
    `tokenizers.Tokenizer` itself for anything else. Each special token (`bos_token`, ...) and
    its id (`bos_token_id`, ...) is an attribute, None where the model has none."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.text_tokenizer = tokenizer
        self.backend = tokenizer.backend
        self.vocab_size = tokenizer.vocab_size
        self.chat_template = tokenizer.chat_template
        for name in SPECIAL_TOKEN_NAMES:
            text = tokenizer.special_tokens.get(name)
            setattr(self, name, text)
            setattr(self, f"{name}_id", None if text is None else self.backend.token_to_id(text))

    def __len__(self) -> int:
        return self.vocab_size

    def __call__(
        self, text: str | Sequence[str], add_special_tokens: bool = True
    ) -> dict[str, Any]:
        """As transformers without tensors: {"input_ids", "attention_mask"}, lists of ids for a
        string, lists of such lists for a list of strings (unpadded)."""
        texts = [text] if isinstance(text, str) else list(text)
        ids = self.text_tokenizer.encode_batch(texts, add_special_tokens)
        masks = [[1] * len(row) for row in ids]
        if isinstance(text, str):
            return {"input_ids": ids[0], "attention_mask": masks[0]}
        return {"input_ids": ids, "attention_mask": masks}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.text_tokenizer.encode_batch([text], add_special_tokens)[0]

    def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        """As transformers: a list of ids, or one id."""
        ids = [token_ids] if isinstance(token_ids, int) else token_ids
        return self.text_tokenizer.decode(ids, skip_special_tokens)

    def batch_decode(
        self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = False
    ) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def convert_ids_to_tokens(
        self, token_ids: int | Sequence[int]
    ) -> str | list[str | None] | None:
        """As transformers: one id gives its token, a list of ids a list."""
        if isinstance(token_ids, int):
            return self.text_tokenizer.convert_ids_to_tokens([token_ids])[0]
        return self.text_tokenizer.convert_ids_to_tokens(token_ids)

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]] | list[list[dict[str, Any]]],
        *,
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        return_dict: bool = False,
        **kwargs: Any,
    ) -> Any:
        """As transformers: the rendered text, or with `tokenize` (the default) its token ids,
        as {"input_ids", "attention_mask"} with `return_dict`; a list of conversations gives a
        list (a dict of lists). Other keyword arguments are template variables, but for
        transformers' tensor and padding options, which are refused (lists, unpadded, here)."""
        options = {name: kwargs.pop(name) for name in _TENSOR_OPTIONS if name in kwargs}
        unsupported = [name for name, value in options.items() if value not in (None, False)]
        if unsupported:
            raise PromptValueError(
                f"apply_chat_template here returns lists, unpadded and untruncated; "
                f"{', '.join(unsupported)} is not supported"
            )
        if add_generation_prompt and continue_final_message:
            raise PromptValueError(
                "continue_final_message and add_generation_prompt are not compatible: the first "
                "continues the last message, the second opens a new assistant turn"
            )
        is_batch = bool(conversation) and isinstance(conversation[0], (list, tuple))
        conversations = conversation if is_batch else [conversation]
        try:
            texts = [
                self.text_tokenizer.apply_chat_template(
                    list(messages),
                    add_generation_prompt,
                    kwargs,
                    chat_template=chat_template,
                    continue_final_message=continue_final_message,
                )
                for messages in conversations
            ]
        except InputError as e:
            raise PromptValueError(str(e)) from None
        if not tokenize:
            return texts if is_batch else texts[0]
        ids = self.text_tokenizer.encode_batch(texts, add_special_tokens=False)
        if return_dict:
            masks = [[1] * len(row) for row in ids]
            if is_batch:
                return {"input_ids": ids, "attention_mask": masks}
            return {"input_ids": ids[0], "attention_mask": masks[0]}
        return ids if is_batch else ids[0]
