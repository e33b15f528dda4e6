"""Tiny random-weight pooling models sharing SmolLM2's tokenizer: a decoder embedding model (a
bare Qwen3Model with sentence-transformers files) and a sequence classifier, for tests and
benchmarks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from benchmarks.tiny_model import TOKENIZER_FILES

TINY_DECODER = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)


def _copy_tokenizer(tokenizer_dir: Path, out_dir: Path) -> None:
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out_dir / name)


def write_sentence_transformers_files(out_dir: Path, mode: str, normalize: bool) -> None:
    """modules.json (Transformer, Pooling, then Normalize when asked) and 1_Pooling's config."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    (out_dir / "modules.json").write_text(json.dumps(modules, indent=2))
    keys = {
        "cls": "pooling_mode_cls_token",
        "lasttoken": "pooling_mode_lasttoken",
        "mean": "pooling_mode_mean_tokens",
        "max": "pooling_mode_max_tokens",
    }
    pooling = {key: name == mode for name, key in keys.items()}
    pooling["word_embedding_dimension"] = TINY_DECODER["hidden_size"]
    (out_dir / "1_Pooling").mkdir(exist_ok=True)
    (out_dir / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))
    (out_dir / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512}))


def write_tiny_embedder(
    out_dir: Path, tokenizer_dir: Path, mode: str = "lasttoken", normalize: bool = True
) -> Any:
    """A seeded bare Qwen3Model with sentence-transformers pooling files; returns the model."""
    import torch
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(0)
    model = Qwen3Model(Qwen3Config(**TINY_DECODER)).float().eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    _copy_tokenizer(tokenizer_dir, out_dir)
    write_sentence_transformers_files(out_dir, mode, normalize)
    return model


def write_tiny_classifier(
    out_dir: Path, tokenizer_dir: Path, num_labels: int = 3, family: str = "llama"
) -> Any:
    """A seeded LlamaForSequenceClassification (or, family "gemma3",
    Gemma3TextForSequenceClassification) with named labels; returns the model."""
    import torch
    from transformers import (
        Gemma3TextConfig,
        Gemma3TextForSequenceClassification,
        LlamaConfig,
        LlamaForSequenceClassification,
    )

    labels = {i: f"label_{i}" for i in range(num_labels)}
    settings = dict(
        num_labels=num_labels,
        id2label=labels,
        label2id={v: k for k, v in labels.items()},
        pad_token_id=0,
    )
    torch.manual_seed(0)
    if family == "gemma3":
        config = Gemma3TextConfig(**TINY_DECODER, sliding_window=6, **settings)
        model = Gemma3TextForSequenceClassification(config).float().eval()
    else:
        config = LlamaConfig(
            **{k: v for k, v in TINY_DECODER.items() if k != "head_dim"}, **settings
        )
        model = LlamaForSequenceClassification(config).float().eval()
    with torch.no_grad():
        model.score.weight.normal_(0.0, 1.0)
    model.save_pretrained(out_dir, safe_serialization=True)
    _copy_tokenizer(tokenizer_dir, out_dir)
    return model
