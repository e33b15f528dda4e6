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
from typing import Any

import torch

from vbatch.layers import native
from vbatch.layers.kernel_choice import cached_choice, fastest_ms, is_number
from vbatch.layers.packed_store import PackedStore
from vbatch.layers.quantization import INT_MM, NATIVE, int_mm_is_exact

SCREEN_CHUNK = 4096  # vocab rows per int8 GEMM: its int32 tile stays in cache
MAX_CANDIDATES = 64  # per row; a row with more is scored in full fp32
UNIT_ROUNDOFF = 2.0**-24
BOUND_SLACK = 1.0 + 1e-5  # covers rounding in the kernel's own bound arithmetic
NORM_SLACK = 1.0 + 1e-3  # covers the rounding of the head's norms and of their scaling here
INT8_MAX = 127
# NOTE: a decode step's rows span these. Under the AVX2 emulation the screen (vbatch's int8
# GEMM) won 2.45x at 1 row and 1.29x at 4, tied at 8 and lost 0.65-0.83x from 12 to 32 rows,
# so a batch in that range is timed too: with 1, 8 and 64, rows 9-22 took batch 8's side.
TIMED_BATCHES = (1, 4, 16, 64)
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
    """Whether the screen runs here: a float32 model on CPU and the native ops (with their own
    exact int8 GEMM)."""
    return device.type == "cpu" and dtype == torch.float32 and native.is_available()


def screen_gemms() -> list[str]:
    """The exact int8 GEMMs the screen can run here: torch's `_int_mm` where it sums exactly
    (quantization.int_mm_is_exact), and vbatch's own over a packed copy of the int8 head."""
    return [INT_MM, NATIVE] if int_mm_is_exact() else [NATIVE]


class Int8GreedyScreen:
    """The int8 copy of an LM head weight [vocab, hidden] and the per-row norms its bound needs.

    Invariants: weight[v] = weight_scales[v] * q_weight[v] + r_v with residual_norms[v] >= |r_v|
    and weight_norms[v] >= |weight[v]| (2-norms, rounded up); `weight` is the fp32 head itself;
    `gemms` are the int8 GEMMs it runs (of screen_gemms()), the first by default, and
    `packed_head` is pack_int8_weight(q_weight) where NATIVE is one of them, else None.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        store: PackedStore | None = None,
        gemms: tuple[str, ...] | None = None,
    ) -> None:
        assert weight.dtype == torch.float32 and weight.device.type == "cpu"
        self.weight = weight
        self.gemms = gemms or (screen_gemms()[0],)
        assert set(self.gemms) <= set(screen_gemms()), f"{self.gemms}: not all exact here"
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
        self.packed_head = (
            torch.ops.vbatch.pack_int8_weight(q_weight) if NATIVE in self.gemms else None
        )

    def screen(
        self, hidden: torch.Tensor, max_candidates: int = MAX_CANDIDATES, gemm: str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """For [n, hidden] float32 rows: candidates [n, max_candidates] int64 (-1 padded, in
        vocab order) that hold every entry able to be the row's fp32 argmax, and per-row counts,
        -1 where the screen cannot settle the row (too many candidates, non-finite values); the
        int8 GEMM `gemm` (one of self.gemms; None: the first) gives the same result as any."""
        gemm = gemm or self.gemms[0]
        assert gemm in self.gemms
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
            self.packed_head if gemm == NATIVE else None,
        )
        return candidates, counts.masked_fill_(~torch.isfinite(norms), -1)

    def argmax(
        self,
        hidden: torch.Tensor,
        fallback: Callable[[torch.Tensor], torch.Tensor],
        max_candidates: int = MAX_CANDIDATES,
        gemm: str | None = None,
    ) -> torch.Tensor:
        """[n, hidden] float32 -> [n] int64 argmax ids, the lowest on ties; rows the screen cannot
        settle go through `fallback`, which takes and returns the same."""
        num_rows = hidden.shape[0]
        candidates, counts = self.screen(hidden, max_candidates, gemm)
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


FP32 = "fp32"


@dataclass(frozen=True)
class ScreenSides:
    """What finds each step's greedy tokens, by its row count: per timed batch, the fp32 head
    (FP32) or the screen through one of its int8 GEMMs; each timed batch decides for the row
    counts nearest it (by ratio)."""

    batches: tuple[int, ...]
    sides: tuple[str, ...]

    def serves(self, num_rows: int) -> str:
        ratios = [abs(math.log(max(num_rows, 1) / batch)) for batch in self.batches]
        return self.sides[ratios.index(min(ratios))]

    @property
    def gemms(self) -> tuple[str, ...]:
        """The screen's int8 GEMMs these sides use, in order of first use."""
        return tuple(dict.fromkeys(side for side in self.sides if side != FP32))

    def describe(self) -> str:
        if len(set(self.sides)) == 1:
            return "off" if self.sides[0] == FP32 else f"on through {self.sides[0]}"
        by_side: dict[str, list[str]] = {}
        for batch, side in zip(self.batches, self.sides, strict=True):
            by_side.setdefault("off" if side == FP32 else side, []).append(str(batch))
        return "on: " + ", ".join(
            f"{side} at batch {' and '.join(b)}" for side, b in by_side.items()
        )


def always_on() -> ScreenSides:
    """The screen at every row count, through its default int8 GEMM (--greedy-screen)."""
    return ScreenSides((1,), (screen_gemms()[0],))


def screen_sides(choice: dict[str, object]) -> ScreenSides:
    """The sides of a choose_greedy_screen result; a GEMM not exact here (a cache written under
    other conditions) leaves its batches to the fp32 head."""
    batches, sides = choice["batches"], choice["sides"]
    assert isinstance(batches, list) and isinstance(sides, list)
    exact = screen_gemms()
    return ScreenSides(tuple(batches), tuple(side if side in exact else FP32 for side in sides))


def choose_greedy_screen(
    weight: torch.Tensor, fp32_argmax: Callable[[torch.Tensor], torch.Tensor]
) -> dict[str, object]:
    """What is fastest for this [vocab, hidden] head on this machine at each of TIMED_BATCHES:
    `fp32_argmax` or the screen through one of screen_gemms(), all timed on rows with a clear
    winner, as a model's are (measured once per machine and head shape, cached). {"batches":
    TIMED_BATCHES, "sides": [FP32 or a GEMM's name, per batch], "ms": {FP32 | each GEMM's name:
    [fastest ms per batch]}}."""

    def measure() -> dict[str, object]:
        gemms = tuple(screen_gemms())
        screen = Int8GreedyScreen(weight, gemms=gemms)
        generator = torch.Generator().manual_seed(0)
        sets: dict[str, dict[str, Callable[[], object]]] = {}
        for batch in TIMED_BATCHES:
            ids = torch.randint(weight.shape[0], (batch,), generator=generator)
            rows = weight[ids] / weight[ids].norm(dim=1, keepdim=True).clamp_min(1e-12) * 4.0
            sets[str(batch)] = {FP32: lambda rows=rows: fp32_argmax(rows)} | {
                gemm: lambda rows=rows, gemm=gemm: screen.argmax(rows, fp32_argmax, gemm=gemm)
                for gemm in gemms
            }
        timed = list(fastest_ms(sets).values())
        return {
            "batches": list(TIMED_BATCHES),
            "sides": [min(by_name, key=by_name.__getitem__) for by_name in timed],
            "ms": {name: [by_name[name] for by_name in timed] for name in (FP32, *gemms)},
        }

    shape = {"vocab": weight.shape[0], "hidden": weight.shape[1]}
    return cached_choice("greedy_screen", shape, measure, _is_screen_choice)


def _is_screen_choice(choice: Any) -> bool:
    """Whether a cached screen choice has the shape `measure` writes."""
    if not isinstance(choice, dict) or choice.get("batches") != list(TIMED_BATCHES):
        return False
    sides, ms = choice.get("sides"), choice.get("ms")
    return (
        isinstance(sides, list)
        and len(sides) == len(TIMED_BATCHES)
        and all(isinstance(side, str) for side in sides)
        and isinstance(ms, dict)
        and all(
            isinstance(times, list)
            and len(times) == len(TIMED_BATCHES)
            and all(is_number(t) for t in times)
            for times in ms.values()
        )
    )


def describe_screen_choice(choice: dict[str, object], forced: bool | None) -> str:
    if forced is False:
        return "greedy screen off (forced)"
    if forced:
        return f"greedy screen on (forced; int8 GEMM {screen_gemms()[0]})"
    ms, batches = choice["ms"], choice["batches"]
    assert isinstance(ms, dict) and isinstance(batches, list)
    figures = ", ".join(
        f"{'fp32 head' if name == FP32 else name + ' screen'} "
        f"{'/'.join(f'{t:.2f}' for t in times)} ms"
        for name, times in ms.items()
    )
    return (
        f"greedy screen {screen_sides(choice).describe()} (measured at batch "
        f"{', '.join(map(str, batches))}: {figures})"
    )
