"""RMSNorm, computed in float32 like transformers, then scaled in the weight's dtype."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Normalizes the last dimension by its root mean square; output keeps the input's dtype."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(input_dtype)
