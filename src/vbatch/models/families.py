"""What each supported architecture adds to the Llama decoder, read from its config.json.

One reader per architecture returns the ModelConfig family hooks (see models/config.py) it
sets; everything not returned keeps the Llama default. Each reader follows the transformers
5 model of the same name, including how it reads older hub configs (rope_scaling, rope_theta and
partial_rotary_factor at the top level; no layer_types).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from vbatch.errors import ModelLoadError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
# NOTE: the numbers each scaling reads (layers/rotary.py), checked where the config is read.
ROPE_NUMBERS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
# NOTE: the keys of layers/activation.py's ACTIVATIONS; this module stays torch-free (the
# client resolves models).
SUPPORTED_ACTIVATIONS = ("silu", "swish", "gelu", "gelu_pytorch_tanh")
GEMMA_DEFAULT_QUERY_PRE_ATTN_SCALAR = 256
GEMMA3_DEFAULT_SLIDING_PATTERN = 6

Raw = dict[str, Any]
Hooks = dict[str, Any]


def read_family(architecture: str, raw: Raw, base: dict[str, Any]) -> Hooks:
    """The hooks of `architecture` (one of SUPPORTED_ARCHITECTURES): rope settings, then the
    family's own."""
    # NOTE: as transformers 5: a rope_scaling replaces rope_parameters whole (its theta then
    # comes from the top-level rope_theta).
    params = _rope_dict(raw, "rope_scaling") or _rope_dict(raw, "rope_parameters")
    hooks = _rope_hooks(params, raw, base)
    hooks["hidden_act"] = raw.get("hidden_act") or "silu"
    # NOTE: only transformers' Llama reads mlp_bias; the other families ignore the key.
    hooks["mlp_bias"] = False
    hooks.update(_READERS[architecture](raw, base))
    if hooks["hidden_act"] not in SUPPORTED_ACTIVATIONS:
        raise ModelLoadError(
            f"unsupported activation {hooks['hidden_act']!r}; "
            f"supported: {', '.join(SUPPORTED_ACTIVATIONS)}"
        )
    return hooks


# --- rope ---


def _rope_dict(raw: Raw, key: str) -> dict[str, Any]:
    """config.json's rope parameter object under `key` ({} when absent)."""
    value = raw.get(key) or {}
    if not isinstance(value, dict):
        raise ModelLoadError(f"{key} must be an object, not {value!r}")
    return value


def _rope_hooks(params: dict[str, Any], raw: Raw, base: dict[str, Any]) -> Hooks:
    theta, scaling, rotary_dim = rope_settings(params, raw, base)
    return {"rope_theta": theta, "rope_scaling": scaling, "rotary_dim": rotary_dim}


def rope_settings(
    params: dict[str, Any], raw: Raw, base: dict[str, Any]
) -> tuple[float, dict[str, Any] | None, int]:
    """(rope_theta, rope_scaling or None for plain rope, rotary_dim) from one rope parameter
    dict; a longrope one comes back with its attention_factor and switch-over length filled in.
    """
    # NOTE: transformers 5 writes `rope_parameters`; older configs use rope_theta + rope_scaling.
    params = dict(params)
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    partial = float(params.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    rotary_dim = int(base["head_dim"] * partial)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type == "su":  # the old name of longrope (Phi-3)
        rope_type = "longrope"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"unsupported rope scaling {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None, rotary_dim
    if rope_type == "longrope":
        params = _longrope_params(params, raw, base, rotary_dim)
    for key in ROPE_NUMBERS.get(rope_type, ()):
        params[key] = _rope_number(params.get(key), key, rope_type)
    if rope_type == "llama3" and params["low_freq_factor"] == params["high_freq_factor"]:
        raise ModelLoadError("llama3 rope scaling needs low_freq_factor != high_freq_factor")
    return theta, {"rope_type": rope_type, **params}, rotary_dim


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _rope_number(value: Any, key: str, rope_type: str) -> float:
    """`value`, the positive number `key` of a `rope_type` scaling; ModelLoadError if not."""
    if not _is_number(value) or not value > 0:
        raise ModelLoadError(
            f"{rope_type} rope scaling needs a positive number {key!r} in the model's "
            f"config.json (rope_scaling or rope_parameters), got {value!r:.40}"
        )
    return float(value)


def _longrope_params(
    params: dict[str, Any], raw: Raw, base: dict[str, Any], rotary_dim: int
) -> dict[str, Any]:
    # NOTE: as transformers: Phi-3 keeps the pre-training length at the top level, and that
    # copy wins; `factor` defaults to the ratio of the lengths.
    missing = [
        name
        for name in ("short_factor", "long_factor")
        if not isinstance(params.get(name), list) or not all(map(_is_number, params[name]))
    ]
    if missing:
        raise ModelLoadError(
            f"longrope rope scaling needs lists of numbers {' and '.join(map(repr, missing))} in "
            "the model's config.json"
        )
    key = "original_max_position_embeddings"
    original = int(_rope_number(raw.get(key) or params.get(key), key, "longrope"))
    factor = params.get("factor") or base["max_position_embeddings"] / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0
        if factor > 1.0:
            attention_factor = math.sqrt(1 + math.log(factor) / math.log(original))
    for name in ("short_factor", "long_factor"):
        if len(params[name]) != rotary_dim // 2:
            raise ModelLoadError(
                f"longrope {name} has {len(params[name])} entries, expected {rotary_dim // 2}"
            )
    return {
        "short_factor": [float(x) for x in params["short_factor"]],
        "long_factor": [float(x) for x in params["long_factor"]],
        "original_max_position_embeddings": original,
        "attention_factor": float(attention_factor),
    }


# --- sliding windows ---


def _window(raw: Raw, base: dict[str, Any]) -> int | None:
    """The config's window, None when it has none or it can never bind."""
    window = raw.get("sliding_window")
    if not window or int(window) >= base["max_position_embeddings"]:
        return None
    return int(window)


def _window_on_every_layer(raw: Raw, base: dict[str, Any]) -> tuple[int | None, ...]:
    window = _window(raw, base)
    return () if window is None else (window,) * base["num_hidden_layers"]


def _sliding_layers(
    raw: Raw, base: dict[str, Any], is_sliding: Callable[[int], bool]
) -> tuple[bool, ...]:
    """Which layers `layer_types` (else `is_sliding(layer)`) calls sliding."""
    num_layers = base["num_hidden_layers"]
    types = raw.get("layer_types") or [
        "sliding_attention" if is_sliding(i) else "full_attention" for i in range(num_layers)
    ]
    if len(types) != num_layers:
        raise ModelLoadError(f"layer_types has {len(types)} entries for {num_layers} layers")
    return tuple(t == "sliding_attention" for t in types)


def _window_by_layer_type(
    raw: Raw, base: dict[str, Any], is_sliding: Callable[[int], bool]
) -> tuple[int | None, ...]:
    """The window on the layers that `layer_types` (else `is_sliding(layer)`) calls sliding."""
    window = _window(raw, base)
    if window is None:
        return ()
    return tuple(window if sliding else None for sliding in _sliding_layers(raw, base, is_sliding))


def _qwen_windows(raw: Raw, base: dict[str, Any]) -> tuple[int | None, ...]:
    # NOTE: Qwen2/Qwen3 slide only with use_sliding_window, on layers from max_window_layers on.
    if not raw.get("use_sliding_window", False):
        return ()
    first = int(raw.get("max_window_layers", 28))
    return _window_by_layer_type(raw, base, lambda i: i >= first)


# --- the families ---


def _llama(raw: Raw, base: dict[str, Any]) -> Hooks:
    return {"o_proj_bias": base["attention_bias"], "mlp_bias": base["mlp_bias"]}


def _mistral(raw: Raw, base: dict[str, Any]) -> Hooks:
    return {"attention_bias": False, "sliding_windows": _window_on_every_layer(raw, base)}


def _qwen2(raw: Raw, base: dict[str, Any]) -> Hooks:
    return {"attention_bias": True, "sliding_windows": _qwen_windows(raw, base)}


def _qwen3(raw: Raw, base: dict[str, Any]) -> Hooks:
    return {
        "o_proj_bias": base["attention_bias"],
        "qk_norm": True,
        "sliding_windows": _qwen_windows(raw, base),
    }


def _phi3(raw: Raw, base: dict[str, Any]) -> Hooks:
    # NOTE: Phi-3 checkpoints already hold the fused qkv_proj and gate_up_proj the decoder uses.
    return {"attention_bias": False, "sliding_windows": _window_on_every_layer(raw, base)}


def _gemma_common(raw: Raw, base: dict[str, Any]) -> Hooks:
    hidden_act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    return {
        "o_proj_bias": base["attention_bias"],
        "hidden_act": hidden_act,
        "norm_weight_offset": 1.0,
        "sandwich_norms": True,
        "embedding_multiplier": base["hidden_size"] ** 0.5,
        "query_pre_attn_scalar": float(
            raw.get("query_pre_attn_scalar", GEMMA_DEFAULT_QUERY_PRE_ATTN_SCALAR)
        ),
    }


def _gemma2(raw: Raw, base: dict[str, Any]) -> Hooks:
    return {
        **_gemma_common(raw, base),
        "attn_logit_softcapping": raw.get("attn_logit_softcapping", 50.0),
        "final_logit_softcapping": raw.get("final_logit_softcapping", 30.0),
        # NOTE: even layers slide, odd ones attend globally.
        "sliding_windows": _window_by_layer_type(raw, base, lambda i: (i + 1) % 2 == 1),
    }


def _gemma3(raw: Raw, base: dict[str, Any]) -> Hooks:
    if raw.get("use_bidirectional_attention"):
        raise ModelLoadError("Gemma 3 with bidirectional attention is not a causal LM")
    pattern = int(raw.get("sliding_window_pattern", GEMMA3_DEFAULT_SLIDING_PATTERN))

    def is_sliding(layer: int) -> bool:
        # NOTE: five local layers, then one global (pattern 6), unless layer_types says.
        return (layer + 1) % pattern != 0

    hooks = {
        **_gemma_common(raw, base),
        # NOTE: transformers 5 applies no attention soft cap to Gemma 3, whatever the config says.
        "final_logit_softcapping": raw.get("final_logit_softcapping"),
        "qk_norm": True,
        "sliding_windows": _window_by_layer_type(raw, base, is_sliding),
        # NOTE: local layers rotate with their own base even where their window never binds.
        "sliding_rope_layers": _sliding_layers(raw, base, is_sliding),
    }
    params = _rope_dict(raw, "rope_parameters")
    # NOTE: as transformers: a rope_scaling beside per-type parameters updates the global
    # layers' own, and a theta a type lacks comes from the top level (rope_theta, global;
    # rope_local_base_freq, local), as in older configs, which have only those.
    full = {**(params.get("full_attention") or {}), **_rope_dict(raw, "rope_scaling")}
    local = dict(params.get("sliding_attention") or {})
    full.setdefault("rope_theta", raw.get("rope_theta", 1e6))
    local.setdefault("rope_theta", raw.get("rope_local_base_freq", 10000.0))
    hooks.update(_rope_hooks(full, {}, base))
    hooks["sliding_rope_theta"], hooks["sliding_rope_scaling"], _ = rope_settings(local, {}, base)
    if (hooks["sliding_rope_scaling"] or {}).get("rope_type") == "longrope":
        raise ModelLoadError("longrope scaling on Gemma 3's sliding layers is not supported")
    return hooks


def _moe_hooks(num_experts: int, top_k: int, intermediate: int, renormalise: bool) -> Hooks:
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": intermediate,
        "norm_topk_prob": renormalise,
    }


def _mixtral(raw: Raw, base: dict[str, Any]) -> Hooks:
    num_layers = base["num_hidden_layers"]
    return {
        **_mistral(raw, base),
        # NOTE: Mixtral always renormalises its top-k weights; every layer is sparse.
        **_moe_hooks(
            int(raw["num_local_experts"]),
            int(raw["num_experts_per_tok"]),
            base["intermediate_size"],
            renormalise=True,
        ),
        "moe_layers": (True,) * num_layers,
    }


def _qwen3_moe(raw: Raw, base: dict[str, Any]) -> Hooks:
    num_experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    dense = set(raw.get("mlp_only_layers") or [])
    step = int(raw.get("decoder_sparse_step", 1))
    moe_layers = tuple(
        i not in dense and num_experts > 0 and (i + 1) % step == 0
        for i in range(base["num_hidden_layers"])
    )
    windows = _window_on_every_layer(raw, base) if raw.get("use_sliding_window") else ()
    return {
        **_qwen3(raw, base),
        # NOTE: unlike Qwen3, every layer slides when use_sliding_window is set.
        "sliding_windows": windows,
        **_moe_hooks(
            num_experts,
            int(raw["num_experts_per_tok"]),
            int(raw["moe_intermediate_size"]),
            renormalise=bool(raw.get("norm_topk_prob", False)),
        ),
        "moe_layers": moe_layers,
    }


_READERS: dict[str, Callable[[Raw, dict[str, Any]], Hooks]] = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _mistral,
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
    "Gemma2ForCausalLM": _gemma2,
    "Gemma3ForCausalLM": _gemma3,
    "Phi3ForCausalLM": _phi3,
    "MixtralForCausalLM": _mixtral,
    "Qwen3MoeForCausalLM": _qwen3_moe,
}
SUPPORTED_ARCHITECTURES = tuple(_READERS)
