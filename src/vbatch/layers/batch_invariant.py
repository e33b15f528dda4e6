"""Batch-invariant linears on CPU: a row's result does not depend on the other rows of its call.

MKL's float32 GEMM picks its kernel, and on 2 threads its split of the work, by the number of
rows, so the same row rounds otherwise in a call of 1 to 15 rows than in one of 16 or more (and
otherwise again at some larger counts under 2 threads). Then a prompt's tail recomputed after a
prefix-cache hit, or a decode row in a batch of another size, gets other last bits than before,
and a seeded sample can drift. oneDNN's float32 inner product computes each output element the
same way for every row count from 2 on, which `check_row_invariance` verifies on the model's
shapes at start-up rather than trusting it; a single row is padded to two.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vbatch.errors import ConfigError

# NOTE: row counts a step can have (one, a few, the tile and block sizes, past 128), each
# compared with the same rows of one larger call.
PROBE_ROWS = (1, 2, 3, 5, 8, 15, 16, 17, 33, 64, 100, 129, 200)
PROBE_TOTAL_ROWS = 256


def invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [n, in_features] @ weight^T (+ bias) through oneDNN, each row as in any other call."""
    num_rows = x.shape[0]
    if num_rows == 1:
        x = F.pad(x, (0, 0, 0, 1))
    out = torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
    return out[:num_rows] if num_rows == 1 else out


class RowInvariantLinear(nn.Linear):
    """An nn.Linear (sharing the original's parameters) computed by invariant_linear."""

    def __init__(self, linear: nn.Linear) -> None:
        nn.Module.__init__(self)
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.register_parameter("bias", linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        return invariant_linear(flat, self.weight, self.bias).view(*x.shape[:-1], -1)


def check_row_invariance(shapes: list[tuple[int, int]]) -> None:
    """Raise ConfigError unless invariant_linear gives every row the same bits at each of
    PROBE_ROWS rows as in one call of PROBE_TOTAL_ROWS, for these [out, in] weight shapes."""
    generator = torch.Generator().manual_seed(0)
    for out_features, in_features in sorted(set(shapes)):
        weight = torch.randn(out_features, in_features, generator=generator)
        x = torch.randn(PROBE_TOTAL_ROWS, in_features, generator=generator)
        full = invariant_linear(x, weight)
        for rows in PROBE_ROWS:
            start = PROBE_TOTAL_ROWS - rows
            if not torch.equal(invariant_linear(x[start:], weight), full[start:]):
                raise ConfigError(
                    f"batch_invariant: this CPU's oneDNN rounds a {out_features}x{in_features} "
                    f"linear by its row count ({rows} rows differ from {PROBE_TOTAL_ROWS}), so "
                    "vbatch cannot make steps batch-invariant here; run without it"
                )


def make_batch_invariant(layers: nn.Module) -> list[tuple[int, int]]:
    """Replace every nn.Linear under `layers` with a RowInvariantLinear, in place; returns the
    [out, in] shapes replaced."""
    targets = [(n, m) for n, m in layers.named_modules() if type(m) is nn.Linear]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = layers.get_submodule(parent_name) if parent_name else layers
        setattr(parent, child, RowInvariantLinear(module))
    return [tuple(m.weight.shape) for _, m in targets]
