"""The Llama-family decoder over a paged KV cache: Llama 2/3, SmolLM, Mistral, Qwen2/3, Phi-3/4,
Gemma 2/3, Mixtral and Qwen3-MoE, each a set of ModelConfig hooks (see models/families.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from torch import nn

from vbatch.errors import ConfigError, ModelLoadError
from vbatch.layers.activation import ACTIVATIONS
from vbatch.layers.attention import AttentionBackend, AttentionMetadata
from vbatch.layers.batch_invariant import invariant_linear
from vbatch.layers.greedy_screen import FP32, Int8GreedyScreen, ScreenSides, always_on
from vbatch.layers.linear_choice import (
    HEAD_CHUNK,
    NATIVE,
    TRANSPOSED,
    ChosenLinear,
    head_chunks,
    head_tiles,
    native_head_argmax,
    row_class,
)
from vbatch.layers.lora import LoraLinear
from vbatch.layers.native import has_fused_ops
from vbatch.layers.norm import RMSNorm
from vbatch.layers.packed_store import PackedStore
from vbatch.layers.quantization import (
    Int8DynamicLinear,
    exact_int8_backends,
    quantize_linears,
)
from vbatch.layers.rotary import RotaryBatch, RotaryEmbedding
from vbatch.models.config import ModelConfig
from vbatch.models.loader import ResolvedModel, weight_files
from vbatch.models.moe import SparseMoeBlock
from vbatch.models.weights import Target, param_target, prepare

KVCache = tuple[torch.Tensor, torch.Tensor]
LM_HEAD_CHUNK = HEAD_CHUNK
# NOTE: up to this many rows, GEMMs run as W @ x^T (see LlamaMLP._forward_transposed); from
# 1024 rows on the usual x @ W^T is as fast or faster.
MAX_TRANSPOSED_ROWS = 512
TRANSPOSED_ROW_MULTIPLE = 8


def _is_cpu_float32_linear(layer: nn.Module, x: torch.Tensor) -> bool:
    return (
        type(layer) in (nn.Linear, ChosenLinear)
        and x.device.type == "cpu"
        and x.dtype == torch.float32
    )


class LlamaAttention(nn.Module):
    """Fused QKV projection, per-head q/k norms (Qwen3, Gemma 3), rotary on Q and K together,
    paged attention with the layer's window and soft cap, output projection."""

    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        attn_backend: AttentionBackend,
        use_native_ops: bool,
    ) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.attention_scale
        self.sliding_window = config.sliding_window(layer)
        self.softcap = config.attn_logit_softcapping
        self.attn_backend = attn_backend
        qkv_size = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, qkv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(
            self.num_heads * self.head_dim, config.hidden_size, bias=config.o_proj_bias
        )
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        # NOTE: set by LoraSlots when the engine runs adapters (vbatch/lora/slots.py).
        self.qkv_lora: LoraLinear | None = None
        self.o_lora: LoraLinear | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, use_native_ops)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, use_native_ops)

    def forward(
        self, x: torch.Tensor, rotary: RotaryBatch, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        num_qk_heads = self.num_heads + self.num_kv_heads
        # [num_tokens, num_heads + 2 * num_kv_heads, head_dim]
        qkv = self.qkv_proj(x)
        if self.qkv_lora is not None:
            self.qkv_lora.add_to(qkv, x)
        qkv = qkv.view(num_tokens, -1, self.head_dim)
        qk = qkv[:, :num_qk_heads]
        if self.q_norm is not None and self.k_norm is not None:
            q = _norm_heads(self.q_norm, qk[:, : self.num_heads])
            k = _norm_heads(self.k_norm, qk[:, self.num_heads :])
            qk = torch.cat((q, k), dim=1)
        qk = rotary.rotate(qk)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, num_qk_heads:]
        out = self.attn_backend.forward(
            q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.sliding_window, self.softcap
        )
        out = out.reshape(num_tokens, self.num_heads * self.head_dim)
        if self.o_lora is None:
            return self.o_proj(out)
        projected = self.o_proj(out)
        self.o_lora.add_to(projected, out)
        return projected


def _norm_heads(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """RMSNorm over each head of x [num_tokens, num_heads, head_dim]."""
    return norm(x.reshape(-1, x.shape[-1])).view(x.shape)


class LlamaMLP(nn.Module):
    """A gated MLP (SwiGLU; GeGLU for Gemma) with gate and up fused into one projection; with
    `use_native_ops`, SwiGLU's silu(gate) * up is one pass (vbatch::silu_mul), and where the
    projection runs the native packed kernel, part of the GEMM (vbatch::packed_swiglu)."""

    def __init__(self, config: ModelConfig, use_native_ops: bool = False) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.act = ACTIVATIONS[config.hidden_act]
        self.fused_silu = use_native_ops and config.hidden_act in ("silu", "swish")
        bias = config.mlp_bias
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        # NOTE: set by LoraSlots when the engine runs adapters (vbatch/lora/slots.py).
        self.gate_up_lora: LoraLinear | None = None
        self.down_lora: LoraLinear | None = None
        # NOTE: set by LlamaForCausalLM.use_linear_choice (layers/linear_choice.py): per row
        # class, the transposed form or the linears' own backends; None: transposed up to 512
        # rows.
        self.modes: list[str] | None = None

    def _transposes(self, x: torch.Tensor) -> bool:
        num_rows = x.shape[0]
        if self.modes is not None and self.modes[row_class(num_rows)] != TRANSPOSED:
            return False
        return num_rows <= MAX_TRANSPOSED_ROWS and _is_cpu_float32_linear(self.gate_up_proj, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._transposes(x):
            return self._forward_transposed(x)
        if self.gate_up_lora is None and isinstance(
            self.gate_up_proj, ChosenLinear | Int8DynamicLinear
        ):
            act = self.gate_up_proj.swiglu(x)
            if act is not None:
                return self._down(act)
        gate_up = self.gate_up_proj(x)
        if self.gate_up_lora is not None:
            self.gate_up_lora.add_to(gate_up, x)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self._down(self._gated(gate, up))

    def _down(self, act: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(act)
        if self.down_lora is not None:
            self.down_lora.add_to(out, act)
        return out

    def _gated(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.fused_silu and gate.dim() == 2:
            return torch.ops.vbatch.silu_mul(gate, up)
        return self.act(gate).mul_(up)

    def _forward_transposed(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: for few rows MKL runs W @ x^T 1.3-1.4x faster than x @ W^T (measured at 16-128
        # rows, even after the final copy); gate and up are then contiguous row blocks. With a
        # token count that is not a multiple of 8 it runs 10-25% slower, so zero rows pad it.
        num_tokens = x.shape[0]
        pad = -num_tokens % TRANSPOSED_ROW_MULTIPLE
        if pad:
            x = F.pad(x, (0, 0, 0, pad))
        size = self.intermediate_size
        # [2 * intermediate_size, padded num_tokens]
        gate_up = _mm_columns(self.gate_up_proj, x.t())
        if self.gate_up_lora is not None:
            self.gate_up_lora.add_to(gate_up[:, :num_tokens].t(), x[:num_tokens])
        act = self._gated(gate_up[:size], gate_up[size:])
        out = _mm_columns(self.down_proj, act)[:, :num_tokens].t().contiguous()
        if self.down_lora is not None:
            self.down_lora.add_to(out, act[:, :num_tokens].t())
        return out


def _mm_columns(layer: nn.Linear, x_t: torch.Tensor) -> torch.Tensor:
    """layer(x) transposed, from x^T [in_features, n]: W @ x^T, plus the bias per column."""
    if layer.bias is None:
        return torch.mm(layer.weight, x_t)
    return torch.addmm(layer.bias[:, None], layer.weight, x_t)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention block then pre-norm MLP block; each residual add is fused into the
    next norm, so a layer takes and returns (block output, residual stream before it).

    With sandwich norms (Gemma 2/3) each block's output is normed too before it joins the
    residual: post_attention_layernorm then takes the attention output alone, and the MLP's
    input norm is pre_feedforward_layernorm. The MLP is a SparseMoeBlock on MoE layers.
    """

    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        attn_backend: AttentionBackend,
        use_native_ops: bool,
    ) -> None:
        super().__init__()
        hidden_size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden_size, eps, use_native_ops)
        self.self_attn = LlamaAttention(config, layer, attn_backend, use_native_ops)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, use_native_ops)
        self.mlp: nn.Module = (
            SparseMoeBlock(config)
            if config.is_moe_layer(layer)
            else LlamaMLP(config, use_native_ops)
        )
        self.pre_feedforward_layernorm: RMSNorm | None = None
        self.post_feedforward_layernorm: RMSNorm | None = None
        if config.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(hidden_size, eps, use_native_ops)
            self.post_feedforward_layernorm = RMSNorm(hidden_size, eps, use_native_ops)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryBatch,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(hidden, rotary, kv_cache, meta)
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
            return self.mlp(hidden), residual
        hidden = self.post_attention_layernorm(hidden)
        hidden, residual = self.pre_feedforward_layernorm.add_and_norm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class LlamaForCausalLM(nn.Module):
    """A flat token batch (prefill chunks and decodes mixed) in, final-normed hidden states out.

    Invariants: parameter names mirror HF's except the fused ones (see models/weights.py);
    with tied embeddings there is no lm_head parameter and logits use the embedding matrix.
    `use_native_ops` (fused RMSNorm and rotary kernels) only where has_fused_ops(device).
    Layers whose config gives them the sliding rope (Gemma 3's local layers) rotate by
    `sliding_rotary`, the rest by `rotary`.
    """

    def __init__(
        self, config: ModelConfig, attn_backend: AttentionBackend, use_native_ops: bool = False
    ) -> None:
        super().__init__()
        self.config = config
        self.use_native_ops = use_native_ops
        # NOTE: an explicit weight skips the random init, whose normal_() on the meta device
        # imports torch._dynamo: about 1 s of engine start-up.
        self.embed_tokens = nn.Embedding(
            config.vocab_size,
            config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size),
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, layer, attn_backend, use_native_ops)
            for layer in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, use_native_ops)
        self.lm_head = (
            None
            if config.tie_word_embeddings or config.head != "lm"
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        # NOTE: *ForSequenceClassification's head, applied by the pooler to last tokens only.
        self.score = (
            nn.Linear(config.hidden_size, config.num_labels, bias=False)
            if config.head == "score"
            else None
        )
        self.rotary = RotaryEmbedding(
            config.rotary_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
        )
        self.sliding_rotary: RotaryEmbedding | None = None
        if config.sliding_rope_theta is not None:
            self.sliding_rotary = RotaryEmbedding(
                config.rotary_dim,
                config.max_position_embeddings,
                config.sliding_rope_theta,
                config.sliding_rope_scaling,
            )
        self._uses_sliding_rope = [
            config.uses_sliding_rope(layer) for layer in range(config.num_hidden_layers)
        ]
        self._embedding_multipliers: dict[torch.dtype, float] = {}
        self.greedy_screen: Int8GreedyScreen | None = None
        self.screen_sides: ScreenSides | None = None
        # NOTE: set by make_batch_invariant: the LM head through layers/batch_invariant.py too.
        self.is_batch_invariant = False
        # NOTE: set by load_model under int8 quantization (quantize_linears' measured choice)
        self.quantization_choice: dict[str, object] | None = None
        # NOTE: set by use_linear_choice: the float32 CPU LM head's backend per row class, the
        # backends that run from prepared copies of its chunks (layers/linear_choice.py), and
        # those copies, each made at its backend's first call (a greedy job under the int8
        # screen may never make one).
        self.head_backends: list[str] | None = None
        self.head_copies: frozenset[str] = frozenset()
        self.head_chunks: dict[str, list[torch.Tensor]] = {}

    @property
    def long_rope_offset(self) -> int | None:
        """With longrope, what a position of a sequence past the pre-training length adds to
        index its long-factor rotation (see RotaryEmbedding); else None."""
        return self.rotary.long_offset

    @property
    def supports_cuda_graphs(self) -> bool:
        """False with MoE layers: routing sizes each expert's batch on the host."""
        return not any(self.config.moe_layers)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        # [num_tokens, hidden_size]
        hidden = self.embed_tokens(input_ids)
        if self.config.embedding_multiplier is not None:
            hidden = hidden * self._embedding_multiplier(hidden.dtype)
        rotary = self.rotary.for_positions(positions, hidden.dtype, self.use_native_ops)
        sliding_rotary = rotary
        if self.sliding_rotary is not None:
            sliding_rotary = self.sliding_rotary.for_positions(
                positions, hidden.dtype, self.use_native_ops
            )
        residual: torch.Tensor | None = None
        for layer, kv_cache, uses_sliding_rope in zip(
            self.layers, kv_caches, self._uses_sliding_rope, strict=True
        ):
            layer_rotary = sliding_rotary if uses_sliding_rope else rotary
            hidden, residual = layer(hidden, residual, layer_rotary, kv_cache, meta)
        assert residual is not None, "a model has at least one layer"
        return self.norm.add_and_norm(hidden, residual)[0]

    def _embedding_multiplier(self, dtype: torch.dtype) -> float:
        # NOTE: transformers rounds the multiplier to the model's dtype before multiplying.
        multiplier = self._embedding_multipliers.get(dtype)
        if multiplier is None:
            assert self.config.embedding_multiplier is not None
            multiplier = float(torch.tensor(self.config.embedding_multiplier, dtype=dtype))
            self._embedding_multipliers[dtype] = multiplier
        return multiplier

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[vocab_size, hidden_size]: the LM head's, or the embedding's when they are tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[n, hidden_size] → [n, vocab_size] float32 logits, soft-capped where the model says
        (Gemma 2); on CPU written into `out` if given (a reused buffer: a fresh one this large
        is mmap'd and page-faulted in every step)."""
        logits = self._raw_logits(hidden, out)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits.div_(cap).tanh_().mul_(cap)
        return logits

    def _raw_logits(self, hidden: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        weight = self.lm_head_weight
        vocab_size = weight.shape[0]
        if hidden.device.type != "cpu" or hidden.dtype != torch.float32:
            return F.linear(hidden, weight).float()
        if self.is_batch_invariant:
            logits = invariant_linear(hidden, weight)
            return logits if out is None else out.copy_(logits)
        logits = hidden.new_empty(hidden.shape[0], vocab_size) if out is None else out
        backend = self._head_backend(hidden.shape[0])
        # NOTE: GEMMs over vocab chunks keep each output tile in cache; measured ~25% faster
        # than one [n, vocab_size] GEMM at n = 64-256 on CPU.
        tiles = head_tiles(
            hidden, weight, logits, backend, in_place=True, chunks=self._head_chunks(backend)
        )
        for start, tile in tiles:
            if backend != "torch":
                logits[:, start : start + tile.shape[1]].copy_(tile)
        return logits

    def _head_backend(self, num_rows: int) -> str:
        backends = self.head_backends
        return "torch" if backends is None else backends[row_class(num_rows)]

    def logit_tiles(self, hidden: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        """The logits of `hidden` LM_HEAD_CHUNK vocab entries at a time, as in compute_logits:
        (first vocab id, [n, chunk] soft-capped logits), each tile in one buffer that the next
        one overwrites. A [n, vocab_size] tensor is never made."""
        weight = self.lm_head_weight
        vocab_size = weight.shape[0]
        cap = self.config.final_logit_softcapping
        buffer = hidden.new_empty(hidden.shape[0], min(LM_HEAD_CHUNK, vocab_size))
        backend = self._head_backend(hidden.shape[0])
        tiles = (
            (
                (start, invariant_linear(hidden, weight[start : start + LM_HEAD_CHUNK]))
                for start in range(0, vocab_size, LM_HEAD_CHUNK)
            )
            if self.is_batch_invariant
            else head_tiles(hidden, weight, buffer, backend, chunks=self._head_chunks(backend))
        )
        for start, tile in tiles:
            if cap is not None:
                tile.div_(cap).tanh_().mul_(cap)
            yield start, tile

    def target_logits(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """[n]: each row's logit of its own target token alone (soft-capped), a row-wise dot
        product that may differ from the full head's by rounding."""
        logits = (hidden * self.lm_head_weight[targets]).sum(-1)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = logits.div(cap).tanh().mul(cap)
        return logits

    def linear_weights(self, with_head: bool) -> dict[str, torch.Tensor]:
        """The [out, in] weights layers/linear_choice.py times: one layer's projections (the
        first with a dense MLP and plain linears) and the LM head if `with_head`; empty when no
        layer qualifies."""
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, getattr(mlp, "gate_up_proj", None))
            if isinstance(mlp, LlamaMLP) and all(type(m) is nn.Linear for m in linears):
                weights = {
                    "qkv": attn.qkv_proj.weight,
                    "o": attn.o_proj.weight,
                    "gate_up": mlp.gate_up_proj.weight,
                    "down": mlp.down_proj.weight,
                }
                if with_head:
                    weights["lm_head"] = self.lm_head_weight
                return weights
        return {}

    def swiglu_projections(self) -> list[str]:
        """The gate/up projections (names under `layers`) whose MLP fuses SwiGLU."""
        return [
            f"{index}.mlp.gate_up_proj"
            for index, layer in enumerate(self.layers)
            if isinstance(layer.mlp, LlamaMLP) and layer.mlp.fused_silu
        ]

    def fuses_swiglu(self) -> bool:
        """Whether the layers' MLPs fuse SiLU and the gate product into the native GEMM where
        it runs their gate/up projection (LlamaMLP.fused_silu), so that its timing includes the
        activation (layers/linear_choice.py)."""
        return bool(self.swiglu_projections())

    def use_linear_choice(
        self, choice: dict[str, object], store: PackedStore | None = None
    ) -> None:
        """Run the float32 linears (and the LM head, if chosen) by layers/linear_choice.py's
        per-row-class choice; layers with other linears or an MoE block keep theirs. Their native
        copies come from `store` where one is given (layers/packed_store.py)."""
        qkv, o, gate_up, down, modes = (
            list(choice[role])  # type: ignore[call-overload]
            for role in ("qkv", "o", "gate_up", "down", "mlp")
        )
        copies = list(choice.get("copies", (NATIVE, "onednn")))  # type: ignore[call-overload]
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            if type(attn.qkv_proj) is nn.Linear and type(attn.o_proj) is nn.Linear:
                attn.qkv_proj = ChosenLinear(
                    attn.qkv_proj, tuple(qkv), copies, store=store, name=f"layers.{i}.qkv"
                )
                attn.o_proj = ChosenLinear(
                    attn.o_proj, tuple(o), copies, store=store, name=f"layers.{i}.o"
                )
            if isinstance(mlp, LlamaMLP) and type(mlp.gate_up_proj) is nn.Linear:
                swiglu_size = mlp.intermediate_size if mlp.fused_silu else None
                mlp.gate_up_proj = ChosenLinear(
                    mlp.gate_up_proj,
                    tuple(gate_up),
                    copies,
                    swiglu_size=swiglu_size,
                    store=store,
                    name=f"layers.{i}.gate_up{'.swiglu' if swiglu_size else ''}",
                )
                mlp.down_proj = ChosenLinear(
                    mlp.down_proj, tuple(down), copies, store=store, name=f"layers.{i}.down"
                )
                mlp.modes = modes
        if "lm_head" in choice:
            self.head_backends = list(choice["lm_head"])  # type: ignore[call-overload]
            self.head_copies = frozenset(self.head_backends).intersection(copies)

    def pending_copy_bytes(self) -> int:
        """The bytes of the LM head's prepared copies not made yet (each about its size)."""
        weight = self.lm_head_weight
        weight_bytes = weight.numel() * weight.element_size()
        return weight_bytes * len(self.head_copies - self.head_chunks.keys())

    def _head_chunks(self, backend: str) -> list[torch.Tensor] | None:
        """`backend`'s prepared chunks of the LM head (made now if this is its first call), or
        None where it runs from the plain weight."""
        if backend not in self.head_copies:
            return None
        chunks = self.head_chunks.get(backend)
        if chunks is None:
            chunks = self.head_chunks[backend] = head_chunks(self.lm_head_weight, backend)
        return chunks

    def enable_greedy_screen(
        self, store: PackedStore | None = None, sides: ScreenSides | None = None
    ) -> None:
        """Find greedy tokens through the int8 screen (see layers/greedy_screen.py) in the steps
        whose row counts `sides` gives it (None: every step, greedy_screen.always_on), through the
        int8 GEMM it names there, its int8 head from `store` where one is given."""
        sides = sides or always_on()
        self.greedy_screen = Int8GreedyScreen(self.lm_head_weight, store, sides.gemms)
        self.screen_sides = sides

    def greedy_token_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden_size] -> [n] int64 argmax token ids, the first on ties, as
        compute_logits(hidden).argmax(-1); on CPU without materialising the [n, vocab] logits.

        NOTE: the final soft cap is increasing, so the argmax skips it; only logits it would
        saturate to the same float (far above the cap) could tie there and not here.
        """
        weight = self.lm_head_weight
        if hidden.device.type != "cpu" or hidden.dtype != torch.float32:
            return F.linear(hidden, weight).argmax(dim=-1)
        side = FP32 if self.screen_sides is None else self.screen_sides.serves(hidden.shape[0])
        if self.greedy_screen is not None and side != FP32:
            return self.greedy_screen.argmax(hidden, self._greedy_token_ids_fp32, gemm=side)
        if self.is_batch_invariant:
            return invariant_linear(hidden, weight).argmax(dim=-1)
        return self._greedy_token_ids_fp32(hidden)

    def _greedy_token_ids_fp32(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.lm_head_weight
        # NOTE: a [n, vocab] float32 tensor (50 MB at n = 256) evicts every cache each step;
        # one chunk's scores stay in cache and are reduced before the next chunk is computed.
        num_rows = hidden.shape[0]
        backend = self._head_backend(num_rows)
        if backend == NATIVE:
            chunks = self._head_chunks(backend)
            assert chunks is not None
            return native_head_argmax(hidden, chunks, weight.shape[0])
        scores = hidden.new_empty(num_rows, LM_HEAD_CHUNK)
        best_value = hidden.new_full((num_rows,), float("-inf"))
        best_index = torch.zeros(num_rows, dtype=torch.int64)
        for start, chunk in head_tiles(
            hidden, weight, scores, backend, chunks=self._head_chunks(backend)
        ):
            value, index = chunk.max(dim=1)
            is_better = value > best_value
            best_value = torch.where(is_better, value, best_value)
            best_index = torch.where(is_better, index + start, best_index)
        return best_index


def load_model(
    model: ResolvedModel | str | Path,
    device: torch.device,
    dtype: torch.dtype,
    attn_backend: AttentionBackend,
    config: ModelConfig | None = None,
    quantization: str | None = None,
    store: PackedStore | None = None,
) -> LlamaForCausalLM:
    """Build the model from an HF directory, reading safetensors straight onto `device`.

    Shard by shard and one tensor at a time, each cast to `dtype` as it is copied into its
    parameter (a bf16 or fp16 checkpoint widens to float32 on CPU), so loading holds the model
    plus one checkpoint tensor. A CPU parameter that the file holds whole is the file's mapped
    tensor (see takes_whole); with a `store`, one fused from several (qkv_proj, gate_up_proj) is
    its copy in the store where an earlier core wrote it (see fused_from_store).

    The fused native ops come with the native attention backend, where they serve `device`.
    `quantization="int8"` swaps the decoder layers' linears (not the LM head) for int8 ones.
    """
    if quantization is not None:
        check_quantization(quantization, device, dtype)
    hf_dir = model.hf_dir if isinstance(model, ResolvedModel) else Path(model)
    config = config or ModelConfig.from_hf_dir(hf_dir)
    use_native_ops = attn_backend.name == "native" and has_fused_ops(device)
    with torch.device("meta"):
        llm = LlamaForCausalLM(config, attn_backend, use_native_ops)
    _materialize(llm, device, dtype)
    params = dict(llm.named_parameters())
    num_loaded = dict.fromkeys(params, 0)
    fused_parts: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for path in weight_files(hf_dir):
        try:
            with safe_open(str(path), framework="pt", device=str(device)) as f:
                for hf_name in f.keys():  # noqa: SIM118
                    target = param_target(hf_name, config)
                    if target is None:
                        continue
                    if target.name not in params:
                        raise ModelLoadError(f"{path}: unexpected tensor {hf_name}")
                    tensor = prepare(target, f.get_tensor(hf_name), config)
                    param = params[target.name].data
                    if takes_whole(target, tensor, param):
                        params[target.name].data = tensor
                        num_loaded[target.name] += tensor.numel()
                        continue
                    if target.expert is not None:
                        param = param[target.expert]
                    num_rows = param.shape[0] if target.num_rows is None else target.num_rows
                    rows = param[target.row_start : target.row_start + num_rows]
                    if rows.shape != tensor.shape:
                        raise ModelLoadError(
                            f"{path}: tensor {hf_name} has shape {tuple(tensor.shape)}, where "
                            f"config.json implies {tuple(rows.shape)} (hidden_size, "
                            "num_attention_heads, num_key_value_heads, head_dim, "
                            "intermediate_size, vocab_size?)"
                        )
                    if store is not None and stores_fused(target, param):
                        fused_parts.setdefault(target.name, []).append((target.row_start, tensor))
                    else:
                        rows.copy_(tensor)
                    num_loaded[target.name] += tensor.numel()
        except (OSError, RuntimeError, SafetensorError) as e:
            raise ModelLoadError(f"cannot read weights {path}: {e}") from e
    if store is not None:
        for name, parts in fused_parts.items():
            params[name].data = fused_from_store(store, name, params[name].data, parts)
    missing = [name for name, param in params.items() if num_loaded[name] != param.numel()]
    if missing:
        source = model.local_path if isinstance(model, ResolvedModel) else hf_dir
        partial = [name for name in missing if num_loaded[name]]
        if partial:
            name = partial[0]
            got, want = num_loaded[name], params[name].numel()
            why = (
                "a part of it is missing from the checkpoint"
                if got < want
                else "the checkpoint holds a tensor more than once (several weight files "
                "without a model.safetensors.index.json naming one for each tensor?)"
            )
            raise ModelLoadError(
                f"model in {source}: {name} got {got} of the {want} values its config implies "
                f"from the checkpoint's tensors; {why}"
            )
        raise ModelLoadError(f"model in {source} lacks weights for {', '.join(missing[:5])}")
    if quantization is not None:
        # NOTE: the MoE router stays float32: a rounding there changes which experts run.
        llm.quantization_choice = quantize_linears(
            llm.layers, skip=("lm_head", "mlp.gate"), swiglu=llm.swiglu_projections()
        )
    return llm.eval()


def takes_whole(target: Target, tensor: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether a checkpoint tensor can be the whole parameter itself, with no copy: the same
    shape, dtype and device, on CPU (safetensors maps a CPU tensor from its file, copy on
    write, so its pages come from the page cache rather than fresh memory).

    Measured on the AVX-512 EPYC: copying the default model's 537 MB of float32 weights took
    0.38 s of a core's start-up; the unfused ones (embeddings, o_proj, down_proj, norms) are
    half of that, and a job that runs down_proj from its packed copy never reads the plain one
    after the packing.
    """
    return (
        target.row_start == 0
        and target.expert is None
        and tensor.device.type == "cpu"
        and tensor.dtype == param.dtype
        and tensor.shape == param.shape
    )


def stores_fused(target: Target, param: torch.Tensor) -> bool:
    """Whether a checkpoint tensor that is part of a fused parameter can come through the store:
    a dense model's float32 CPU parameter (the store keeps float32 and int8)."""
    return target.expert is None and param.device.type == "cpu" and param.dtype == torch.float32


def fused_from_store(
    store: PackedStore,
    name: str,
    empty: torch.Tensor,
    parts: list[tuple[int, torch.Tensor]],
) -> torch.Tensor:
    """The fused parameter `name` assembled from its checkpoint `parts` (first row, tensor): the
    store's copy, mapped from its file, where the file has it and it holds each part (checked
    at each part's first, middle and last rows), else the parts copied into `empty` now and
    kept for the store to write back.

    Measured on the AVX-512 EPYC: copying SmolLM2's fused projections put 279 MB of fresh
    memory (~68k page faults) into a core's start-up, and on a VM whose host backs the guest's
    memory lazily each such fault cost up to ~25 us; a mapped copy is read from the page cache,
    which every core on the machine shares, and a job whose linears run from packed copies reads
    only the checked rows of it.
    """

    def make() -> tuple[torch.Tensor]:
        for row_start, part in parts:
            empty[row_start : row_start + part.shape[0]].copy_(part)
        return (empty,)

    def holds_parts(mapped: tuple[torch.Tensor, ...]) -> bool:
        (stored,) = mapped
        if stored.shape != empty.shape or stored.dtype != empty.dtype:
            return False
        for row_start, part in parts:
            for row in {0, part.shape[0] // 2, part.shape[0] - 1}:
                if not torch.equal(stored[row_start + row], part[row].to(stored.dtype)):
                    return False
        return True

    (weight,) = store.tensors((f"fp32.{name}",), make, holds_parts)
    return weight


def _materialize(module: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Give the meta tensors of `module` uninitialized storage on `device`, floating point ones
    in `dtype`, as `.to(dtype).to_empty(device)` would, but built from shapes alone: any op on a
    meta tensor imports torch's meta registrations and sympy, ~1 s of a warm start."""
    # NOTE: by id, holding the meta tensor so its id stays its own; a tied tensor stays tied.
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def empty(tensor: torch.Tensor, *, is_param: bool) -> torch.Tensor:
        if id(tensor) not in made:
            kind = dtype if tensor.dtype.is_floating_point else tensor.dtype
            new = torch.empty(tensor.shape, dtype=kind, device=device)
            made[id(tensor)] = (tensor, nn.Parameter(new, requires_grad=False) if is_param else new)
        return made[id(tensor)][1]

    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is not None and param.is_meta:
                sub._parameters[name] = empty(param, is_param=True)
        for name, buffer in sub._buffers.items():
            if buffer is not None and buffer.is_meta:
                sub._buffers[name] = empty(buffer, is_param=False)


def check_quantization(quantization: str, device: torch.device, dtype: torch.dtype) -> None:
    if quantization != "int8":
        raise ConfigError(f"unknown quantization {quantization!r}")
    if device.type != "cpu" or dtype != torch.float32:
        raise ConfigError(
            f"int8 quantization needs device cpu and dtype float32, got {device}, {dtype}"
        )
    if not exact_int8_backends():
        raise ConfigError(
            "int8 quantization needs an exact int8 GEMM: torch's saturates on this CPU (no VNNI) "
            "and vbatch's native kernels are not built"
        )
