"""ModelConfig: the architecture facts vbatch needs, read from an HF config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vbatch.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder. Invariants: num_attention_heads % num_key_value_heads == 0;
    head_dim is even; rope_scaling is None or has a rope_type in SUPPORTED_ROPE_TYPES.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        config_path = path / "config.json"
        try:
            raw = json.loads(config_path.read_text())
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read model config {config_path}: {e}") from e
        generation: dict[str, Any] = {}
        generation_path = path / "generation_config.json"
        if generation_path.is_file():
            try:
                generation = json.loads(generation_path.read_text())
            except ValueError as e:
                raise ModelLoadError(f"cannot parse {generation_path}: {e}") from e
        try:
            return cls.from_dict(raw, generation)
        except ModelLoadError as e:
            raise ModelLoadError(f"model config {config_path}: {e}") from e
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"model config {config_path} is invalid: {e!r}") from e

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], generation: dict[str, Any] | None = None
    ) -> ModelConfig:
        architectures = raw.get("architectures") or []
        architecture = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if architecture is None:
            raise ModelLoadError(
                f"unsupported architecture {architectures or raw.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = int(raw["num_attention_heads"])
        hidden_size = int(raw["hidden_size"])
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        head_dim = int(raw.get("head_dim") or hidden_size // num_heads)
        if num_heads % num_kv_heads or head_dim % 2:
            raise ModelLoadError(
                f"bad attention shape: {num_heads} heads, {num_kv_heads} kv heads, "
                f"head_dim {head_dim}"
            )
        rope_theta, rope_scaling = _rope_settings(raw)
        return cls(
            architecture=architecture,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=architecture == "Qwen2ForCausalLM"
            or bool(raw.get("attention_bias", False)),
            bos_token_id=raw.get("bos_token_id", (generation or {}).get("bos_token_id")),
            eos_token_ids=_eos_token_ids(raw, generation or {}),
        )


def _rope_settings(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    # NOTE: transformers 5 writes `rope_parameters`; older configs use rope_theta + rope_scaling.
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope_theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"unsupported rope scaling {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return rope_theta, None
    params["rope_type"] = rope_type
    params.pop("type", None)
    return rope_theta, params


def _eos_token_ids(raw: dict[str, Any], generation: dict[str, Any]) -> tuple[int, ...]:
    eos_ids: list[int] = []
    for value in (generation.get("eos_token_id"), raw.get("eos_token_id")):
        for token_id in value if isinstance(value, list) else [value]:
            if token_id is not None and int(token_id) not in eos_ids:
                eos_ids.append(int(token_id))
    return tuple(eos_ids)
