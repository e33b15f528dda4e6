"""The int8 greedy screen: it gives the fp32 argmax on real and adversarial rows."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from vbatch.config import EngineConfig
from vbatch.engine import model_runner
from vbatch.engine.core import EngineCore
from vbatch.layers import greedy_screen, kernel_choice
from vbatch.layers.greedy_screen import (
    FP32,
    SCREEN_CHUNK,
    Int8GreedyScreen,
    can_use_greedy_screen,
    choose_greedy_screen,
    screen_gemms,
)
from vbatch.layers.quantization import INT_MM, NATIVE
from vbatch.models.loader import ResolvedModel


@pytest.fixture(scope="module")
def ops() -> None:
    if not can_use_greedy_screen(torch.device("cpu"), torch.float32):
        pytest.skip("needs the native kernels")


@pytest.fixture(params=[INT_MM, NATIVE])
def gemm(ops: None, request: pytest.FixtureRequest) -> str:
    """Each exact int8 GEMM the screen can run here (torch's only where it sums exactly)."""
    if request.param not in screen_gemms():
        pytest.skip(f"{request.param} is not exact here")
    return request.param


def fp32_argmax(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    def argmax(hidden: torch.Tensor) -> torch.Tensor:
        return (hidden @ weight.t()).argmax(dim=1)

    return argmax


def random_head(vocab: int, hidden: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, hidden, generator=gen) * 0.05


@pytest.fixture(scope="module")
def smollm2_rows(smollm2: ResolvedModel, smollm2_hf: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """SmolLM2's tied LM head and the final hidden states of a few real prompts and outputs."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2.hf_dir, padding_side="left")
    texts = [
        "The capital of France is Paris. The capital of Italy is",
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
        "Once upon a time, in a small village by the sea, there lived",
        "1, 1, 2, 3, 5, 8, 13, 21, 34,",
    ]
    # NOTE: one left-padded batch; the rows are every position that is not padding.
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    with torch.inference_mode():
        out = smollm2_hf.generate(**batch, max_new_tokens=24, do_sample=False)
        mask = torch.cat(
            [batch.attention_mask, out[:, batch.input_ids.shape[1] :] != tokenizer.pad_token_id],
            dim=1,
        )
        states = smollm2_hf(out, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
    head = smollm2_hf.get_output_embeddings().weight.detach().clone()
    return head, states[mask.bool()]


def test_matches_fp32_argmax_on_smollm2(gemm: str, smollm2_rows: tuple) -> None:
    weight, hidden = smollm2_rows
    screen = Int8GreedyScreen(weight, gemms=(gemm,))
    candidates, counts = screen.screen(hidden)
    assert (counts >= 1).all()
    assert counts.float().median() <= 8, "the screen should leave only a few candidates"
    expected = (hidden.double() @ weight.double().t()).argmax(dim=1)
    assert (candidates == expected[:, None]).any(dim=1).all()
    assert torch.equal(screen.argmax(hidden, fp32_argmax(weight)), (hidden @ weight.t()).argmax(1))


def test_exact_tie_across_chunks_picks_the_lowest_id(gemm: str) -> None:
    weight = random_head(3 * SCREEN_CHUNK + 5, 64)
    weight[SCREEN_CHUNK + 7] = weight[7]
    weight[3 * SCREEN_CHUNK + 2] = weight[7]
    hidden = torch.randn(5, 64)
    hidden[0] = 10 * weight[7]
    got = Int8GreedyScreen(weight, gemms=(gemm,)).argmax(hidden, fp32_argmax(weight))
    assert got[0] == 7
    assert torch.equal(got, (hidden @ weight.t()).argmax(1))


def test_gap_far_below_the_int8_error_is_resolved(gemm: str) -> None:
    """Two entries 1e-3 apart (int8 error here is ~0.1): the larger one wins, wherever it sits."""
    weight = random_head(2 * SCREEN_CHUNK, 256, seed=1)
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(6, 256, generator=gen)
    hidden[:, 3] = 40.0  # an outlier channel, as real hidden states have
    pairs = [(5, SCREEN_CHUNK + 9), (SCREEN_CHUNK + 20, 30), (100, 101)]
    for row, (low, high) in enumerate(pairs):
        h = hidden[row]
        weight[low] = 3 * h / h.norm() ** 2 * 10
        weight[high] = weight[low] + 1e-3 * h / h.norm() ** 2
    exact = hidden.double() @ weight.double().t()
    for row, (_, high) in enumerate(pairs):
        assert exact[row].argmax() == high
    got = Int8GreedyScreen(weight, gemms=(gemm,)).argmax(hidden, fp32_argmax(weight))
    assert torch.equal(got, (hidden @ weight.t()).argmax(1))
    assert [got[row].item() for row in range(len(pairs))] == [high for _, high in pairs]


def test_unsettled_rows_go_through_the_fallback(gemm: str) -> None:
    weight = random_head(SCREEN_CHUNK + 100, 64, seed=3)
    hidden = torch.randn(7, 64)
    hidden[2, 5] = float("nan")
    screen = Int8GreedyScreen(weight, gemms=(gemm,))
    reference = fp32_argmax(weight)
    fallback_rows: list[int] = []

    def fallback(rows: torch.Tensor) -> torch.Tensor:
        fallback_rows.append(rows.shape[0])
        return reference(rows)

    got = screen.argmax(hidden, fallback)
    assert fallback_rows == [1]
    settled = [r for r in range(7) if r != 2]
    assert torch.equal(got[settled], reference(hidden[settled]))
    fallback_rows.clear()
    weight[:10] = weight[10]  # 11 equal entries: more candidates than a row may keep
    screen = Int8GreedyScreen(weight, gemms=(gemm,))
    tied = torch.stack([10 * weight[10], hidden[0], 5 * weight[10]])
    got = screen.argmax(tied, fallback, max_candidates=4)
    assert fallback_rows == [2]
    assert got.tolist() == [0, reference(hidden[:1]).item(), 0]


def test_opcheck(gemm: str) -> None:
    weight = random_head(SCREEN_CHUNK + 300, 64)
    screen = Int8GreedyScreen(weight, gemms=(gemm,))
    q_hidden = torch.randint(-127, 128, (6, 64), dtype=torch.int8)
    row_params = torch.tensor([[0.01, 1e-4, 3.0, 0.01]] * 3)
    torch.library.opcheck(
        torch.ops.vbatch.int8_greedy_screen.default,
        (
            q_hidden,
            screen.q_weight,
            row_params,
            screen.weight_scales,
            screen.residual_norms,
            screen.weight_norms,
            1024,
            16,
            screen.packed_head,
        ),
    )


def test_the_int8_head_matches_torch_and_its_norms_bound_the_exact_ones(ops: None) -> None:
    weight = random_head(3000, 96, seed=4)
    weight[5] = 0.0
    weight[6, 7] = 1e3  # one outlier: the row's other values quantize to zero
    screen = Int8GreedyScreen(weight)
    # NOTE: the torch formula the screen keeps for hidden rows, on the head it replaced it for.
    scales, values, _ = greedy_screen._quantize_rows(weight)
    assert torch.equal(screen.weight_scales, scales)
    assert torch.equal(screen.q_weight, values.to(torch.int8))
    residual = weight.double() - scales.double()[:, None] * values.double()
    for bound, exact in [
        (screen.residual_norms, residual.norm(dim=1)),
        (screen.weight_norms, weight.double().norm(dim=1)),
    ]:
        assert (bound.double() >= exact).all()
        assert (bound.double() <= exact * (1 + 2e-3) + 1e-30).all()
    torch.library.opcheck(torch.ops.vbatch.int8_quantize_head.default, (weight,))


def test_a_cached_side_whose_gemm_is_not_exact_here_goes_to_the_fp32_head(
    ops: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(greedy_screen, "screen_gemms", lambda: [NATIVE])
    choice = {"batches": [1, 64], "sides": [NATIVE, INT_MM], "ms": {}}
    assert greedy_screen.screen_sides(choice).sides == (NATIVE, FP32)


def test_unavailable_without_float32_cpu() -> None:
    assert not can_use_greedy_screen(torch.device("cpu"), torch.bfloat16)
    assert not can_use_greedy_screen(torch.device("meta"), torch.float32)


def test_the_screen_choice_is_measured_once_per_machine_and_cached(
    ops: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VBATCH_CACHE_DIR", str(tmp_path))
    # NOTE: timed as on a quiet machine, so the cached decision is final (test_kernel_choice.py
    # covers one timed under load).
    monkeypatch.setattr(kernel_choice, "free_cpus_while", lambda work, *_: (work(), 64.0))
    weight = random_head(8192, 64)
    choice = choose_greedy_screen(weight, fp32_argmax(weight))
    assert choice["batches"] == list(greedy_screen.TIMED_BATCHES)
    names = [FP32, *screen_gemms()]
    assert list(choice["ms"]) == names
    for name in names:
        assert len(choice["ms"][name]) == len(choice["batches"]) and min(choice["ms"][name]) > 0
    # NOTE: each timed batch takes the fastest of the fp32 head and the screen's GEMMs there.
    assert choice["sides"] == [
        min(names, key=lambda name: choice["ms"][name][i]) for i in range(len(choice["batches"]))
    ]
    (cached,) = (tmp_path / "kernel_choices").glob("greedy_screen-*.json")
    assert json.loads(cached.read_text())["key"]["machine"]["capability"]

    def no_timing(candidates: object) -> dict[str, float]:
        raise AssertionError("measured again")

    monkeypatch.setattr(greedy_screen, "fastest_ms", no_timing)
    assert choose_greedy_screen(weight, fp32_argmax(weight)) == choice
    # NOTE: another build of the native kernels is timed again.
    this_build = kernel_choice.library_key
    monkeypatch.setattr(kernel_choice, "library_key", lambda: "another build")
    with pytest.raises(AssertionError, match="measured again"):
        choose_greedy_screen(weight, fp32_argmax(weight))
    monkeypatch.setattr(kernel_choice, "library_key", this_build)
    assert choose_greedy_screen(weight, fp32_argmax(weight)) == choice
    # NOTE: under another ISA switch (the AVX2 emulation) the choice is another machine's.
    other_isa = "SSE41" if os.environ.get("ONEDNN_MAX_CPU_ISA") == "AVX2" else "AVX2"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", other_isa)
    with pytest.raises(AssertionError, match="measured again"):
        choose_greedy_screen(weight, fp32_argmax(weight))


@pytest.mark.parametrize(
    ("forced", "measured"),
    [
        (None, [FP32, FP32]),
        (None, [NATIVE, NATIVE]),
        (None, [NATIVE, FP32]),
        (None, [NATIVE, INT_MM]),
        (True, [FP32, FP32]),
    ],
)
def test_the_engine_takes_the_measured_sides_unless_forced(
    ops: None,
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    forced: bool | None,
    measured: list[str],
) -> None:
    """Measured, each step takes the side (the fp32 head, or the screen through one of its int8
    GEMMs) timed fastest at the batch nearest its row count; forced on, the screen serves every
    step through its default GEMM."""
    if not set(measured) <= {FP32, *screen_gemms()}:
        pytest.skip("torch._int_mm is not exact here")
    ms = {FP32: [3.0, 20.0], NATIVE: [2.0, 30.0]} | (
        {INT_MM: [2.5, 10.0]} if INT_MM in measured else {}
    )
    calls: list[int] = []

    def choose(weight: torch.Tensor, fallback: object) -> dict[str, object]:
        calls.append(1)
        return {"batches": [1, 64], "sides": measured, "ms": ms}

    monkeypatch.setattr(model_runner, "choose_greedy_screen", choose)
    config = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=16, greedy_screen=forced)
    core = EngineCore(config)
    model = core.runner.model
    sides = [screen_gemms()[0]] * 2 if forced else measured
    used = list(dict.fromkeys(side for side in sides if side != FP32))
    assert (model.greedy_screen is not None) == bool(used)
    assert len(calls) == (forced is None)
    (note,) = [n for n in core.info.kernels if n.startswith("greedy screen")]
    if forced is None:
        described = {
            (FP32, FP32): "off",
            (NATIVE, NATIVE): "on through native",
            (NATIVE, FP32): "on: native at batch 1, off at batch 64",
            (NATIVE, INT_MM): "on: native at batch 1, int_mm at batch 64",
        }[tuple(measured)]
        figures = ", ".join(
            f"{'fp32 head' if name == FP32 else name + ' screen'} {times[0]:.2f}/{times[1]:.2f} ms"
            for name, times in ms.items()
        )
        assert note == f"greedy screen {described} (measured at batch 1, 64: {figures})"
    else:
        assert note == f"greedy screen on (forced; int8 GEMM {screen_gemms()[0]})"
    if model.greedy_screen is None:
        return
    assert list(model.greedy_screen.gemms) == used
    served: list[tuple[int, str]] = []
    screen_argmax = model.greedy_screen.argmax

    def counted(hidden: torch.Tensor, fallback: object, gemm: str) -> torch.Tensor:
        served.append((hidden.shape[0], gemm))
        return screen_argmax(hidden, fallback, gemm=gemm)

    monkeypatch.setattr(model.greedy_screen, "argmax", counted)
    hidden = torch.randn(64, model.lm_head_weight.shape[1])
    rows_served = (1, 6, 10, 40, 64)
    for rows in rows_served:
        expected = model._greedy_token_ids_fp32(hidden[:rows])
        assert torch.equal(model.greedy_token_ids(hidden[:rows]), expected)
    # NOTE: 8 is the ratio midpoint of 1 and 64.
    nearest = [sides[0] if rows < 8 else sides[-1] for rows in rows_served]
    assert served == [(r, side) for r, side in zip(rows_served, nearest) if side != FP32]
