"""Rotary position embeddings: inverse frequencies (default, linear, llama3, longrope) and a
cos/sin cache; partial rotary rotates only a head's leading dims."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


def rope_inv_freq(
    head_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None, long: bool = False
) -> torch.Tensor:
    """The per-pair rotation frequencies, [head_dim // 2] float32, scaled as the config says;
    `long` picks longrope's long factors (for sequences past the pre-training length)."""
    # NOTE: always on CPU, so a model built under `torch.device("meta")` still gets real values.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    rope_type = (rope_scaling or {}).get("rope_type", "default")
    if rope_type == "longrope":
        assert rope_scaling is not None
        factors = rope_scaling["long_factor" if long else "short_factor"]
        factors_t = torch.tensor(factors, dtype=torch.float32, device="cpu")
        return 1.0 / (factors_t * rope_theta**exponents)
    inv_freq = 1.0 / (rope_theta**exponents)
    if rope_type == "default":
        return inv_freq
    assert rope_scaling is not None
    factor = float(rope_scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor
    assert rope_type == "llama3", rope_type
    return _llama3_inv_freq(inv_freq, factor, rope_scaling)


def _llama3_inv_freq(
    inv_freq: torch.Tensor, factor: float, rope_scaling: dict[str, Any]
) -> torch.Tensor:
    # NOTE: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    low_freq_factor = float(rope_scaling["low_freq_factor"])
    high_freq_factor = float(rope_scaling["high_freq_factor"])
    original_len = float(rope_scaling["original_max_position_embeddings"])
    low_freq_wavelen = original_len / low_freq_factor
    high_freq_wavelen = original_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding:
    """A cos/sin table for positions [0, max_positions), built lazily per (device, dtype).

    Invariant: the tables are [max_positions, rotary_dim // 2], computed in float32 (as
    transformers does) and cast to the requested dtype. With longrope (Phi-3) they hold
    2 * max_positions rows: the short factors' rotations, then from row `long_offset` on the long
    factors' for the same positions, all scaled by its attention factor; a sequence longer than
    the pre-training length rotates every position by the long ones (position + long_offset), as
    transformers, which picks one set per forward pass from its longest position. Long factors
    equal to the short ones make one table and no `long_offset`.
    """

    def __init__(
        self,
        rotary_dim: int,
        max_positions: int,
        rope_theta: float,
        rope_scaling: dict[str, Any] | None,
    ) -> None:
        self.max_positions = max_positions
        self.inv_freq = rope_inv_freq(rotary_dim, rope_theta, rope_scaling)
        self.long_inv_freq: torch.Tensor | None = None
        self.long_offset: int | None = None
        self.attention_factor = 1.0
        if (rope_scaling or {}).get("rope_type") == "longrope":
            assert rope_scaling is not None
            self.attention_factor = float(rope_scaling["attention_factor"])
            if rope_scaling["long_factor"] != rope_scaling["short_factor"]:
                self.long_inv_freq = rope_inv_freq(rotary_dim, rope_theta, rope_scaling, long=True)
                self.long_offset = max_positions
        self._cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def for_positions(
        self, positions: torch.Tensor, dtype: torch.dtype, use_native_ops: bool = False
    ) -> RotaryBatch:
        """This step's rotation; the native form keeps whole tables and indexes them per token."""
        cache = self._cache
        if cache is None or cache[0].device != positions.device or cache[0].dtype != dtype:
            cache = self._build(positions.device, dtype)
            self._cache = cache
        if use_native_ops:
            return RotaryBatch(positions, cache[0], cache[1], is_native=True)
        cos = cache[0].index_select(0, positions)
        sin = cache[1].index_select(0, positions)
        return RotaryBatch(positions, cos, sin, is_native=False)

    def _build(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(self.max_positions, device=device, dtype=torch.float32)
        # [max_positions, rotary_dim // 2]
        freqs = positions[:, None] * self.inv_freq.to(device)[None, :]
        if self.long_inv_freq is not None:
            long_freqs = positions[:, None] * self.long_inv_freq.to(device)[None, :]
            freqs = torch.cat((freqs, long_freqs))
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of each head (HF's rotate_half layout).

    x [num_tokens, num_heads, rotary_dim]; cos, sin [num_tokens, rotary_dim // 2].
    """
    x1, x2 = x.chunk(2, dim=-1)
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@dataclass
class RotaryBatch:
    """One step's rotation: per-token cos/sin rows, or (native) the whole tables and positions.
    The tables' width sets how many leading dims of each head rotate (2 * cos.shape[-1])."""

    positions: torch.Tensor  # [num_tokens] int64
    cos: torch.Tensor  # [num_tokens, rotary_dim // 2], or [max_positions, rotary_dim // 2]
    sin: torch.Tensor
    is_native: bool

    def rotate(self, qk: torch.Tensor) -> torch.Tensor:
        """Rotated qk [num_tokens, num_heads, head_dim]; the native path rotates qk in place."""
        rotary_dim = 2 * self.cos.shape[-1]
        is_partial = rotary_dim != qk.shape[-1]
        if self.is_native:
            # NOTE: the op takes a strided view, so a partial rotation is a slice of qk.
            target = qk[..., :rotary_dim] if is_partial else qk
            torch.ops.vbatch.rotary_embedding(self.positions, target, self.cos, self.sin)
            return qk
        if is_partial:
            rotated = apply_rotary(qk[..., :rotary_dim], self.cos, self.sin)
            return torch.cat((rotated, qk[..., rotary_dim:]), dim=-1)
        return apply_rotary(qk, self.cos, self.sin)
