"""RMSNorm, computed in float32 like transformers, then scaled in the weight's dtype."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Normalizes the last dimension by its root mean square; output keeps the input's dtype.

    With `use_native_ops` the vbatch:: kernels do it in one pass (`add_and_norm` in place);
    otherwise plain torch ops. Both round like transformers' LlamaRMSNorm.
    """

    def __init__(self, hidden_size: int, eps: float, use_native_ops: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.use_native_ops = use_native_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_native_ops:
            return torch.ops.vbatch.rms_norm(x, self.weight, self.eps)
        input_dtype = x.dtype
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(input_dtype)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); the native path overwrites x and residual."""
        if self.use_native_ops:
            torch.ops.vbatch.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        residual = residual + x
        return self.forward(residual), residual
