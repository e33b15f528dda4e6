"""The gated MLPs' activations, by transformers' ACT2FN names."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,  # the exact GELU
    "gelu_pytorch_tanh": _gelu_tanh,  # Gemma's GeGLU
}
