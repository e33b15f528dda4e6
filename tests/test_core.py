"""EngineCore: token-exact with HF on the real SmolLM2 weights in every scheduling mode; its
request handling (errors, finishes, aborts, seeds, samples, async scheduling) on the tiny
model."""

from __future__ import annotations

import dataclasses
import random

import pytest

from vbatch.config import EngineConfig
from vbatch.engine.core import EngineCore
from vbatch.errors import ConfigError
from vbatch.layers import native
from vbatch.protocol import AddRequest, EngineOutputs, FinishReason, SampleFinish, pack_token_ids
from vbatch.sampling_params import SamplingParams

NUM_TOKENS = 32


def run(core: EngineCore, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    tokens: dict[str, list[int]] = {}
    for i, ids in enumerate(prompts):
        assert core.add_request(AddRequest(f"r{i}", pack_token_ids(ids), params)) == []
    while core.has_unfinished():
        out = core.step()
        for rid, token_id in zip(out.request_ids, out.token_ids, strict=True):
            tokens.setdefault(rid, []).append(token_id)
    return [tokens[f"r{i}"] for i in range(len(prompts))]


GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
ENGINE_PATHS = pytest.mark.parametrize(
    "overrides",
    [
        {"greedy_screen": True},
        {"max_num_batched_tokens": 16},
        {"num_kv_blocks": 24},
        {"enable_prefix_caching": False},
        {"greedy_screen": False},
    ],
    ids=["batched", "chunked-prefill-16", "preemption", "no-prefix-cache", "no-greedy-screen"],
)


def check_greedy_matches_hf(
    smollm2,
    prompts: list[list[int]],
    assert_greedy_matches_hf,
    overrides: dict,
    num_tokens: int,
) -> None:
    core = EngineCore(EngineConfig(model=str(smollm2.hf_dir), **overrides))
    forced = overrides.get("greedy_screen")
    measured_on = any(note.startswith("greedy screen on") for note in core.runner.kernel_notes)
    expected_on = native.is_available() and (measured_on if forced is None else forced)
    assert (core.runner.model.greedy_screen is not None) == expected_on
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    got = run(core, prompts, params)
    assert_greedy_matches_hf(prompts, got)
    stats = core.stats()
    if "num_kv_blocks" in overrides:
        assert stats.num_preemptions > 0
    if overrides.get("max_num_batched_tokens") == 16:
        assert stats.num_steps >= sum(map(len, prompts)) // 16


@ENGINE_PATHS
def test_greedy_matches_hf(smollm2, prompts, assert_greedy_matches_hf, overrides) -> None:
    """Every engine path on 5 of the prompts, 16 tokens each (with a KV cache of half the 20
    blocks they take together); test_greedy_matches_hf_full_size is the full-size run."""
    if "num_kv_blocks" in overrides:
        overrides = {"num_kv_blocks": 10}
    check_greedy_matches_hf(smollm2, prompts[:5], assert_greedy_matches_hf, overrides, 16)


@pytest.mark.slow
@ENGINE_PATHS
def test_greedy_matches_hf_full_size(smollm2, prompts, assert_greedy_matches_hf, overrides) -> None:
    """The 16 prompts, 32 tokens each (minutes at a 16-token step budget on a busy host)."""
    check_greedy_matches_hf(smollm2, prompts, assert_greedy_matches_hf, overrides, NUM_TOKENS)


def test_prefix_cache_hits_give_same_tokens(smollm2, prompts, assert_greedy_matches_hf) -> None:
    core = EngineCore(EngineConfig(model=str(smollm2.hf_dir)))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    # NOTE: one token is enough to compute, and so cache, every prompt block.
    run(core, prompts[:6], params.updated({"max_tokens": 1}))
    hits_before = core.stats().prefix_cache_hits
    got = run(core, prompts[:6], params)
    assert core.stats().prefix_cache_hits > hits_before
    assert_greedy_matches_hf(prompts[:6], got)


def test_seeded_sampling_is_batch_invariant(tiny_model_dir, prompts) -> None:
    core = EngineCore(EngineConfig(model=str(tiny_model_dir)))
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    alone = run(core, prompts[:1], seeded)[0]
    others = [
        SamplingParams(temperature=1.0, max_tokens=24, seed=None if i % 2 else i) for i in range(8)
    ]
    for i, params in enumerate(others):
        core.add_request(AddRequest(f"other{i}", pack_token_ids(prompts[i + 1]), params))
    core.add_request(AddRequest("target", pack_token_ids(prompts[0]), seeded))
    tokens: list[int] = []
    while core.has_unfinished():
        out = core.step()
        tokens += [t for rid, t in zip(out.request_ids, out.token_ids) if rid == "target"]
    assert tokens == alone


def test_n_samples_share_prompt_blocks(tiny_model_dir, prompts) -> None:
    core = EngineCore(EngineConfig(model=str(tiny_model_dir)))
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    core.add_request(AddRequest("multi", pack_token_ids(prompts[2]), params))
    samples: dict[int, list[int]] = {}
    finished = set()
    while core.has_unfinished():
        out = core.step()
        for index, token_id in zip(out.indices, out.token_ids, strict=True):
            samples.setdefault(index, []).append(token_id)
        finished.update(f.index for f in out.finished if f.request_id == "multi")
    assert finished == {0, 1, 2}
    assert all(len(v) == 8 for v in samples.values())
    assert len({tuple(v) for v in samples.values()}) > 1
    full_blocks = len(prompts[2]) // 16
    assert core.stats().prefix_cache_hits >= 2 * full_blocks


def test_bad_requests_fail_alone(tiny_model_dir, prompts) -> None:
    core = EngineCore(EngineConfig(model=str(tiny_model_dir), max_model_len=64))
    too_long = core.add_request(AddRequest("long", pack_token_ids([5] * 80), GREEDY))
    empty = core.add_request(AddRequest("empty", pack_token_ids([]), GREEDY))
    bad_id = core.add_request(AddRequest("bad", pack_token_ids([10**6]), GREEDY))
    for finishes in (too_long, empty, bad_id):
        assert len(finishes) == 1 and finishes[0].finish_reason == FinishReason.ERROR
        assert finishes[0].error
    assert "64" in too_long[0].error
    short = [5, 6, 7]
    got = run(core, [short], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
    assert len(got[0]) == 64 - len(short)


def test_a_max_model_len_beyond_the_model_is_refused(tiny_model_dir) -> None:
    """As vLLM, not capped silently: the tiny model places 512 positions."""
    with pytest.raises(ConfigError, match="max_model_len 513 is more than the model's"):
        EngineCore(EngineConfig(model=str(tiny_model_dir), max_model_len=513))
    core = EngineCore(EngineConfig(model=str(tiny_model_dir), max_model_len=512))
    assert core.max_model_len == 512


def test_finish_reasons_and_abort(smollm2, prompts) -> None:
    """On SmolLM2, whose greedy output holds new tokens to stop at (the tiny model's repeats)."""
    core = EngineCore(EngineConfig(model=str(smollm2.hf_dir)))
    num_tokens = 16
    greedy = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    ref_tokens = run(core, prompts[:1], greedy)[0]
    stop_pos = next(p for p in range(3, num_tokens) if ref_tokens[p] not in ref_tokens[:p])
    stop_token = ref_tokens[stop_pos]
    steps: list[EngineOutputs] = []
    finishes: list[SampleFinish] = []
    core.add_request(AddRequest("len", pack_token_ids(prompts[0]), greedy))
    stop_params = SamplingParams(
        temperature=0.0, max_tokens=num_tokens, stop_token_ids=[stop_token]
    )
    core.add_request(AddRequest("stoptok", pack_token_ids(prompts[0]), stop_params))
    core.add_request(AddRequest("abort", pack_token_ids(prompts[1]), greedy))
    steps.append(core.step())
    finishes += core.abort(["abort", "abort", "unknown"])
    while core.has_unfinished():
        steps.append(core.step())
    finishes += [f for out in steps for f in out.finished]
    final = {f.request_id: f for f in finishes}
    assert len(finishes) == len(final) == 3
    assert final["len"].finish_reason == FinishReason.LENGTH
    assert final["abort"].finish_reason == FinishReason.ABORT
    assert final["stoptok"].finish_reason == FinishReason.STOP
    assert final["stoptok"].stop_reason == stop_token
    stop_tokens = [
        t for out in steps for rid, t in zip(out.request_ids, out.token_ids) if rid == "stoptok"
    ]
    assert stop_tokens == ref_tokens[: stop_pos + 1]


def test_abort_mid_step_drops_its_token(tiny_model_dir, prompts) -> None:
    core = EngineCore(EngineConfig(model=str(tiny_model_dir)))
    for rid, ids in (("keep", prompts[0]), ("drop", prompts[1])):
        core.add_request(AddRequest(rid, pack_token_ids(ids), GREEDY))
    core.step()
    collect = core.runner.collect

    def abort_then_collect(sampled):  # the client's abort lands while the forward runs
        assert [f.request_id for f in core.abort(["drop"])] == ["drop"]
        return collect(sampled)

    core.runner.collect = abort_then_collect
    out = core.step()
    assert out.request_ids == ["keep"] and len(out.token_ids) == 1 and out.finished == []
    assert core.scheduler.running and all(s.request_id == "keep" for s in core.scheduler.running)


def run_with_events(
    core: EngineCore,
    requests: list[tuple[str, list[int], SamplingParams]],
    admit_at: int = 5,
    abort_at: tuple[int, str] = (9, "r1"),
) -> tuple[dict[tuple[str, int], list[int]], dict[tuple[str, int], FinishReason]]:
    """Tokens and finish reasons per (request, sample); the last request is added after step
    `admit_at`, and request abort_at[1] is aborted after step abort_at[0]."""
    tokens: dict[tuple[str, int], list[int]] = {}
    reasons: dict[tuple[str, int], FinishReason] = {}
    for rid, prompt, params in requests[:-1]:
        assert core.add_request(AddRequest(rid, pack_token_ids(prompt), params)) == []
    num_steps = 0
    while core.has_unfinished():
        out = core.step()
        num_steps += 1
        for rid, index, token_id in zip(out.request_ids, out.indices, out.token_ids, strict=True):
            tokens.setdefault((rid, index), []).append(token_id)
        finished = out.finished
        if num_steps == admit_at:
            rid, prompt, params = requests[-1]
            assert core.add_request(AddRequest(rid, pack_token_ids(prompt), params)) == []
        if num_steps == abort_at[0]:
            finished = finished + core.abort([abort_at[1]])
        reasons.update({(f.request_id, f.index): f.finish_reason for f in finished})
    return tokens, reasons


def test_output_columns_follow_the_seqs_through_finishes_aborts_and_admissions(
    tiny_model_dir,
) -> None:
    """Every token reaches the (request, sample) that generated it, also on continued decode
    steps, which reuse the previous step's id columns."""
    core = EngineCore(EngineConfig(model=str(tiny_model_dir), max_num_seqs=8, block_size=4))
    seqs = {}
    add_to_scheduler = core.scheduler.add

    def add_and_keep(seq) -> None:
        seqs[(seq.request_id, seq.index)] = seq
        add_to_scheduler(seq)

    core.scheduler.add = add_and_keep
    requests = [
        (rid, [3, 4, 5, 6, 7], SamplingParams(temperature=1.0, n=n, max_tokens=m, ignore_eos=True))
        for rid, m, n in [("r0", 6, 1), ("r1", 9, 2), ("r2", 13, 1), ("r3", 20, 1), ("late", 7, 1)]
    ]
    received, _ = run_with_events(core, requests, admit_at=8, abort_at=(4, "r2"))
    assert set(received) == set(seqs)
    for key, seq in seqs.items():
        assert received[key] == seq.token_ids[seq.num_prompt_tokens :], key
    assert len(received[("r2", 0)]) < 13


@pytest.mark.parametrize("device_feed", [False, True], ids=["native-advance", "device-feed"])
def test_async_scheduling_gives_the_same_tokens(tiny_model_dir, device_feed: bool) -> None:
    """Greedy and seeded samples, finishes by length and by stop id, n = 2, a late admission and
    an abort: async scheduling launches continuing steps early and changes no token."""
    requests = [
        (f"r{i}", [3 + i, 4, 5, 6, 7 + i][: 2 + i % 4], params)
        for i, params in enumerate(
            [
                SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
                SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                SamplingParams(temperature=0.9, seed=3, n=2, max_tokens=25, ignore_eos=True),
                SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
                SamplingParams(temperature=0.7, seed=5, max_tokens=33, ignore_eos=True),
            ]
        )
    ]
    requests.append(("late", [9, 8, 7], SamplingParams(temperature=0.0, max_tokens=12)))
    config = EngineConfig(
        model=str(tiny_model_dir), device="cpu", max_num_seqs=8, block_size=4, seed=1
    )
    reference, reference_reasons = run_with_events(EngineCore(config), requests)
    # NOTE: a stop id that request r3 produces a few tokens in, so it finishes by stop.
    stop_id = reference[("r3", 0)][5]
    requests[3] = (
        "r3",
        requests[3][1],
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id]),
    )
    reference, reference_reasons = run_with_events(EngineCore(config), requests)
    core = EngineCore(dataclasses.replace(config, async_scheduling=True))
    if device_feed:
        # NOTE: the path a CUDA runner takes: the ids reach the next step by a tensor copy.
        core.runner.feeds_ids_on_device = True
        core.runner.reset_step_state()
    schedule_ahead = core.scheduler.schedule_ahead
    num_ahead = []

    def counting_schedule_ahead(out):
        ahead = schedule_ahead(out)
        num_ahead.append(ahead is not None)
        return ahead

    core.scheduler.schedule_ahead = counting_schedule_ahead
    tokens, reasons = run_with_events(core, requests)
    assert tokens == reference and reasons == reference_reasons
    assert reasons[("r3", 0)] == FinishReason.STOP and reasons[("r1", 0)] == FinishReason.ABORT
    assert sum(num_ahead) >= 10


def test_async_scheduling_at_a_one_seq_per_token_budget_gives_the_same_tokens(
    tiny_model_dir,
) -> None:
    """max_num_seqs = max_num_batched_tokens = 16: a full running set leaves a one-token prefill
    chunk, which does not sample, beside the decodes; async scheduling must not continue such a
    step (it would recompute that position and sample it twice)."""
    rng = random.Random(12)
    # NOTE: outputs long enough for the running set to fill up while prompts still wait.
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randrange(4, 20))] for _ in range(20)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=rng.randrange(40, 80), ignore_eos=True)
        for _ in prompts
    ]
    config = EngineConfig(
        model=str(tiny_model_dir),
        device="cpu",
        max_num_seqs=16,
        max_num_batched_tokens=16,
        block_size=4,
        max_model_len=128,
        num_kv_blocks=512,
    )
    outputs = []
    for async_scheduling in (False, True):
        core = EngineCore(dataclasses.replace(config, async_scheduling=async_scheduling))
        for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
            assert core.add_request(AddRequest(f"r{i}", pack_token_ids(prompt), sp)) == []
        tokens: dict[str, list[int]] = {}
        while core.has_unfinished():
            out = core.step()
            for rid, token_id in zip(out.request_ids, out.token_ids, strict=True):
                tokens.setdefault(rid, []).append(token_id)
        outputs.append([tokens[f"r{i}"] for i in range(len(prompts))])
    assert [len(t) for t in outputs[1]] == [sp.max_tokens for sp in params]
    assert outputs[1] == outputs[0]


def test_cached_tokens_count_prompt_tokens_the_cache_served_never_a_recompute(
    tiny_model_dir,
) -> None:
    """A KV cache too small for the batch forces preemptions; a re-admission then hits the
    seq's own cached blocks, output tokens included, which are no prompt-cache hit."""
    prompts = [[10 + i, 20, 30, 40, 50, 60 + i] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    config = EngineConfig(
        model=str(tiny_model_dir), device="cpu", block_size=4, num_kv_blocks=16, max_num_seqs=4
    )
    core = EngineCore(config)
    for i, prompt in enumerate(prompts):
        assert core.add_request(AddRequest(f"r{i}", pack_token_ids(prompt), params)) == []
    reported: list[int] = []
    num_tokens: dict[str, int] = {}
    while core.has_unfinished():
        out = core.step()
        reported += out.num_cached_tokens.values()
        reported += [finish.num_cached_tokens for finish in out.finished]
        for rid in out.request_ids:
            num_tokens[rid] = num_tokens.get(rid, 0) + 1
    stats = core.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > len(prompts[0])
    assert num_tokens == {f"r{i}": 40 for i in range(4)}
    assert reported and set(reported) == {0}, "the prompts share no block"


@pytest.mark.gpu
def test_async_scheduling_on_cuda_finishes_every_request_alike(tiny_model_dir) -> None:
    """On CUDA (float32, so batch composition hardly moves a logit): the same finishes, and the
    same greedy tokens for nearly every request, with and without async scheduling."""
    requests = [
        (f"r{i}", [3 + i, 4, 5, 6, 7 + i][: 2 + i % 4], params)
        for i, params in enumerate(
            SamplingParams(temperature=0.0, max_tokens=10 + 7 * i, ignore_eos=True)
            for i in range(6)
        )
    ]
    config = EngineConfig(model=str(tiny_model_dir), device="cuda", dtype="float32")
    reference, reference_reasons = run_with_events(EngineCore(config), requests)
    async_core = EngineCore(dataclasses.replace(config, async_scheduling=True))
    tokens, reasons = run_with_events(async_core, requests)
    assert reasons == reference_reasons
    assert {key: len(ids) for key, ids in tokens.items()} == {
        key: len(ids) for key, ids in reference.items()
    }
    assert sum(tokens[key] == ids for key, ids in reference.items()) >= len(reference) - 1
