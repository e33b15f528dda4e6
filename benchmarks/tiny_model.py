"""A tiny random-weight Llama directory sharing SmolLM2's tokenizer, for tests and benchmarks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)


def write_tiny_llama(
    out_dir: Path, tokenizer_dir: Path, max_position_embeddings: int = 512
) -> Path:
    """Save a seeded 2-layer, 64-wide, tied Llama (vocab 49152) plus the tokenizer files."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    generation = json.loads((tokenizer_dir / "generation_config.json").read_text())
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=generation["bos_token_id"],
        eos_token_id=generation["eos_token_id"],
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(out_dir, safe_serialization=True)
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2))
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir
