"""A tiny random-weight Llama directory sharing SmolLM2's tokenizer, for tests and benchmarks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

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


# NOTE: every family at the same tiny shape; each config switches on what its family adds
# (small windows, strong soft caps, partial longrope, a dense layer among MoE ones) so that a
# few dozen tokens exercise it.
TINY_SHAPE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def tiny_family_configs() -> dict[str, Any]:
    """Family name → a function building its tiny transformers config."""
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Phi3Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    shape = TINY_SHAPE
    return {
        "llama-bias": lambda: LlamaConfig(**shape, attention_bias=True, mlp_bias=True),
        "qwen3": lambda: Qwen3Config(**shape, head_dim=24, tie_word_embeddings=True),
        "mistral-sliding": lambda: MistralConfig(
            **{**shape, "num_key_value_heads": 1}, sliding_window=5
        ),
        "gemma2": lambda: Gemma2Config(
            **shape,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=6,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=5.0,
        ),
        "gemma3": lambda: Gemma3TextConfig(
            **{**shape, "num_hidden_layers": 3},
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            },
        ),
        "phi3-longrope": lambda: Phi3Config(
            **shape,
            original_max_position_embeddings=64,
            partial_rotary_factor=0.5,
            rope_scaling={
                "type": "longrope",
                "short_factor": [1.0, 1.5, 2.0, 3.0],
                "long_factor": [2.0, 3.0, 4.0, 6.0],
            },
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        ),
        "mixtral": lambda: MixtralConfig(**shape, num_local_experts=4, num_experts_per_tok=2),
        "qwen3-moe": lambda: Qwen3MoeConfig(
            **{**shape, "num_hidden_layers": 3},
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=False,
            mlp_only_layers=[1],
        ),
    }


def build_tiny_family(name: str, seed: int = 0) -> Any:
    """The family's tiny transformers model: build_tiny_model of its tiny config."""
    return build_tiny_model(tiny_family_configs()[name](), seed)


def build_tiny_model(config: Any, seed: int = 0) -> Any:
    """A transformers model of `config` (float32, eager attention, eval) with random weights
    large enough to matter: norm weights near 1 (Gemma's, which add 1, near 0), linear weights
    of unit gain, embeddings of unit scale once the model's own scaling is applied."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model = model.float().eval()
    is_gemma = config.model_type.startswith("gemma")
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                param.copy_((0.0 if is_gemma else 1.0) + 0.1 * torch.randn_like(param))
            elif "embed" in param_name:
                param.normal_(0.0, config.hidden_size**-0.5 if is_gemma else 1.0)
            elif param.dim() >= 2:
                param.normal_(0.0, param.shape[-1] ** -0.5)
            else:
                param.normal_(0.0, 0.1)
    return model


def write_tiny_family(name: str, out_dir: Path, seed: int = 0) -> Any:
    """Save build_tiny_family(name, seed) into out_dir (safetensors); returns the model."""
    model = build_tiny_family(name, seed)
    model.save_pretrained(out_dir, safe_serialization=True)
    return model
