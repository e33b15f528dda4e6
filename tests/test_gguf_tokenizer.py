"""The tokenizer built directly from GGUF metadata, checked against transformers' GGUF tokenizer."""

from __future__ import annotations

from pathlib import Path

from vbatch.client.tokenizer import TextTokenizer
from vbatch.models.gguf_file import read_gguf
from vbatch.models.gguf_tokenizer import builds_directly
from vbatch.models.loader import ResolvedModel

TEXTS = (
    "The capital of France is",
    "  leading spaces\n\n\ttabs and trailing  ",
    "12345 digits 3.14159, don't I'll we've",
    "émoji 🤖 中文 ελληνικά",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "",
)


def test_bundled_tokenizer_matches_transformers(smollm2: ResolvedModel) -> None:
    from transformers import AutoTokenizer

    gguf_path = Path(smollm2.source)
    assert builds_directly(read_gguf(gguf_path).metadata)
    reference = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    converted = AutoTokenizer.from_pretrained(smollm2.hf_dir)
    ours = TextTokenizer.from_dir(smollm2.hf_dir)
    assert converted.get_vocab() == reference.get_vocab()
    assert converted.all_special_tokens == reference.all_special_tokens
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(converted, name) == getattr(reference, name), name
    for text in TEXTS:
        ids = reference(text)["input_ids"]
        assert converted(text)["input_ids"] == ids, text
        assert list(ours.encode_batch([text])[0]) == ids, text
        assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids), text
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, True) == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
