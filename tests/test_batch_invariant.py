"""Batch-invariant mode: a seeded request's bits do not depend on its batch or on cache hits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vbatch import LLM
from vbatch.config import EngineConfig
from vbatch.engine.core import EngineCore
from vbatch.errors import ConfigError
from vbatch.layers import native
from vbatch.layers.batch_invariant import check_row_invariance, invariant_linear
from vbatch.pooling_params import PoolingParams, PoolingTask
from vbatch.protocol import AddRequest, pack_token_ids
from vbatch.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True, logprobs=0)
Run = dict[str, tuple[list[int], list[float]]]


def test_a_row_gets_the_same_bits_in_any_call() -> None:
    torch.manual_seed(0)
    weight, x = torch.randn(3072, 576), torch.randn(40, 576)
    full = invariant_linear(x, weight)
    torch.testing.assert_close(full, F.linear(x, weight), rtol=1e-4, atol=1e-4)
    for rows in (1, 2, 7, 16, 39):
        assert torch.equal(invariant_linear(x[-rows:], weight), full[-rows:])
    check_row_invariance([(960, 576), (576, 1536), (49152, 576)])


def run(core: EngineCore, prompts: dict[str, list[int]], max_tokens: int = 16) -> Run:
    params = PARAMS.clone()
    params.max_tokens = max_tokens
    for request_id, prompt in prompts.items():
        assert core.add_request(AddRequest(request_id, pack_token_ids(prompt), params)) == []
    got: Run = {request_id: ([], []) for request_id in prompts}
    while core.has_unfinished():
        out = core.step()
        assert out.logprobs is not None
        for request_id, token, logprob in zip(out.request_ids, out.token_ids, out.logprobs):
            got[request_id][0].append(token)
            got[request_id][1].append(logprob.logprob if logprob is not None else float("nan"))
    return got


def invariant_core(model: Path, **settings: Any) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=str(model), device="cpu", num_threads=2, batch_invariant=True, **settings
        )
    )


def test_a_seeded_request_is_the_same_alone_batched_and_cached(tiny_model_dir: Path) -> None:
    """Alone its decode steps have 1 row, batched 7: without batch_invariant, MKL rounds the
    tiny model's rows otherwise at 1 and 2 rows, and the logprobs differ."""
    if not native.is_available():
        pytest.skip("native kernels could not be built here")
    core = invariant_core(tiny_model_dir)
    prompt = list(range(1000, 1033))
    alone = run(core, {"alone": prompt})["alone"]
    others = {f"o{i}": list(range(2000 + 50 * i, 2000 + 50 * i + 5 + 9 * i)) for i in range(6)}
    batched = run(core, {"cached": prompt, **others})["cached"]
    core.shutdown()
    assert batched == alone


def test_a_preempted_seeded_request_is_recomputed_to_the_same_bits(tiny_model_dir: Path) -> None:
    """With 8 KV blocks of 16 for 4 requests of 5 blocks each, seqs are preempted and recomputed:
    their outputs as one chunk used to round otherwise than when they were decoded, and a
    logprob's last bits (then, downstream, a sampled token) changed."""
    if not native.is_available():
        pytest.skip("native kernels could not be built here")
    generator = np.random.default_rng(0)
    prompts = {
        f"r{i}": generator.integers(100, 49152, size=length).tolist()
        for i, length in enumerate((40, 30, 35, 20))
    }
    runs = []
    for num_kv_blocks in (None, 8):
        core = invariant_core(tiny_model_dir, num_kv_blocks=num_kv_blocks, block_size=16)
        runs.append(run(core, prompts, max_tokens=40))
        runs.append(core.scheduler.num_preemptions)
        core.shutdown()
    roomy, roomy_preemptions, tight, tight_preemptions = runs
    assert roomy_preemptions == 0 and tight_preemptions > 0
    assert tight == roomy


def test_a_prompt_ending_in_another_requests_outputs_is_the_same_hit_or_cold(
    tiny_model_dir: Path,
) -> None:
    """A multi-turn prompt: the last one's prompt and 20 of its outputs. Its blocks holding
    outputs were cached from decode rows, which round otherwise than its own prefill; a hit on
    them changed its logprobs' last bits. Only prompt blocks are shared now."""
    if not native.is_available():
        pytest.skip("native kernels could not be built here")
    prompt = np.random.default_rng(0).integers(100, 49000, size=70).tolist()
    core = invariant_core(tiny_model_dir)
    first, _ = run(core, {"first": prompt}, max_tokens=32)["first"]
    follow_up = prompt + first[:20]
    hit = run(core, {"follow_up": follow_up}, max_tokens=24)["follow_up"]
    core.shutdown()
    cold_core = invariant_core(tiny_model_dir)
    cold = run(cold_core, {"follow_up": follow_up}, max_tokens=24)["follow_up"]
    cold_core.shutdown()
    assert hit == cold


def test_refuses_what_it_cannot_make_invariant() -> None:
    with pytest.raises(ConfigError, match="quantization int8"):
        EngineConfig(batch_invariant=True, quantization="int8").validate()
    with pytest.raises(ConfigError, match="enable_lora"):
        EngineConfig(batch_invariant=True, enable_lora=True).validate()


def test_prompt_logprobs_are_the_same_alone_and_batched(tiny_model_dir: Path) -> None:
    if not native.is_available():
        pytest.skip("native kernels could not be built here")
    text = "the same text, scored alone and among others"
    others = ["a", "two words", "a somewhat longer text to score " * 3]
    params = PoolingParams(task=PoolingTask.PROMPT_LOGPROBS)
    with LLM(str(tiny_model_dir), device="cpu", num_threads=2, batch_invariant=True) as llm:
        (alone,) = llm.encode([text], params)
        batched = llm.encode([*others, text], params)[-1]
    with LLM(str(tiny_model_dir), device="cpu", num_threads=2) as llm:
        (default,) = llm.encode([text], params)
    assert np.array_equal(alone.outputs.data, batched.outputs.data)
    np.testing.assert_allclose(alone.outputs.data, default.outputs.data, atol=1e-5)
