"""Encoder-only models (BERT, XLM-RoBERTa): their config, a packed bidirectional forward pass
without a KV cache, and weight loading."""

from __future__ import annotations

import json
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from vbatch.errors import ModelLoadError
from vbatch.layers.linear_choice import NATIVE, ChosenLinear
from vbatch.layers.native import has_fused_ops
from vbatch.models.config import (
    ENCODER_ARCHITECTURES,
    architecture_names,
    read_sentence_bert_config,
)
from vbatch.models.loader import weight_files

_PREFIXES = ("bert.", "roberta.", "model.")


@dataclass(frozen=True)
class EncoderConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    position_offset: int  # added to 0-based positions (RoBERTa: padding id + 1)
    max_seq_length: int  # sentence-transformers' limit when given, else the positions

    @classmethod
    def from_hf_dir(cls, path: Path) -> EncoderConfig:
        raw = json.loads((path / "config.json").read_text())
        architecture = next(a for a in architecture_names(raw) if a in ENCODER_ARCHITECTURES)
        if raw.get("hidden_act", "gelu") != "gelu":
            raise ModelLoadError(f"{path}: activation {raw['hidden_act']!r} is not supported")
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise ModelLoadError(f"{path}: only absolute position embeddings are supported")
        is_roberta = "Roberta" in architecture
        offset = int(raw.get("pad_token_id", 1)) + 1 if is_roberta else 0
        max_positions = int(raw["max_position_embeddings"]) - offset
        given = read_sentence_bert_config(path).max_seq_length
        max_seq_length = min(max_positions, given or max_positions)
        return cls(
            architecture=architecture,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=int(raw["num_attention_heads"]),
            max_position_embeddings=int(raw["max_position_embeddings"]),
            type_vocab_size=int(raw.get("type_vocab_size", 2)),
            layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
            position_offset=offset,
            max_seq_length=max_seq_length,
        )


class _Embeddings(nn.Module):
    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class _Layer(nn.Module):
    """HF's module tree (attention.self.query, ..., output.LayerNorm), so names load as is."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.layer_norm_eps
        self.attention = nn.Module()
        self.attention.self = nn.Module()
        for name in ("query", "key", "value"):
            setattr(self.attention.self, name, nn.Linear(h, h))
        self.attention.output = nn.Module()
        self.attention.output.dense = nn.Linear(h, h)
        self.attention.output.LayerNorm = nn.LayerNorm(h, eps=eps)
        self.intermediate = nn.Module()
        self.intermediate.dense = nn.Linear(h, config.intermediate_size)
        self.output = nn.Module()
        self.output.dense = nn.Linear(config.intermediate_size, h)
        self.output.LayerNorm = nn.LayerNorm(h, eps=eps)


class EncoderModel(nn.Module):
    """A packed batch of whole prompts in, the last layer's hidden states out.

    Invariant: parameter names are the checkpoint's without its `bert.`/`roberta.` prefix;
    the linears run over every token of the batch at once, attention per prompt (bidirectional,
    no padding): on CPU in float32 every prompt in one vbatch::encoder_attention call and the
    GELU in place (vbatch::gelu_erf_), else one SDPA call per prompt and F.gelu.
    """

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = _Embeddings(config)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(_Layer(config) for _ in range(config.num_hidden_layers))

    def linear_weights(self) -> dict[str, torch.Tensor]:
        """The [out, in] weights layers/linear_choice.py times, under its decoder roles: a
        projection (query) as "qkv", the attention output as "o", the feed-forward pair as the
        MLP's "gate_up" and "down"."""
        layer = self.encoder.layer[0]
        return {
            "qkv": layer.attention.self.query.weight,
            "o": layer.attention.output.dense.weight,
            "gate_up": layer.intermediate.dense.weight,
            "down": layer.output.dense.weight,
        }

    def use_linear_choice(self, choice: dict[str, Any]) -> None:
        """Run the linears by layers/linear_choice.py's per-row-class choice, measured without
        the decoder MLP's transposed form."""
        qkv, copies = tuple(choice["qkv"]), list(choice.get("copies", (NATIVE, "onednn")))
        for layer in self.encoder.layer:
            attn = layer.attention
            for name in ("query", "key", "value"):
                setattr(attn.self, name, ChosenLinear(getattr(attn.self, name), qkv, copies))
            attn.output.dense = ChosenLinear(attn.output.dense, tuple(choice["o"]), copies)
            layer.intermediate.dense = ChosenLinear(
                layer.intermediate.dense, tuple(choice["gate_up"]), copies
            )
            layer.output.dense = ChosenLinear(layer.output.dense, tuple(choice["down"]), copies)

    @staticmethod
    def native_attention(dtype: torch.dtype, device: torch.device) -> bool:
        """Whether attention and GELU run through the vbatch:: ops (float32 on CPU)."""
        return dtype == torch.float32 and has_fused_ops(device)

    def forward(self, input_ids: torch.Tensor, lens: list[int]) -> torch.Tensor:
        """input_ids [num_tokens] of prompts one after another (their lengths `lens`) →
        [num_tokens, hidden_size]."""
        config = self.config
        positions = torch.cat([torch.arange(n, device=input_ids.device) for n in lens])
        emb = self.embeddings
        hidden = (
            emb.word_embeddings(input_ids)
            + emb.position_embeddings(positions + config.position_offset)
            + emb.token_type_embeddings.weight[0]
        )
        hidden = emb.LayerNorm(hidden)
        num_heads = config.num_attention_heads
        head_dim = config.hidden_size // num_heads
        starts = None
        if self.native_attention(hidden.dtype, hidden.device):
            starts = torch.tensor([0, *accumulate(lens)], dtype=torch.int32)
        for layer in self.encoder.layer:
            attn = layer.attention
            q, k, v = (
                getattr(attn.self, name)(hidden).view(-1, num_heads, head_dim)
                for name in ("query", "key", "value")
            )
            if starts is not None:
                context = torch.ops.vbatch.encoder_attention(q, k, v, starts, head_dim**-0.5)
            else:
                context = _attend_per_prompt(q, k, v, lens)
            context = context.reshape(-1, config.hidden_size)
            hidden = attn.output.LayerNorm(attn.output.dense(context) + hidden)
            inner = layer.intermediate.dense(hidden)
            if starts is not None:
                torch.ops.vbatch.gelu_erf_(inner)
            else:
                inner = F.gelu(inner)
            hidden = layer.output.LayerNorm(layer.output.dense(inner) + hidden)
        return hidden


def _attend_per_prompt(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int]
) -> torch.Tensor:
    """[num_tokens, num_heads, head_dim] each → the same, one SDPA call per prompt."""
    # NOTE: [1, num_heads, n, head_dim] per prompt: 4-D inputs take torch's fused CPU kernel,
    # 3-D ones its math path (~7x slower per call here).
    context = torch.cat(
        [
            F.scaled_dot_product_attention(qs[None], ks[None], vs[None])[0]
            for qs, ks, vs in zip(
                *(x.transpose(0, 1).split(lens, 1) for x in (q, k, v)), strict=True
            )
        ],
        dim=1,
    )
    return context.transpose(0, 1)


def load_encoder(hf_dir: Path, device: torch.device, dtype: torch.dtype) -> EncoderModel:
    """The encoder with its checkpoint's weights; pooler and heads are not loaded."""
    config = EncoderConfig.from_hf_dir(hf_dir)
    with torch.device("meta"):
        model = EncoderModel(config).to(dtype)
    model.to_empty(device=device)
    model.requires_grad_(False)
    params: dict[str, Any] = dict(model.named_parameters())
    loaded: set[str] = set()
    for path in weight_files(hf_dir):
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for hf_name in f.keys():  # noqa: SIM118
                name = next(
                    (hf_name.removeprefix(p) for p in _PREFIXES if hf_name.startswith(p)), hf_name
                )
                if name not in params:
                    continue
                param = params[name]
                tensor = f.get_tensor(hf_name)
                if tensor.shape != param.shape:
                    raise ModelLoadError(
                        f"{path}: tensor {hf_name} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(param.shape)}"
                    )
                param.data.copy_(tensor)
                loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ModelLoadError(f"encoder in {hf_dir} lacks weights for {', '.join(missing[:5])}")
    return model.eval()
