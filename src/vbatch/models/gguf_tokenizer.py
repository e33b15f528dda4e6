"""The tokenizer files of a converted GGUF: built directly for byte-level BPE vocabularies,
through transformers' GGUF tokenizer for the others."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vbatch.errors import ModelLoadError

CONTROL, USER_DEFINED = 3, 4
# NOTE: the llama.cpp pre-tokenizer names that transformers splits with GPT-2's own byte-level
# regex; any other name has a model-specific split, left to transformers.
BYTE_LEVEL_PRE_TOKENIZERS = frozenset({"default", "gpt-2", "smollm"})
_SPECIAL_TOKEN_KEYS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def write_tokenizer(path: Path, metadata: dict[str, Any], out_dir: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json for the GGUF file at `path` into `out_dir`."""
    try:
        if builds_directly(metadata):
            _write_byte_level(metadata, out_dir)
        else:
            _write_with_transformers(path, out_dir)
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(f"cannot build a tokenizer from GGUF file {path}: {e}") from e


def builds_directly(metadata: dict[str, Any]) -> bool:
    """Whether the file's tokenizer is one `_write_byte_level` reproduces exactly as transformers
    builds it: GPT-2 style byte-level BPE on a llama-architecture file, adding no BOS or EOS."""
    return (
        metadata.get("general.architecture") == "llama"
        and metadata.get("tokenizer.ggml.model") == "gpt2"
        and metadata.get("tokenizer.ggml.pre", "default") in BYTE_LEVEL_PRE_TOKENIZERS
        and "tokenizer.ggml.merges" in metadata
        and not metadata.get("tokenizer.ggml.add_bos_token", False)
        and not metadata.get("tokenizer.ggml.add_eos_token", False)
    )


def byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte: printable Latin-1 bytes stand for themselves, the
    rest take the code points from 256 upwards in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    spelling = {byte: chr(byte) for byte in printable}
    extra = 256
    for byte in range(256):
        if byte not in spelling:
            spelling[byte] = chr(extra)
            extra += 1
    return spelling


def _write_byte_level(metadata: dict[str, Any], out_dir: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type") or [0] * len(tokens)
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode()): index
        for index, token in enumerate(tokens)
    }
    merges = [tuple(merge.split(" ")) for merge in metadata["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1")
    tokenizer.add_special_tokens(
        [
            AddedToken(token, normalized=False, special=True)
            for token, kind in zip(tokens, token_types, strict=True)
            if kind == CONTROL and set(token) <= alphabet
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(token, normalized=False, special=False)
            for token, kind in zip(tokens, token_types, strict=True)
            if kind == USER_DEFINED and token in vocab
        ]
    )
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for name, key in _SPECIAL_TOKEN_KEYS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if token_id is not None:
            config[name] = tokens[token_id]
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    # NOTE: beside the config, as transformers saves it, so a converted GGUF is laid out like a
    # downloaded model directory.
    if "tokenizer.chat_template" in metadata:
        (out_dir / "chat_template.jinja").write_text(metadata["tokenizer.chat_template"])


def _write_with_transformers(path: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.save_pretrained(str(out_dir))
