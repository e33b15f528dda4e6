"""Longrope (Phi-3) past its pre-training length against transformers (issue 24).

transformers rotates a sequence longer than `original_max_position_embeddings` by the long
factors at every position, and its generate drops the cache the first time a sequence passes
that length, so generation equals a full forward pass over each prefix. vbatch recomputes such
a sequence's K/V on the long factors, and its prefix-cache keys say which factors made a block.
A tiny Phi-3 (pre-training length 32) decodes prompts that start past it, cross it while
generating, or share a cached short-factor prefix, token for token as transformers would.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.tiny_model import TINY_SHAPE, build_tiny_model
from vbatch.config import EngineConfig
from vbatch.engine.core import EngineCore
from vbatch.engine.scheduler import Scheduler, SchedulerConfig
from vbatch.engine.sequence import Sequence, SequenceStatus
from vbatch.layers import native
from vbatch.protocol import AddRequest, pack_token_ids
from vbatch.sampling_params import SamplingParams

ORIGINAL_LEN = 32
TIE_TOLERANCE = 1e-4
VOCAB = TINY_SHAPE["vocab_size"]


@pytest.fixture(scope="module")
def phi3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Path]]:
    from transformers import Phi3Config

    config = Phi3Config(
        **TINY_SHAPE,
        original_max_position_embeddings=ORIGINAL_LEN,
        partial_rotary_factor=0.5,
        rope_scaling={
            "type": "longrope",
            "short_factor": [1.0, 1.5, 2.0, 3.0],
            "long_factor": [2.0, 3.0, 5.0, 8.0],
        },
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = build_tiny_model(config, seed=3)
    model_dir = tmp_path_factory.mktemp("phi3-longrope-32")
    model.save_pretrained(model_dir, safe_serialization=True)
    yield model, model_dir


def check_against_full_forward(model: Any, prompt: list[int], tokens: list[int]) -> None:
    """Each token is transformers' greedy choice from a full forward pass over everything before
    it (or within TIE_TOLERANCE of it)."""
    for t, token in enumerate(tokens):
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + tokens[:t]])).logits[0, -1]
        best = int(logits.argmax())
        gap = float(logits[best] - logits[token])
        assert token == best or gap <= TIE_TOLERANCE, (len(prompt), t, token, best, gap)


def run(core: EngineCore, requests: dict[str, tuple[list[int], int]]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    for rid, (prompt, max_tokens) in requests.items():
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        assert core.add_request(AddRequest(rid, pack_token_ids(prompt), params)) == []
    while core.has_unfinished():
        out = core.step()
        for rid, token_id in zip(out.request_ids, out.token_ids, strict=True):
            tokens[rid].append(token_id)
    return tokens


@pytest.mark.parametrize(("ops", "async_scheduling"), [("torch", True), ("native", False)])
def test_generation_past_the_pretraining_length_matches_transformers(
    ops: str, async_scheduling: bool, phi3: tuple[Any, Path]
) -> None:
    if ops == "native" and not native.is_available():
        pytest.skip("native kernels could not be built here")
    reference, model_dir = phi3
    rng = random.Random(11)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    core = EngineCore(
        EngineConfig(
            model=str(model_dir),
            attention_backend=ops,
            block_size=4,
            max_num_batched_tokens=16,
            num_kv_blocks=96,
            max_num_seqs=8,
            async_scheduling=async_scheduling,
        )
    )
    assert core.scheduler.config.long_rope_from == ORIGINAL_LEN
    crossing, short = tokens(24), tokens(20)
    # NOTE: prompts that cross the length while generating (up to the first token), start past
    # it, and one that stays within it, caching short-factor blocks.
    first = {
        "crossing": (crossing, 16),
        "short": (short, 4),
        **{f"len{n}": (tokens(n), 12) for n in (29, 31, 32, 33, 45)},
    }
    got = run(core, first)
    hits_before = core.stats().prefix_cache_hits
    # NOTE: long prompts behind those: one shares the crossing prompt's blocks, which its
    # recompute cached on the long factors; one shares the short-factor blocks of `short`.
    second = {"after-crossing": (crossing + tokens(20), 8), "after-short": (short + tokens(20), 8)}
    got |= run(core, second)
    core.shutdown()
    for rid, (prompt, max_tokens) in (first | second).items():
        assert len(got[rid]) == max_tokens, rid
        check_against_full_forward(reference, prompt, got[rid])
    # NOTE: the 24-token prompt's 6 long-factor blocks; the short ones are not reused.
    assert core.stats().prefix_cache_hits - hits_before == 24


def test_a_seq_growing_past_the_length_is_recomputed_without_short_factor_hits() -> None:
    """The Scheduler's part, torch-free: a prompt past the length is long from the start; a seq
    whose next token takes it past the length is not planned ahead, and once it has that token
    it waits at the head of the queue to compute all of its tokens, none from the prefix cache
    its short-factor blocks are in."""
    config = SchedulerConfig(
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=64,
        block_size=4,
        num_kv_blocks=32,
        long_rope_from=8,
    )
    sched = Scheduler(config, eos_token_ids=[2])
    params = SamplingParams(temperature=0.0, max_tokens=6)
    short = Sequence("short", list(range(3, 10)), params)
    other = Sequence("other", [20, 21, 22], params)
    long = Sequence("long", list(range(30, 40)), params)
    for seq in (short, other, long):
        sched.add(seq)
    assert long.long_rope and not short.long_rope and not other.long_rope
    sched.update(sched.schedule(), [11, 12, 13])
    assert not short.long_rope and short.num_tokens == 8
    out = sched.schedule()
    assert out.seqs == [short, other, long] and out.num_new_tokens == [1, 1, 1]
    assert sched.schedule_ahead(out) is None, "short's next token takes it past the length"
    sched.update(out, [14, 15, 16])
    assert short.long_rope and short.status == SequenceStatus.WAITING
    assert short.num_computed_tokens == 0 and not short.block_table
    assert list(sched.waiting) == [short] and sched.running == [other, long]
    out = sched.schedule()
    assert out.seqs == [other, long, short] and out.num_new_tokens == [1, 1, 9]


def test_prompt_logprobs_past_the_length_use_the_long_factors(
    phi3: tuple[Any, Path], tmp_path: Path, smollm2: Any
) -> None:
    """A prompt longer than the pre-training length is scored on the long factors, as
    transformers' forward (and vbatch's own generation) rotates it; they were the short ones."""
    import shutil

    from benchmarks.tiny_model import TOKENIZER_FILES
    from vbatch import LLM

    model, model_dir = phi3
    local = tmp_path / "phi3"
    shutil.copytree(model_dir, local)
    for name in TOKENIZER_FILES:
        if (smollm2.hf_dir / name).is_file():
            shutil.copy(smollm2.hf_dir / name, local / name)
    prompt = random.Random(5).sample(range(100, VOCAB), 3 * ORIGINAL_LEN)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    with LLM(str(local), num_threads=1) as llm:
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    with torch.inference_mode():
        want = torch.log_softmax(model(torch.tensor([prompt])).logits[0].double(), -1)
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    for j in range(1, len(prompt)):
        got = out.prompt_logprobs[j][prompt[j]].logprob
        assert abs(got - float(want[j - 1, prompt[j]])) <= 1e-4, j
