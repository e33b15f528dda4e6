"""transformers' config-class defaults of every config.json key vbatch reads, per architecture.

transformers 4.x saved a config without the keys equal to its class defaults (Gemma's
`tie_word_embeddings: true`, Phi-3's `rms_norm_eps: 1e-5`, ...), and reads a missing key as
that default; so does vbatch, from these tables (tests/test_hf_defaults.py checks them against
the installed transformers).
"""

from __future__ import annotations

from typing import Any

_LLAMA_SHAPE = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
}
_QWEN_SHAPE = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
}
_GEMMA_SHAPE = {
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
}
# NOTE: what every class shares unless its table says otherwise; num_key_value_heads and
# head_dim default to None (all heads; hidden_size // num_attention_heads).
_COMMON = {
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
    "rope_theta": 10000.0,
    "sliding_window": None,
    "bos_token_id": None,
    "eos_token_id": None,
}
_QWEN_WINDOWS = {"sliding_window": 4096, "use_sliding_window": False, "max_window_layers": 28}
_GEMMA = {
    **_GEMMA_SHAPE,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "bos_token_id": 2,
    "eos_token_id": 1,
}

CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {
        **_LLAMA_SHAPE,
        "max_position_embeddings": 2048,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "MistralForCausalLM": {
        **_LLAMA_SHAPE,
        "intermediate_size": 14336,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "sliding_window": 4096,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "Qwen2ForCausalLM": {**_QWEN_SHAPE, "max_position_embeddings": 32768, **_QWEN_WINDOWS},
    "Qwen3ForCausalLM": {
        **_QWEN_SHAPE,
        "head_dim": 128,
        "max_position_embeddings": 32768,
        **_QWEN_WINDOWS,
    },
    "Gemma2ForCausalLM": {
        **_GEMMA,
        "vocab_size": 256000,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    },
    "Gemma3ForCausalLM": {
        **_GEMMA,
        "vocab_size": 262208,
        "max_position_embeddings": 131072,
        "rope_theta": 1e6,
        "rope_local_base_freq": 10000.0,
        "sliding_window_pattern": 6,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
    },
    "Phi3ForCausalLM": {
        "vocab_size": 32064,
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "original_max_position_embeddings": 4096,
        "partial_rotary_factor": 1.0,
        "bos_token_id": 1,
        "eos_token_id": 32000,
    },
    "MixtralForCausalLM": {
        **_LLAMA_SHAPE,
        "intermediate_size": 14336,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "rope_theta": 1e6,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "Qwen3MoeForCausalLM": {
        **_QWEN_SHAPE,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 24,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
        **_QWEN_WINDOWS,
        # NOTE: transformers 4 wrote `num_experts`, 5 writes `num_local_experts`.
        "num_local_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
}


def with_defaults(architecture: str, raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` with every key it leaves out that `architecture`'s config class defaults."""
    return {**_COMMON, **CONFIG_DEFAULTS[architecture], **raw}
