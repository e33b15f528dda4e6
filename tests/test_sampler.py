"""Tests for the engine-core sampler: filters against a full-sort reference, seeds, logprobs."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

import pytest
import torch

from vbatch.engine.sampler import (
    CANDIDATE_GROWTH,
    Sampler,
    _apply_transforms,
    _draw,
    _keep_prefix,
    _nucleus_groups,
    _search,
)
from vbatch.engine.sampling_metadata import (
    NUM_CANDIDATES,
    SamplingMetadata,
    SeededUniforms,
    free_generators,
)
from vbatch.engine.sequence import Sequence
from vbatch.sampling_params import SamplingParams

VOCAB = 49152
CPU = torch.device("cpu")
# NOTE: float32 masses may decide a token within this relative distance of a top-p or min-p
# boundary either way; a float64 full sort is the reference.
BOUNDARY_TOLERANCE = 1e-5


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(num_threads)


def make_seqs(*params: SamplingParams, prompt: list[int] | None = None) -> list[Sequence]:
    return [Sequence(f"r{i}", prompt or [1, 2, 3], p) for i, p in enumerate(params)]


def sample(
    logits: torch.Tensor, seqs: list[Sequence], generators: dict | None = None, **kwargs: object
) -> torch.Tensor:
    meta = SamplingMetadata.build(
        seqs, CPU, logits.shape[1], {} if generators is None else generators, **kwargs
    )
    return Sampler()(logits, meta).token_ids


def reference_kept(
    row: torch.Tensor, p: SamplingParams, tolerance: float = 0.0
) -> tuple[set[int], set[int]]:
    """Token ids kept by temperature, then (vLLM V1's order) min-p, top-k, and top-p over what
    those two keep, renormalised, by a full sort in float64; and the ids within `tolerance`
    (relative) of a top-p or min-p boundary."""
    probs = torch.softmax(row.double() / p.temperature, dim=-1)
    sorted_probs, order = probs.sort(descending=True)
    in_top_k = torch.arange(row.numel()) < (p.top_k if p.top_k > 0 else row.numel())
    ratio = sorted_probs / sorted_probs[0]
    survives = in_top_k & (ratio >= p.min_p)
    renorm = sorted_probs * survives
    renorm /= renorm.sum()
    before = renorm.cumsum(0) - renorm
    keep = survives & (before < p.top_p)
    near = ((before - p.top_p).abs() <= tolerance) | ((ratio - p.min_p).abs() <= tolerance)
    return set(order[keep].tolist()), set(order[near & in_top_k].tolist())


def reference_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    kept = list(reference_kept(row, p)[0])
    probs = torch.zeros(row.numel(), dtype=torch.float64)
    probs[kept] = torch.softmax(row.double() / p.temperature, dim=-1)[kept]
    return probs / probs.sum()


def test_greedy_top_k_1_and_tiny_temperature_are_argmax() -> None:
    logits = torch.randn(6, VOCAB) * 3
    argmax = logits.argmax(-1)
    greedy = make_seqs(*[SamplingParams(temperature=0.0)] * 6)
    meta = SamplingMetadata.build(greedy, CPU, VOCAB, {})
    assert meta.temperature is None and meta.top_k is None and meta.penalties is None
    assert torch.equal(Sampler()(logits, meta).token_ids, argmax)
    assert torch.equal(sample(logits, make_seqs(*[SamplingParams(top_k=1)] * 6)), argmax)
    for temperature in (1e-6, 1e-3):
        tiny = make_seqs(*[SamplingParams(temperature=temperature)] * 6)
        assert torch.equal(sample(logits, tiny), argmax)
    for other in (SamplingParams(top_p=0.5), SamplingParams(), SamplingParams(min_p=0.1)):
        mixed = make_seqs(*[SamplingParams(temperature=0.0), other] * 3)
        assert torch.equal(sample(logits, mixed)[::2], argmax[::2])


def test_top_p_alone_checks_candidate_widths() -> None:
    """Only top-p can widen the candidates (a wait for the device on CUDA); top-k and min-p
    settle every row at the first width."""
    logits = torch.randn(3, VOCAB)
    rows = torch.arange(3)
    weights = (logits.topk(50).values - logits.amax(-1, keepdim=True)).exp()
    for params, can_be_short in [
        (SamplingParams(top_k=50, min_p=0.1), False),
        (SamplingParams(top_p=0.9), True),
    ]:
        meta = SamplingMetadata.build(make_seqs(*[params] * 3), CPU, VOCAB, {})
        _, is_short = _keep_prefix(weights, meta, rows, None)
        assert (is_short is not None) == can_be_short
        groups = list(_nucleus_groups(logits, meta))
        assert sorted(torch.cat([g[0] for g in groups]).tolist()) == [0, 1, 2]


@pytest.mark.gpu
def test_sampler_never_waits_for_the_gpu() -> None:
    cuda = torch.device("cuda")
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=1.2),
        SamplingParams(top_k=20, min_p=0.05, seed=1, presence_penalty=0.5),
        SamplingParams(min_p=0.1, frequency_penalty=0.3, min_tokens=4, stop_token_ids=[9]),
    ]
    seqs = make_seqs(*params)
    logits = torch.randn(len(seqs), VOCAB, device=cuda)
    cpu_meta = SamplingMetadata.build(seqs, CPU, VOCAB, {}, [2])
    expected = Sampler()(logits.cpu(), cpu_meta).to_host()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for subset in (seqs[:1], seqs[:2], seqs):
            meta = SamplingMetadata.build(subset, cuda, VOCAB, {}, [2])
            out = Sampler()(logits[: len(subset)], meta)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    token_ids, logprobs = out.to_host()
    assert token_ids[:2] == expected[0][:2]
    assert logprobs is not None and expected[1] is not None
    assert logprobs[1] is not None and expected[1][1] is not None
    assert logprobs[1].top_token_ids == expected[1][1].top_token_ids


FILTERS = [
    SamplingParams(top_k=50),
    SamplingParams(top_p=0.9),
    SamplingParams(top_p=0.95, temperature=1.5),
    SamplingParams(min_p=0.05),
    SamplingParams(top_k=200, top_p=0.8, min_p=0.01, temperature=0.7),
    SamplingParams(top_k=40, top_p=0.9),
    SamplingParams(temperature=0.0),
]


@pytest.mark.parametrize("with_unrestricted_row", [False, True])
def test_sampled_tokens_lie_in_reference_kept_set(with_unrestricted_row: bool) -> None:
    params = FILTERS + ([SamplingParams(temperature=0.9)] if with_unrestricted_row else [])
    # NOTE: rows of mixed sharpness: peaked rows resolve in the candidates, flat ones escalate.
    scales = torch.tensor([4.0, 0.5, 2.0, 1.0, 3.0, 0.2, 1.0, 1.0][: len(params)])
    for _ in range(5):
        logits = torch.randn(len(params), VOCAB) * scales.unsqueeze(1)
        tokens = sample(logits, make_seqs(*params)).tolist()
        for row, (token, p) in enumerate(zip(tokens, params, strict=True)):
            if p.temperature == 0.0:
                assert token == logits[row].argmax().item()
            else:
                kept, near = reference_kept(logits[row], p, BOUNDARY_TOLERANCE)
                assert token in kept | near


@pytest.mark.parametrize("scale", [0.05, 0.5, 2.0, 8.0])
@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.99])
def test_top_p_candidate_shortcut_is_exact(scale: float, top_p: float) -> None:
    params = [SamplingParams(top_p=top_p, temperature=t) for t in (0.5, 1.0, 2.0)]
    params += [SamplingParams(top_p=top_p, min_p=0.001), SamplingParams(top_k=3, top_p=top_p)]
    logits = torch.randn(len(params), VOCAB) * scale
    meta = SamplingMetadata.build(make_seqs(*params), CPU, VOCAB, {})
    kept: dict[int, tuple[int, set[int]]] = {}
    widths = [NUM_CANDIDATES]
    while widths[-1] < VOCAB:
        wider = widths[-1] * CANDIDATE_GROWTH
        widths.append(VOCAB if wider > VOCAB // 4 else wider)
    for rows, weights, ids in _nucleus_groups(logits, meta):
        assert torch.equal(weights > 0, ids < VOCAB)
        for row, row_ids in zip(rows.tolist(), ids, strict=True):
            assert row not in kept
            kept[row] = (ids.shape[1], set(row_ids[row_ids < VOCAB].tolist()))
    for row, p in enumerate(params):
        width, kept_ids = kept[row]
        expected, near = reference_kept(logits[row], p, BOUNDARY_TOLERANCE)
        assert kept_ids ^ expected <= near
        # NOTE: a row leaves at the first candidate width that holds its whole nucleus.
        assert width == min(w for w in widths if w >= len(expected))
    if scale <= 0.5:
        assert max(len(kept[row][1]) for row in range(4)) > CANDIDATE_GROWTH * NUM_CANDIDATES


DISTRIBUTION_CASES = [
    SamplingParams(temperature=0.7),
    SamplingParams(top_k=5),
    SamplingParams(top_p=0.7, temperature=1.3),
    SamplingParams(min_p=0.2),
    SamplingParams(top_k=8, top_p=0.9, min_p=0.05),
]


@pytest.mark.parametrize("p", DISTRIBUTION_CASES)
@pytest.mark.parametrize("with_unrestricted_row", [False, True])
def test_empirical_distribution_matches_filtered(
    p: SamplingParams, with_unrestricted_row: bool
) -> None:
    vocab, num_rows, num_calls = 16, 1000, 10
    row = torch.randn(vocab) * 1.5
    params = [p] * num_rows + ([SamplingParams()] if with_unrestricted_row else [])
    logits = row.expand(len(params), vocab).contiguous()
    seqs = make_seqs(*params)
    counts = torch.zeros(vocab, dtype=torch.float64)
    for _ in range(num_calls):
        tokens = sample(logits, seqs)[:num_rows]
        counts += torch.bincount(tokens, minlength=vocab).double()
    expected = reference_probs(row, p) * num_rows * num_calls
    assert counts[expected == 0].sum() == 0
    kept = expected > 0
    chi2 = ((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum().item()
    dof = int(kept.sum()) - 1
    assert chi2 < dof + 6 * math.sqrt(2 * max(dof, 1)) + 10, (chi2, dof)


def test_draw_is_an_exact_inverse_cdf() -> None:
    width, num_draws = 600, 4000  # NOTE: 600 is not a multiple of DRAW_BLOCK: pads 3 blocks
    weights = torch.rand(width) * (torch.rand(width) > 0.3)
    uniforms = (torch.arange(num_draws) + 0.5) / num_draws  # stratified: counts are exact
    columns = _draw(weights.expand(num_draws, width).contiguous(), uniforms).squeeze(1)
    counts = torch.bincount(columns, minlength=width).double()
    assert counts[weights == 0].sum() == 0
    assert (counts - weights / weights.sum() * num_draws).abs().max() <= 1.5
    edges = _draw(weights.expand(2, width).contiguous(), torch.tensor([0.0, 1 - 2**-24]))
    assert weights[edges.squeeze(1)].min() > 0


def test_search_never_lands_on_a_zero_weight_tail() -> None:
    cdf = torch.tensor([[1.0, 2.0, 2.0, 2.0]])  # weights 1, 1, 0, 0
    assert _search(cdf, torch.tensor([[2.0]])).item() == 1
    assert _search(cdf, torch.tensor([[0.5]])).item() == 0


def test_penalties_follow_the_formula() -> None:
    vocab = 10
    rep = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2)
    params = [rep, SamplingParams(), SamplingParams(presence_penalty=-0.4)]
    seqs = make_seqs(*params, prompt=[1, 2, 2, 5])
    for seq in seqs:
        for token in (2, 3, 3, 3):
            seq.append_token(token)
    logits = torch.randn(3, vocab) * 2
    logits[0, 1], logits[0, 3] = 1.5, -0.7
    penalized = _apply_transforms(logits, SamplingMetadata.build(seqs, CPU, vocab, {}))
    output_counts = {2: 1, 3: 3}
    expected = logits.clone()
    for token in range(vocab):
        value = logits[0, token].item()
        if token in (1, 2, 3, 5):
            value = value / 1.3 if value > 0 else value * 1.3
        count = output_counts.get(token, 0)
        expected[0, token] = value - 0.5 * count - 0.2 * (count > 0)
        expected[2, token] += 0.4 * (count > 0)
    torch.testing.assert_close(penalized, expected)
    assert penalized[0, 1] == pytest.approx(1.5 / 1.3) and penalized[0, 3] < -0.7 * 1.3 - 1.6


def test_logit_bias_comes_before_the_repetition_penalty() -> None:
    """vLLM V1's order: (logit + bias) / penalty, so a biased repeated token loses here."""
    vocab = 10
    logits = torch.full((1, vocab), -5.0)
    logits[0, 1], logits[0, 2] = 0.29, 0.0
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0, logit_bias={1: 1.71, 2: 1.2})
    seqs = make_seqs(p, prompt=[1, 3])
    meta = SamplingMetadata.build(seqs, CPU, vocab, {})
    transformed = _apply_transforms(logits, meta)
    assert transformed[0, 1].item() == pytest.approx((0.29 + 1.71) / 2.0)
    assert transformed[0, 2].item() == pytest.approx(1.2)
    assert Sampler()(logits, meta).token_ids.tolist() == [2]


@pytest.mark.parametrize(
    "params",
    [
        {"repetition_penalty": 1e-38},
        {"repetition_penalty": 1e-38, "top_p": 0.9},
        {"repetition_penalty": 1e-38, "top_k": 5},
        {"logit_bias": {1: 3e38}, "temperature": 0.1},
        {"logit_bias": {1: 3e38}, "temperature": 0.1, "top_p": 0.5},
    ],
)
def test_a_bias_or_penalty_past_float32_still_draws_its_token(params: dict) -> None:
    """A repetition_penalty of 1e-38 divided a seen token's positive logit to inf, and a huge
    bias over a small temperature overflowed too: the softmax read NaN and the draw gave token
    0 or the padding id (vocab_size). The token they favour is drawn now."""
    vocab = 10
    logits = torch.zeros(2, vocab)
    logits[:, 1] = 2.0
    p = SamplingParams(**{"temperature": 1.0, "seed": 3, **params})
    seqs = make_seqs(p, p, prompt=[1, 3])
    meta = SamplingMetadata.build(seqs, CPU, vocab, {})
    assert torch.isfinite(_apply_transforms(logits, meta) / 1e-5).all()
    assert Sampler()(logits, meta).token_ids.tolist() == [1, 1]


def test_min_p_comes_before_top_p() -> None:
    """vLLM V1's order: min-p, then top-p over what it keeps. Probabilities 0.5, 0.3, 0.1, 0.1:
    min-p 0.3 keeps the first two (0.625, 0.375 renormalised), and top-p 0.6 then the first
    only; top-p over the raw mass would have kept both."""
    vocab = 300
    logits = torch.full((1, vocab), -1e9)
    logits[0, :4] = torch.tensor([0.5, 0.3, 0.1, 0.1]).log()
    for k in (0, 3, 200):
        p = SamplingParams(min_p=0.3, top_p=0.6, top_k=k, seed=0)
        seqs = make_seqs(*[p] * 64)
        for seq, seed in zip(seqs, range(64), strict=True):
            seq.params = SamplingParams(min_p=0.3, top_p=0.6, top_k=k, seed=seed)
        assert set(sample(logits.expand(64, vocab).contiguous(), seqs).tolist()) == {0}


def test_a_row_left_with_no_token_is_flagged_and_reads_token_zero() -> None:
    """allowed_token_ids all among the bans: every sampling mode gives token 0 and flags the
    row (the core ends its request); the other rows sample as ever."""
    vocab = 300
    logits = torch.randn(4, vocab)
    logits[:, 7] = 10.0
    stuck = dict(allowed_token_ids=[5], bad_words_token_ids=[[5]])
    params = [
        SamplingParams(temperature=0.0, **stuck),
        SamplingParams(top_p=0.5, seed=1, **stuck),
        SamplingParams(top_k=3, min_p=0.1, seed=2, **stuck),
        SamplingParams(temperature=0.0),
    ]
    meta = SamplingMetadata.build(make_seqs(*params), CPU, vocab, {})
    out = Sampler()(logits, meta)
    token_ids, _ = out.to_host()
    assert token_ids == [0, 0, 0, 7]
    assert out.exhausted_rows == [0, 1, 2]


def test_min_tokens_bars_eos_and_stop_ids() -> None:
    logits = torch.zeros(2, 10)
    logits[:, 7] = 5.0
    logits[:, 4] = 4.0
    logits[:, 2] = 3.0
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[4])
    seqs = make_seqs(p, SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True))
    # NOTE: as vLLM, min_tokens bars EOS under ignore_eos too (it would not stop, but is held off).
    assert sample(logits, seqs, eos_token_ids=[7]).tolist() == [2, 4]
    for seq in seqs:
        seq.append_token(0)
        seq.append_token(0)
    assert sample(logits, seqs, eos_token_ids=[7]).tolist() == [7, 7]


def run_seeded(
    target: SamplingParams,
    neighbours: list[SamplingParams],
    steps: list[torch.Tensor],
    index: int = 0,
) -> list[int]:
    """Tokens of a fresh `target` seq over `steps`, batched with shuffled `neighbours`."""
    rng = random.Random(len(neighbours))
    seq = Sequence("target", [1, 2, 3], target, index=index)
    others = make_seqs(*neighbours)
    generators: dict[int, SeededUniforms] = {}
    tokens = []
    for step_logits in steps:
        batch = [seq, *others]
        rng.shuffle(batch)
        logits = torch.randn(len(batch), VOCAB) * 2
        row = batch.index(seq)
        logits[row] = step_logits
        token = sample(logits, batch, generators)[row].item()
        seq.append_token(token)
        tokens.append(token)
    free_generators(generators, [seq.seq_id])
    assert seq.seq_id not in generators
    return tokens


@pytest.mark.parametrize(
    "target",
    [
        SamplingParams(seed=123, temperature=0.8, top_p=0.9),
        SamplingParams(seed=7, top_k=30, min_p=0.01),
        SamplingParams(seed=99),
    ],
)
def test_seeded_seq_ignores_its_batch(target: SamplingParams) -> None:
    steps = [torch.randn(VOCAB) * s for s in torch.linspace(0.3, 3.0, 20).tolist()]
    for step in steps[::3]:
        # NOTE: exact ties: top-k orders them differently for different candidate widths.
        step[torch.randperm(VOCAB)[:20]] = step.max() + 1.0
    alone = run_seeded(target, [], steps)
    neighbours = [
        SamplingParams(seed=5),
        SamplingParams(seed=123, top_k=3),
        SamplingParams(),
        SamplingParams(temperature=0.0),
        SamplingParams(top_p=0.5, temperature=0.3),
        SamplingParams(top_k=400, seed=1),
        SamplingParams(min_p=0.1, presence_penalty=0.5),
        SamplingParams(temperature=0.0, seed=3, logprobs=2),
    ]
    assert run_seeded(target, neighbours, steps) == alone
    assert run_seeded(target, neighbours[::-1][:5], steps) == alone
    assert run_seeded(target, [], steps, index=1) != alone  # n > 1: samples differ


def test_seeds_differing_only_in_their_high_bits_sample_apart() -> None:
    """torch's CPU generator keeps a seed's low 32 bits: 5, 5 + 2**32, 5 + 2**40 and 5 - 2**63
    drew the same samples. Every bit counts, and a seed's draws are uniform on [0, 1)."""
    seeds = [5, 5 + 2**32, 5 + 2**40, 5 - 2**63, 2**63 - 1, -1, 6]

    def stream(seed: int) -> list[float]:
        draws = SeededUniforms(seed)
        return [draws.next() for _ in range(8)]

    streams = [stream(seed) for seed in seeds]
    assert len({tuple(stream) for stream in streams}) == len(seeds)
    assert stream(5) == streams[0]
    draws = SeededUniforms(123)
    values = torch.tensor([draws.next() for _ in range(20000)])
    assert float(values.min()) >= 0.0 and float(values.max()) < 1.0
    assert abs(float(values.mean()) - 0.5) < 0.01
    assert float(torch.histc(values, bins=10, min=0, max=1).min()) > 1800
    flat = torch.zeros(VOCAB)
    low, high = (run_seeded(SamplingParams(seed=seed), [], [flat] * 6) for seed in seeds[:2])
    assert low != high


def test_logprobs_are_raw_and_sorted() -> None:
    params = [
        SamplingParams(logprobs=5, temperature=0.5, repetition_penalty=1.5),
        SamplingParams(),
        SamplingParams(logprobs=0, temperature=0.0),
        SamplingParams(logprobs=20, top_k=10),
    ]
    logits = torch.randn(len(params), VOCAB)
    logits[0, 2] = 8.0  # NOTE: a prompt token: the penalty would move its logprob a lot
    meta = SamplingMetadata.build(make_seqs(*params), CPU, VOCAB, {})
    assert meta.logprob_rows_cpu == [0, 2, 3] and meta.num_logprobs == [5, 0, 20]
    token_ids, logprobs = Sampler()(logits, meta).to_host()
    assert logprobs is not None and logprobs[0] is not None
    assert logprobs[0].top_token_ids[0] == 2
    raw = torch.log_softmax(logits.double(), dim=-1)
    assert logprobs[1] is None
    for row, p in enumerate(params):
        lp = logprobs[row]
        if p.logprobs is None:
            continue
        assert lp is not None
        assert lp.logprob == pytest.approx(raw[row, token_ids[row]].item(), abs=1e-4)
        top_vals, top_ids = raw[row].topk(p.logprobs)
        assert lp.top_token_ids == top_ids.tolist()
        assert lp.top_logprobs == pytest.approx(top_vals.tolist(), abs=1e-4)
        assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
        assert lp.rank == int((raw[row] > raw[row, token_ids[row]]).sum()) + 1
    no_logprobs = SamplingMetadata.build(make_seqs(SamplingParams()), CPU, VOCAB, {})
    out = Sampler()(logits[:1], no_logprobs)
    assert out.chosen_logprobs is None and out.to_host()[1] is None
