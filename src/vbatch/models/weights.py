"""Where each checkpoint tensor goes in the decoder, and what it needs on the way.

Our parameter names are HF's (without the `model.` prefix) except where the decoder fuses:
q/k/v_proj into `qkv_proj` and gate/up_proj into `gate_up_proj` (Phi-3 checkpoints already
are), and each MoE layer's experts into the stacked `mlp.experts.gate_up_proj` and
`mlp.experts.down_proj` of transformers 5 (checkpoints hold one tensor per expert; Mixtral
names them `block_sparse_moe.experts.N.w1/w3/w2`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from vbatch.models.config import ModelConfig

_EXPERT_RE = re.compile(r"^(.*)\.experts\.(\d+)\.(\w+)\.weight$")
# Mixtral's per-expert names → the gated MLP's.
_MIXTRAL_EXPERT_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


@dataclass(frozen=True)
class Target:
    """A checkpoint tensor's place: parameter `name`, its slice `expert` (MoE) if any, from row
    `row_start`, `num_rows` rows of a fused parameter (None: all of it)."""

    name: str
    row_start: int = 0
    expert: int | None = None
    num_rows: int | None = None


def param_target(hf_name: str, config: ModelConfig) -> Target | None:
    """Our parameter and rows for an HF tensor; None for tensors we do not use."""
    if hf_name.endswith("rotary_emb.inv_freq"):
        return None
    if hf_name == "lm_head.weight":
        return None if config.tie_word_embeddings or config.head != "lm" else Target(hf_name)
    if hf_name == "score.weight":
        return Target(hf_name) if config.head == "score" else None
    name = hf_name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")
    expert = _EXPERT_RE.match(name)
    if expert is not None:
        block, index, part = expert.groups()
        part = _MIXTRAL_EXPERT_PARTS.get(part, part)
        if part == "down_proj":
            return Target(f"{block}.experts.down_proj", 0, int(index))
        rows = {"gate_proj": 0, "up_proj": config.moe_intermediate_size}[part]
        return Target(
            f"{block}.experts.gate_up_proj", rows, int(index), config.moe_intermediate_size
        )
    prefix, _, leaf = name.rpartition(".")
    block, _, proj = prefix.rpartition(".")
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    qkv_rows = {
        "q_proj": (0, q_size),
        "k_proj": (q_size, kv_size),
        "v_proj": (q_size + kv_size, kv_size),
    }
    if proj in qkv_rows:
        start, count = qkv_rows[proj]
        return Target(f"{block}.qkv_proj.{leaf}", start, num_rows=count)
    gate_up_rows = {"gate_proj": 0, "up_proj": config.intermediate_size}
    if proj in gate_up_rows:
        return Target(
            f"{block}.gate_up_proj.{leaf}",
            gate_up_rows[proj],
            num_rows=config.intermediate_size,
        )
    return Target(name)


def prepare(target: Target, tensor: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """The tensor as the parameter takes it: Gemma's norms scale by (1 + weight), so the
    offset is added once here, in float32, and the decoder's RMSNorm multiplies as Llama's."""
    if config.norm_weight_offset and target.name.endswith("norm.weight"):
        return tensor.float() + config.norm_weight_offset
    return tensor
