"""GGUF → Hugging Face directory conversion: config, dequantized safetensors, tokenizer."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from vbatch.errors import ModelLoadError
from vbatch.models.gguf_file import GGUFTensor, dequantize, read_gguf
from vbatch.models.gguf_tokenizer import write_tokenizer

SUPPORTED_GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
# NOTE: a llama-architecture file with a sliding window is a Mistral model.
_SLIDING_LLAMA = ("MistralForCausalLM", "mistral")
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def convert_gguf(path: Path, out_dir: Path) -> None:
    """Write an HF-style model directory for the GGUF file at `path` into `out_dir`."""
    gguf_file = read_gguf(path)
    metadata = gguf_file.metadata
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF file {path} has unsupported architecture {arch!r}; "
            f"supported: {', '.join(sorted(SUPPORTED_GGUF_ARCHITECTURES))}"
        )
    config = _build_config(metadata, arch, gguf_file.tensors, path)
    tensors = _convert_tensors(gguf_file.tensors, config, arch, path)
    config["tie_word_embeddings"] = "lm_head.weight" not in tensors
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    _write_generation_config(config, out_dir)
    write_tokenizer(path, metadata, out_dir)

    from safetensors.numpy import save_file

    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def _build_config(
    metadata: dict[str, Any], arch: str, tensors: list[GGUFTensor], path: Path
) -> dict[str, Any]:
    def get(key: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"GGUF file {path} lacks the metadata key {arch}.{key}")
        return value

    num_heads = int(get("attention.head_count"))
    hidden_size = int(get("embedding_length"))
    vocab_size = metadata.get(f"{arch}.vocab_size")
    if vocab_size is None:
        embed = next((t for t in tensors if t.name == "token_embd.weight"), None)
        if embed is None:
            raise ModelLoadError(f"GGUF file {path} has no token_embd.weight tensor")
        vocab_size = embed.shape[0]
    window = metadata.get(f"{arch}.attention.sliding_window")
    if window is not None and arch != "llama":
        raise ModelLoadError(f"GGUF file {path}: a sliding window on {arch} is not supported")
    architecture, model_type = _SLIDING_LLAMA if window else SUPPORTED_GGUF_ARCHITECTURES[arch]
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": int(vocab_size),
        "hidden_size": hidden_size,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", num_heads)),
        "head_dim": int(get("attention.key_length", hidden_size // num_heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length")),
        "hidden_act": "silu",
        "attention_bias": arch == "qwen2",
        "torch_dtype": "float32",
    }
    if window:
        config["sliding_window"] = int(window)
    # NOTE: as llama.cpp reads a file: no scaling type is linear, by a factor of 1 unless told.
    scaling_type = metadata.get(f"{arch}.rope.scaling.type", "linear")
    if scaling_type not in ("linear", "none"):
        raise ModelLoadError(f"GGUF file {path} uses unsupported rope scaling {scaling_type!r}")
    linear_factor = _linear_rope_factor(metadata, arch, path) if scaling_type == "linear" else 1.0
    rope_freqs = next((t for t in tensors if t.name == "rope_freqs.weight"), None)
    if rope_freqs is not None:
        config["rope_scaling"] = _rope_freqs_scaling(rope_freqs, linear_factor, config, path)
    elif linear_factor != 1.0:
        config["rope_scaling"] = {"rope_type": "linear", "factor": linear_factor}
    for name, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        value = metadata.get(f"tokenizer.ggml.{key}")
        if value is not None:
            config[name] = int(value)
    return config


def _linear_rope_factor(metadata: dict[str, Any], arch: str, path: Path) -> float:
    """The linear rope factor as llama.cpp reads it: `rope.scaling.factor`, else the older
    `rope.scale_linear`; 0 or neither is none (1)."""
    key = f"{arch}.rope.scaling.factor"
    if key not in metadata:
        key = f"{arch}.rope.scale_linear"
    value = metadata.get(key, 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ModelLoadError(f"GGUF file {path}: {key} must be a positive number, got {value!r}")
    return float(value) or 1.0


def _rope_freqs_scaling(
    tensor: GGUFTensor, linear_factor: float, config: dict[str, Any], path: Path
) -> dict[str, Any]:
    """llama.cpp's `rope_freqs` tensor (how its converter writes Llama 3.1's llama3 scaling: a
    divisor of each rotary pair's frequency, at every position) as transformers' longrope with
    those divisors for both factor lists and the pre-training length at the full context, so
    that no length switches lists or scales attention; a linear scaling multiplies them."""
    try:
        factors = dequantize(tensor).astype(np.float64).reshape(-1)
    except Exception as e:
        raise ModelLoadError(f"GGUF file {path}: cannot read tensor {tensor.name}: {e}") from e
    num_pairs = config["head_dim"] // 2
    if factors.size != num_pairs:
        raise ModelLoadError(
            f"GGUF file {path}: rope_freqs.weight must hold {num_pairs} numbers, one per rotary "
            f"pair, got {factors.size}"
        )
    bad = np.flatnonzero(~(np.isfinite(factors) & (factors > 0)))
    if bad.size:
        raise ModelLoadError(
            f"GGUF file {path}: rope_freqs.weight must hold positive numbers, got "
            f"{factors[bad[0]]} for rotary pair {bad[0]}"
        )
    divisors = [float(f) * linear_factor for f in factors]
    return {
        "rope_type": "longrope",
        "short_factor": divisors,
        "long_factor": divisors,
        "original_max_position_embeddings": config["max_position_embeddings"],
        "factor": 1.0,
        "attention_factor": 1.0,
    }


def _convert_tensors(
    gguf_tensors: list[GGUFTensor], config: dict[str, Any], arch: str, path: Path
) -> dict[str, np.ndarray]:
    tensors: dict[str, np.ndarray] = {}
    for tensor in gguf_tensors:
        name = _hf_name(tensor.name)
        if name is None:
            if tensor.name == "rope_freqs.weight":
                continue
            raise ModelLoadError(f"GGUF file {path} has an unknown tensor {tensor.name}")
        try:
            array = dequantize(tensor)
        except Exception as e:
            raise ModelLoadError(f"GGUF file {path}: cannot read tensor {tensor.name}: {e}") from e
        # NOTE: llama.cpp's converter interleaves each Q/K head's rotary halves; Qwen2 keeps HF's.
        if arch == "llama" and tensor.name.endswith("attn_q.weight"):
            array = unpermute_qk(array, config["num_attention_heads"])
        elif arch == "llama" and tensor.name.endswith("attn_k.weight"):
            array = unpermute_qk(array, config["num_key_value_heads"])
        tensors[name] = array
    if "model.embed_tokens.weight" not in tensors:
        raise ModelLoadError(f"GGUF file {path} has no token_embd.weight tensor")
    return tensors


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head rotary permutation of a Q or K projection ([out, in])."""
    out_features = weight.shape[0]
    half_dim = out_features // num_heads // 2
    # [num_heads, half_dim, 2, in] → [num_heads, 2, half_dim, in]
    unpermuted = weight.reshape(num_heads, half_dim, 2, *weight.shape[1:]).swapaxes(1, 2)
    return np.ascontiguousarray(unpermuted.reshape(weight.shape))


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_RE.match(gguf_name)
    if match is None or match.group(2) not in _LAYER_TENSORS:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_TENSORS[part]}.{kind}"


def _write_generation_config(config: dict[str, Any], out_dir: Path) -> None:
    generation = {key: config[key] for key in ("bos_token_id", "eos_token_id") if key in config}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2))
