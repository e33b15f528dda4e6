"""Int8 linear layers for CPU: int8 weights per output channel, activations int8 per token,
through whichever int8 GEMM is exact and fastest on this machine: torch's (oneDNN's `_int_mm`,
FBGEMM's dynamic linear) or vbatch's own (`vbatch::int8_linear`, the whole layer in one call,
exact on every CPU)."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import nn

from vbatch.layers import native
from vbatch.layers.kernel_choice import cached_choice, fastest_ms, is_number
from vbatch.layers.linear_choice import available_backends, linear_candidates, prepared_weight

INT_MM = "int_mm"
NATIVE = "native"
FBGEMM = "fbgemm"
# NOTE: summed, the larger batches weigh most, as in a batch job's steps. Timed at 1 and 64
# only, the int8 linears of vbatch's GEMM under the AVX2 emulation came out 1.62x fp32 (its
# one-row calls, memory-bound, gain most) while the 64-prompt job ran 1.00x, and no warning.
TIMED_BATCHES = (1, 64, 512)
INT8_MAX = 127
# NOTE: int8 that does not make a job at least this much faster than fp32 is reported.
WORTHWHILE_SPEEDUP = 1.3
# NOTE: what the layer GEMMs' timed gain must reach for that: the rest of a step (attention, the
# LM head, norms) stays float32, and whole jobs gained 0.66-0.93 of the timed figure (64-prompt
# job against the start-up timing: 1.55 / 2.07x on the AVX-512 EPYC (Zen 4); 1.61 / 1.74x,
# 1.29 / 1.82x and 1.21 / 1.82x on the Intel Sapphire Rapids class in three sessions).
WORTHWHILE_GEMM_SPEEDUP = 2.0
FP32_PREFIX = "fp32 "


@functools.cache
def int_mm_is_exact() -> bool:
    """Whether torch's int8 x int8 -> int32 GEMM (`torch._int_mm`, oneDNN) runs on this CPU and
    sums exactly, checked by running it against an int64 product. oneDNN without VNNI (AVX2,
    and AVX-512 before VNNI) adds pairs of u8 x s8 products in int16, which full-range values
    saturate: 64 products of 127 x 127 came out as 8160 against 1032256 under
    ONEDNN_MAX_CPU_ISA=AVX2, and random values in [-127, 127] as far as 118385 off."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randint(-INT8_MAX, INT8_MAX + 1, (17, 576), generator=generator, dtype=torch.int8)
    b = torch.randint(-INT8_MAX, INT8_MAX + 1, (576, 32), generator=generator, dtype=torch.int8)
    a[0], b[:, 0] = INT8_MAX, INT8_MAX
    try:
        got = torch._int_mm(a, b)
    except RuntimeError:
        return False
    return torch.equal(got.long(), a.long() @ b.long())


def exact_int8_backends() -> list[str]:
    """The int8 GEMMs that run here and sum exactly: torch's `_int_mm` where int_mm_is_exact(),
    vbatch's own where its native kernels are built, FBGEMM where fbgemm_is_exact()."""
    backends = [INT_MM] if int_mm_is_exact() else []
    if native.is_available():
        backends.append(NATIVE)
    if fbgemm_is_exact():
        backends.append(FBGEMM)
    return backends


def has_fbgemm() -> bool:
    """Whether torch's FBGEMM dynamic quantized linear runs on this CPU."""
    return "fbgemm" in torch.backends.quantized.supported_engines


@functools.cache
def fbgemm_is_exact() -> bool:
    """Whether FBGEMM sums full-range 8-bit activations exactly here, checked by running it.
    Without VNNI it adds pairs of u8 x s8 products in int16, which they saturate (a sum of 576
    came out as 4.5), and only 7-bit activations (`reduce_range`) are safe: those cost SmolLM2
    0.30 nats per token against <0.1, too much for a default, so there FBGEMM is no candidate."""
    if not has_fbgemm():
        return False
    weight = torch.full((16, 576), 127.0)
    probe = Int8DynamicLinear(weight, None, FBGEMM)(torch.ones(1, 576))
    return torch.allclose(probe, weight.sum(dim=1), rtol=0.02)


def panel_rows(out_features: int, swiglu: bool) -> torch.Tensor:
    """The weight row behind each column of vbatch::int8_linear's panels, -1 for padding.
    Plain: rows in order. SwiGLU (a [gate; up] weight of 2 x out_features / 2 rows): panel p
    holds gate rows [p * half, (p + 1) * half) then the same up rows, half being half a panel."""
    cols = int(torch.ops.vbatch.int8_panel_cols())
    if not swiglu:
        rows = torch.arange(-(-out_features // cols) * cols)
        return torch.where(rows < out_features, rows, -1)
    half, intermediate = cols // 2, out_features // 2
    column = torch.arange(-(-intermediate // half))[:, None] * half + torch.arange(cols) % half
    rows = torch.where(torch.arange(cols) < half, column, intermediate + column)
    return torch.where(column < intermediate, rows, -1).flatten()


class Int8DynamicLinear(nn.Module):
    """y = x W^T + b with W symmetric int8 per output row and each token of x quantized to int8
    on the fly; the int32 GEMM result is rescaled by both scales.

    `backend` INT_MM: symmetric 8-bit tokens through `torch._int_mm` (oneDNN; fast with VNNI,
    and AMX where there is one), the tokens quantized and the sums rescaled by one native call
    each where the native kernels are loaded. NATIVE: the whole layer in one
    `vbatch::int8_linear` call (the same tokens and int32 sums), from a copy of the weight packed
    into its panels. FBGEMM: each token divided by its largest magnitude first, so that FBGEMM's
    per-tensor dynamic quantization acts per token, as 8-bit asymmetric values (only where that
    is exact, see fbgemm_is_exact).

    With `swiglu` (W is a gated MLP's [gate; up] projection) and the native kernels, `swiglu(x)`
    gives silu(gate) * up from the rescaling itself (NATIVE: its panels pair gate and up
    columns); otherwise it returns None and the caller applies the activation.

    Invariants: `weight_t` is the int8 weight as [in_features, out_features] (a transposed view
    of a row-major [out, in] tensor); `weight_scale` and `col_bias` (zeros without a bias) are
    float32 [out_features]; inputs and outputs are float32 [..., in_features] / [...,
    out_features]. Under NATIVE, `columns` holds each panel column's scale, int8 row sum and
    bias (see vbatch::int8_linear) and `plain_columns` the panel column of each output column.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        backend: str = INT_MM,
        swiglu: bool = False,
    ) -> None:
        super().__init__()
        weight = weight.detach().float()
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.backend = backend
        scale = weight.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        qweight = torch.round(weight / scale[:, None]).to(torch.int8)
        self.register_buffer("weight_t", qweight.t(), persistent=False)
        self.register_buffer("weight_scale", scale, persistent=False)
        self.register_buffer(
            "bias", None if bias is None else bias.detach().float(), persistent=False
        )
        self.col_bias = torch.zeros(self.out_features) if bias is None else self.bias
        self.packed: object | None = None
        self.fused = backend in (INT_MM, NATIVE) and native.is_available()
        self.swiglu_size = self.out_features // 2 if swiglu and self.fused else None
        if backend == NATIVE:
            self._pack_native(qweight)
        elif backend == FBGEMM:
            with warnings.catch_warnings():
                # NOTE: torch marks quantized tensors deprecated; the packed weight is one.
                warnings.simplefilter("ignore")
                per_channel = torch._make_per_channel_quantized_tensor(
                    qweight, scale.double(), torch.zeros_like(scale, dtype=torch.long), 0
                )
                self.packed = torch.ops.quantized.linear_prepack(per_channel, None)

    def _pack_native(self, qweight: torch.Tensor) -> None:
        rows = panel_rows(self.out_features, self.swiglu_size is not None)
        valid = rows >= 0
        index = rows.clamp_min(0)
        self.packed = torch.ops.vbatch.pack_int8_linear(
            torch.where(valid[:, None], qweight[index], 0)
        )
        row_sums = qweight.sum(dim=1, dtype=torch.int32)
        self.columns = [
            torch.where(valid, values[index], 0).contiguous()
            for values in (self.weight_scale, row_sums, self.col_bias)
        ]
        # NOTE: forward on a SwiGLU packing (a LoRA on gate/up skips the fused path) takes the
        # plain output back out of the panels' order.
        self.plain_columns = torch.empty(self.out_features, dtype=torch.long)
        self.plain_columns[rows[valid]] = torch.nonzero(valid).flatten()

    def _fused(self, rows: torch.Tensor, swiglu: bool) -> torch.Tensor:
        """The native kernels' output for rows [M, in_features]: [M, out_features], or with
        `swiglu` silu(gate) * up [M, out_features / 2]."""
        if self.backend == INT_MM:
            q, row_scale = torch.ops.vbatch.int8_quantize_rows(rows)
            sums = torch._int_mm(q, self.weight_t)
            return torch.ops.vbatch.int8_scale_sums(
                sums, row_scale, self.weight_scale, self.col_bias, swiglu
            )
        op = torch.ops.vbatch.int8_linear
        if swiglu:
            return op(rows, self.packed, *self.columns, self.swiglu_size, True)
        if self.swiglu_size is None:
            return op(rows, self.packed, *self.columns, self.out_features, False)
        return op(rows, self.packed, *self.columns, len(self.columns[0]), False)[
            :, self.plain_columns
        ]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.fused:
            return self._fused(rows, swiglu=False).view(*x.shape[:-1], self.out_features)
        # [num_rows, 1]: per-token scale, so one outlier token does not crush the others
        peak = rows.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
        if self.backend == FBGEMM:
            out = torch.ops.quantized.linear_dynamic(rows / peak, self.packed, False).mul_(peak)
        else:
            scale = peak / INT8_MAX
            qrows = torch.round(rows / scale).to(torch.int8)
            out = torch._int_mm(qrows, self.weight_t).float().mul_(scale).mul_(self.weight_scale)
        if self.bias is not None:
            out.add_(self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def swiglu(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up [..., out_features / 2] from the fused kernels, where this layer is
        a SwiGLU's gate/up projection and they are loaded; else None."""
        if self.swiglu_size is None:
            return None
        act = self._fused(x.reshape(-1, self.in_features), swiglu=True)
        return act.view(*x.shape[:-1], self.swiglu_size)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int8 ({self.backend}{', SwiGLU' if self.swiglu_size is not None else ''})"
        )


def _time_backends(shapes: list[tuple[int, int]]) -> dict[str, object]:
    """Per backend, the summed fastest ms over the layer shapes at TIMED_BATCHES; fp32's is the
    fastest of the float32 GEMMs the engine chooses from (layers/linear_choice.py) per shape
    and batch, as it would run them."""
    backends = exact_int8_backends()
    fp32_backends = [name for name in available_backends() if name != "torch"]
    generator = torch.Generator().manual_seed(0)
    sets: dict[str, dict[str, Callable[[], object]]] = {}
    for index, (out_features, in_features) in enumerate(shapes):
        weight = torch.randn(out_features, in_features, generator=generator) / in_features**0.5
        layers = {name: Int8DynamicLinear(weight, None, name) for name in backends}
        prepared = {name: prepared_weight(weight, name) for name in fp32_backends}
        for batch in TIMED_BATCHES:
            fp32_gemms = linear_candidates(weight, prepared, batch, generator)
            x = torch.randn(batch, in_features, generator=generator)
            candidates = {f"{FP32_PREFIX}{name}": fn for name, fn in fp32_gemms.items()}
            candidates |= {name: (lambda x=x, m=m: m(x)) for name, m in layers.items()}
            sets[f"{index}@{batch}"] = candidates
    timed = list(fastest_ms(sets).values())
    fp32_ms = sum(min(t for name, t in ms.items() if name.startswith(FP32_PREFIX)) for ms in timed)
    totals = {"fp32": fp32_ms} | {name: sum(ms[name] for ms in timed) for name in backends}
    best = min(backends, key=lambda name: totals[name])
    return {
        "backend": best,
        "ms": {name: round(total, 3) for name, total in totals.items()},
        "speedup": round(totals["fp32"] / max(totals[best], 1e-9), 2),
    }


def choose_int8_backend(shapes: list[tuple[int, int]]) -> dict[str, object]:
    """The fastest int8 backend for these [out, in] linear shapes on this machine (measured once,
    cached): {"backend", "ms" per candidate including fp32, "speedup" of the best over fp32}."""
    unique = sorted(set(shapes))
    # NOTE: "fp32_fastest": fp32 timed as the fastest of the engine's float32 GEMMs, not torch's
    # alone, which had overstated int8's gain (1.37x timed under the AVX2 emulation, 0.96x in
    # the 64-prompt job, and no warning).
    key = {f"{o}x{i}": 1 for o, i in unique} | {"fp32_fastest": 1}
    return cached_choice("int8_linear", key, lambda: _time_backends(unique), _is_int8_choice)


def _is_int8_choice(choice: Any) -> bool:
    """Whether a cached int8 choice is one _time_backends writes, for a GEMM exact here."""
    return (
        isinstance(choice, dict)
        and choice.get("backend") in exact_int8_backends()
        and is_number(choice.get("speedup"))
        and isinstance(choice.get("ms"), dict)
        and all(is_number(ms) for ms in choice["ms"].values())
    )


def describe_int8_choice(choice: dict[str, object]) -> str:
    ms = choice["ms"]
    assert isinstance(ms, dict)
    figures = ", ".join(f"{name} {value:.2f} ms" for name, value in ms.items())
    return (
        f"int8 linears through {choice['backend']}: {choice['speedup']}x fp32 "
        f"(layer shapes summed at batch {', '.join(map(str, TIMED_BATCHES))}: {figures})"
    )


def quantize_linears(
    model: nn.Module, skip: tuple[str, ...] = ("lm_head",), swiglu: Collection[str] = ()
) -> dict[str, object]:
    """Replace every nn.Linear in `model` (names ending in `skip` excepted) with an
    Int8DynamicLinear on the fastest backend here, in place; those named in `swiglu` are gated
    MLPs' gate/up projections, to give silu(gate) * up from the fused kernels. Returns that
    choice (choose_int8_backend) with "replaced", the number of layers replaced."""
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and not name.endswith(skip)
    ]
    choice = choose_int8_backend([tuple(m.weight.shape) for _, m in targets]) if targets else {}
    backend = str(choice.get("backend", exact_int8_backends()[0]))
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        layer = Int8DynamicLinear(module.weight, module.bias, backend, swiglu=name in swiglu)
        setattr(parent, child, layer)
    return {**choice, "replaced": len(targets)}
