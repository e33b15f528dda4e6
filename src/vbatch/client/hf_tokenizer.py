"""HFTokenizer: what `LLM.get_tokenizer()` returns, the model's tokenizer with the
transformers-style calls vLLM scripts make (`encode`, `decode`, `apply_chat_template`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vbatch.client.tokenizer import TextTokenizer


class HFTokenizer:
    """A transformers-like face on a `TextTokenizer` (torch-free); `backend` is the
    `tokenizers.Tokenizer` itself for anything else."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.text_tokenizer = tokenizer
        self.backend = tokenizer.backend
        self.eos_token_id = tokenizer.eos_token_id
        self.vocab_size = tokenizer.vocab_size
        self.chat_template = tokenizer.chat_template

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.text_tokenizer.encode_batch([text], add_special_tokens)[0]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.text_tokenizer.decode(token_ids, skip_special_tokens)

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str | None]:
        return self.text_tokenizer.convert_ids_to_tokens(token_ids)

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        *,
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        """As transformers: the rendered text, or with `tokenize` (the default) its token ids;
        other keyword arguments are template variables."""
        text = self.text_tokenizer.apply_chat_template(
            conversation,
            add_generation_prompt,
            kwargs,
            chat_template=chat_template,
            continue_final_message=continue_final_message,
        )
        if not tokenize:
            return text
        return self.text_tokenizer.encode_batch([text], add_special_tokens=False)[0]
