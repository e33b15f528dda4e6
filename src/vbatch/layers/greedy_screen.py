"""Greedy decoding's LM head through an int8 screen: the fp32 argmax, at int8 GEMM speed.

An int8 GEMM over the whole vocabulary gives every logit to within a rigorous error bound; the
few entries whose bound reaches the row's best lower bound are scored again in fp32 and the
best one wins. Any entry the screen drops is below another entry for certain, so the result is
the fp32 argmax (up to fp32 rounding between near-equal logits, as between any two GEMMs).

The bound, for a hidden row h and a vocab row w (w = s_w q_w + r_w, h = s1 q1 + s2 q2 + e, the
int8 parts with per-row scales, h in two int8 levels so that its residual e is tiny):

    h.w = s_w (s1 q1.q_w + s2 q2.q_w) + (h - e).r_w + e.w
    |h.w - approx| <= (|h| + |e|) |r_w| + |e| |w|          (Cauchy-Schwarz, 2-norms)

plus fp32 rounding, (d + 16) u |h| |w| for hidden size d and unit roundoff u, so that the
candidates also cover what an fp32 GEMM could round to the top.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vbatch.layers import native
from vbatch.layers.kernel_choice import cached_choice, fastest_ms
from vbatch.layers.packed_store import PackedStore
from vbatch.layers.quantization import has_int8_kernels

SCREEN_CHUNK = 4096  # vocab rows per int8 GEMM: its int32 tile stays in cache
MAX_CANDIDATES = 64  # per row; a row with more is scored in full fp32
UNIT_ROUNDOFF = 2.0**-24
BOUND_SLACK = 1.0 + 1e-5  # covers rounding in the kernel's own bound arithmetic
NORM_SLACK = 1.0 + 1e-3  # covers the rounding of the head's norms and of their scaling here
INT8_MAX = 127
# NOTE: a decode step's rows span these; under AVX2 the screen won at 1 row and lost at 64.
TIMED_BATCHES = (1, 8, 64)
# NOTE: the int8 head's names in a model's PackedStore, and the rows a mapped one is checked at.
HEAD_NAMES = ("lm_head.int8", "lm_head.int8_scales", "lm_head.residual_norms", "lm_head.norms")
PROBED_ROWS = 16


def _round_up(x: torch.Tensor) -> torch.Tensor:
    """float64 -> float32, never below the float64 value."""
    down = x.float()
    return torch.where(down.double() < x, torch.nextafter(down, torch.tensor(float("inf"))), down)


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row of `x`: (float32 scales, then the integer values and the residual
    x - scale * values, both in x's dtype: exact for float64 rows)."""
    scales = (x.abs().amax(dim=1) / INT8_MAX).float().clamp_min(torch.finfo(torch.float32).tiny)
    row_scales = scales.to(x.dtype)[:, None]
    values = torch.round(x / row_scales).clamp_(-INT8_MAX, INT8_MAX)
    return scales, values, x - row_scales * values


def _is_int8_head_of(parts: tuple[torch.Tensor, ...], weight: torch.Tensor) -> bool:
    """Whether `parts` are int8_quantize_head(weight): their shapes and dtypes, and their values
    at PROBED_ROWS rows quantized again here."""
    q_weight, *norms = parts
    vocab = weight.shape[0]
    if q_weight.dtype != torch.int8 or q_weight.shape != weight.shape:
        return False
    if any(t.dtype != torch.float32 or t.shape != (vocab,) for t in norms):
        return False
    rows = torch.randint(vocab, (PROBED_ROWS,), generator=torch.Generator().manual_seed(0))
    expected = torch.ops.vbatch.int8_quantize_head(weight[rows].contiguous())
    return all(torch.equal(got[rows], want) for got, want in zip(parts, expected, strict=True))


def can_use_greedy_screen(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the screen runs here: a float32 model on CPU, the native op, torch's int8 GEMM."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and native.is_available()
        and has_int8_kernels()
    )


class Int8GreedyScreen:
    """The int8 copy of an LM head weight [vocab, hidden] and the per-row norms its bound needs.

    Invariants: weight[v] = weight_scales[v] * q_weight[v] + r_v with residual_norms[v] >= |r_v|
    and weight_norms[v] >= |weight[v]| (2-norms, rounded up); `weight` is the fp32 head itself.
    """

    def __init__(self, weight: torch.Tensor, store: PackedStore | None = None) -> None:
        assert weight.dtype == torch.float32 and weight.device.type == "cpu"
        self.weight = weight
        # NOTE: one native pass (the torch ops this replaces took ~0.25 s at start-up for a
        # 49152-row head; the pass itself ~0.07 s, which a `store` saves); its norms are
        # float64 sums rounded up, which NORM_SLACK covers.
        head = weight.detach()
        if store is None:
            parts = torch.ops.vbatch.int8_quantize_head(head)
        else:
            parts = store.tensors(
                HEAD_NAMES,
                lambda: torch.ops.vbatch.int8_quantize_head(head),
                lambda mapped: _is_int8_head_of(mapped, head),
            )
        q_weight, scales, residual_norms, weight_norms = parts
        self.q_weight = q_weight
        self.weight_scales = scales
        self.residual_norms = residual_norms * NORM_SLACK
        self.weight_norms = weight_norms * NORM_SLACK

    def screen(
        self, hidden: torch.Tensor, max_candidates: int = MAX_CANDIDATES
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """For [n, hidden] float32 rows: candidates [n, max_candidates] int64 (-1 padded, in
        vocab order) that hold every entry able to be the row's fp32 argmax, and per-row counts,
        -1 where the screen cannot settle the row (too many candidates, non-finite values)."""
        hidden_size = hidden.shape[1]
        h = hidden.double()
        norms = h.norm(dim=1)
        scale_hi, q_hi, residual = _quantize_rows(h)
        scale_lo, q_lo, residual = _quantize_rows(residual)
        residual_norms = residual.norm(dim=1)
        rounding = (hidden_size + 16) * UNIT_ROUNDOFF
        row_params = torch.stack(
            [
                scale_hi,
                scale_lo,
                _round_up((norms + residual_norms) * BOUND_SLACK),
                _round_up((residual_norms + rounding * norms) * BOUND_SLACK),
            ],
            dim=1,
        )
        candidates, counts = torch.ops.vbatch.int8_greedy_screen(
            torch.cat([q_hi, q_lo]).to(torch.int8),
            self.q_weight,
            row_params,
            self.weight_scales,
            self.residual_norms,
            self.weight_norms,
            SCREEN_CHUNK,
            max_candidates,
        )
        return candidates, counts.masked_fill_(~torch.isfinite(norms), -1)

    def argmax(
        self,
        hidden: torch.Tensor,
        fallback: Callable[[torch.Tensor], torch.Tensor],
        max_candidates: int = MAX_CANDIDATES,
    ) -> torch.Tensor:
        """[n, hidden] float32 -> [n] int64 argmax ids, the lowest on ties; rows the screen cannot
        settle go through `fallback`, which takes and returns the same."""
        num_rows = hidden.shape[0]
        candidates, counts = self.screen(hidden, max_candidates)
        rows, slots = (candidates >= 0).nonzero(as_tuple=True)
        vocab_ids = candidates[rows, slots]
        # [num_candidates] fp32 logits
        scores = (hidden[rows] * self.weight[vocab_ids]).sum(dim=1)
        best = hidden.new_full((num_rows,), float("-inf"))
        best.scatter_reduce_(0, rows, scores, "amax")
        is_best = scores == best[rows]
        token_ids = torch.full((num_rows,), self.weight.shape[0], dtype=torch.int64)
        token_ids.scatter_reduce_(0, rows[is_best], vocab_ids[is_best], "amin")
        is_unsettled = counts < 0
        if bool(is_unsettled.any()):
            unsettled = is_unsettled.nonzero().squeeze(1)
            token_ids[unsettled] = fallback(hidden.index_select(0, unsettled))
        return token_ids


@dataclass(frozen=True)
class ScreenSides:
    """Which steps the screen serves, by their row count: each timed batch decides for the row
    counts nearest it (by ratio)."""

    batches: tuple[int, ...]
    on: tuple[bool, ...]

    def serves(self, num_rows: int) -> bool:
        ratios = [abs(math.log(max(num_rows, 1) / batch)) for batch in self.batches]
        return self.on[ratios.index(min(ratios))]

    def describe(self) -> str:
        if all(self.on) or not any(self.on):
            return "on" if self.on[0] else "off"
        on = [str(b) for b, side in zip(self.batches, self.on, strict=True) if side]
        off = [str(b) for b, side in zip(self.batches, self.on, strict=True) if not side]
        return f"on at batch {' and '.join(on)}, off at {' and '.join(off)}"


ALWAYS = ScreenSides((1,), (True,))


def screen_sides(choice: dict[str, object]) -> ScreenSides:
    """The sides of a choose_greedy_screen result."""
    batches, on = choice["batches"], choice["on"]
    assert isinstance(batches, list) and isinstance(on, list)
    return ScreenSides(tuple(batches), tuple(on))


def choose_greedy_screen(
    weight: torch.Tensor, fp32_argmax: Callable[[torch.Tensor], torch.Tensor]
) -> dict[str, object]:
    """Where the screen beats `fp32_argmax` for this [vocab, hidden] head on this machine: both
    timed on rows with a clear winner, as a model's are, at each of TIMED_BATCHES (measured once
    per machine and head shape, cached). {"batches": TIMED_BATCHES, "on": [bool per batch],
    "ms": {"screen" | "fp32": [fastest ms per batch]}}."""

    def measure() -> dict[str, object]:
        screen = Int8GreedyScreen(weight)
        generator = torch.Generator().manual_seed(0)
        sets: dict[str, dict[str, Callable[[], object]]] = {}
        for batch in TIMED_BATCHES:
            ids = torch.randint(weight.shape[0], (batch,), generator=generator)
            rows = weight[ids] / weight[ids].norm(dim=1, keepdim=True).clamp_min(1e-12) * 4.0
            sets[str(batch)] = {
                "screen": lambda rows=rows: screen.argmax(rows, fp32_argmax),
                "fp32": lambda rows=rows: fp32_argmax(rows),
            }
        timed = list(fastest_ms(sets).values())
        return {
            "batches": list(TIMED_BATCHES),
            "on": [ms["screen"] < ms["fp32"] for ms in timed],
            "ms": {name: [ms[name] for ms in timed] for name in ("screen", "fp32")},
        }

    shape = {"vocab": weight.shape[0], "hidden": weight.shape[1]}
    return cached_choice("greedy_screen", shape, measure)


def describe_screen_choice(choice: dict[str, object], forced: bool | None) -> str:
    if forced is not None:
        return f"greedy screen {'on' if forced else 'off'} (forced)"
    ms, batches = choice["ms"], choice["batches"]
    assert isinstance(ms, dict) and isinstance(batches, list)
    screen, fp32 = ("/".join(f"{t:.2f}" for t in ms[name]) for name in ("screen", "fp32"))
    return (
        f"greedy screen {screen_sides(choice).describe()} (measured at batch "
        f"{', '.join(map(str, batches))}: "
        f"screen {screen} ms, fp32 head {fp32} ms)"
    )
