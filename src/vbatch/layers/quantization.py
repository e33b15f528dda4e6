"""Int8 linear layers for CPU: int8 weights per output channel, activations int8 per token."""

from __future__ import annotations

import torch
from torch import nn


def has_int8_kernels() -> bool:
    """Whether torch's int8 x int8 -> int32 GEMM runs on this CPU."""
    try:
        a = torch.ones(1, 8, dtype=torch.int8)
        return int(torch._int_mm(a, a.t())) == 8
    except RuntimeError:
        return False


class Int8DynamicLinear(nn.Module):
    """y = x W^T + b with W symmetric int8 per output row and each token of x quantized to
    symmetric int8 on the fly; the int32 GEMM result is rescaled by both scales.

    Invariants: `weight_t` is the int8 weight as [in_features, out_features] (a transposed view
    of a row-major [out, in] tensor); `weight_scale` is float32 [out_features]; inputs and
    outputs are float32 [..., in_features] / [..., out_features].
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        weight = weight.detach().float()
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        scale = weight.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        qweight = torch.round(weight / scale[:, None]).to(torch.int8)
        self.register_buffer("weight_t", qweight.t(), persistent=False)
        self.register_buffer("weight_scale", scale, persistent=False)
        self.register_buffer(
            "bias", None if bias is None else bias.detach().float(), persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        # [num_rows, 1]: per-token scale, so one outlier token does not crush the others
        scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0
        qrows = torch.round(rows / scale).to(torch.int8)
        out = torch._int_mm(qrows, self.weight_t).float()
        out.mul_(scale).mul_(self.weight_scale)
        if self.bias is not None:
            out.add_(self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_linears(model: nn.Module, skip: tuple[str, ...] = ("lm_head",)) -> int:
    """Replace every nn.Linear in `model` (names ending in `skip` excepted) with an
    Int8DynamicLinear, in place; returns how many were replaced."""
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and not name.endswith(skip)
    ]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Int8DynamicLinear(module.weight, module.bias))
    return len(targets)
