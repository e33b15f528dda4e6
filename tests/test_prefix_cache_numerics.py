"""A seeded request run cold, then again with its prompt in the prefix cache (issue 24).

The seeded draw depends only on the request (its own generator, one uniform per step), so the
tokens can change only where the logits do, and the cached prompt blocks, the slots copied from a
cached block's head and the recomputed tail must hold the same K/V bits as a cold prefill. The
native CPU kernel rounds differently row by row than by tiles, so it attends every prompt
position by tiles: the 8-token tail after a 32-token hit goes the way the same positions of the
cold 40-token prefill went, and so does a 1-token tail (after the cold request's third block
lent its first 7 slots, or after a 32-token hit of a 33-token prompt), which a rule by chunk
length would send row by row.

What is left is MKL's: its GEMM rounds a row by how many rows the call has (on an AVX-512 Xeon
below 3 rows at this model's widths, below 16 at SmolLM2's; on an AVX2 EPYC an 8-row tail
against 40 rows as well), so by default a tail's K/V can differ from the cold prefill's in the
last bits: the tokens hold and the logprobs agree to 1e-5. The batch-invariant mode takes MKL
out, so there the whole request is bit for bit the same, which checks the attention's part.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from vbatch.config import EngineConfig
from vbatch.engine.core import EngineCore
from vbatch.layers import native
from vbatch.protocol import AddRequest, pack_token_ids
from vbatch.sampling_params import SamplingParams

Run = tuple[list[int], list[float], int]
PARAMS = SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True, logprobs=0)


def run(core: EngineCore, request_id: str, prompt_len: int, params: SamplingParams = PARAMS) -> Run:
    """The request's tokens, their logprobs and its prompt-cache hit."""
    prompt = pack_token_ids(list(range(1000, 1000 + prompt_len)))
    assert core.add_request(AddRequest(request_id, prompt, params)) == []
    tokens: list[int] = []
    logprobs: list[float] = []
    cached = 0
    while core.has_unfinished():
        out = core.step()
        assert out.logprobs is not None
        tokens += out.token_ids
        logprobs += [lp.logprob for lp in out.logprobs if lp is not None]
        cached = out.num_cached_tokens.get(request_id, cached)
    return tokens, logprobs, cached


def cold_and_cached(
    ops: str, prompt_len: int, model_dir: Path, batch_invariant: bool = False
) -> tuple[Run, Run, Run]:
    """The request cold, then again: after itself (every prompt token but the last is a hit,
    from its whole blocks and the head of its third; batch-invariant, only its whole prompt
    blocks, as the third also holds outputs, made by decode rows), and after a 1-token request
    of the same prompt, whose third block never filled (a 32-token hit; the rest is
    recomputed)."""
    if ops == "native" and not native.is_available():
        pytest.skip("native kernels could not be built here")
    config = EngineConfig(
        model=str(model_dir),
        device="cpu",
        num_threads=1,
        attention_backend=ops,
        batch_invariant=batch_invariant,
    )
    core = EngineCore(config)
    cold = run(core, "cold", prompt_len)
    cached = run(core, "cached", prompt_len)
    core.shutdown()
    core = EngineCore(config)
    run(core, "first", prompt_len, msgspec.structs.replace(PARAMS, max_tokens=1))
    after_blocks = run(core, "after blocks", prompt_len)
    core.shutdown()
    own_hit = prompt_len // 16 * 16 if batch_invariant else prompt_len - 1
    assert (cold[2], cached[2], after_blocks[2]) == (0, own_hit, 32)
    return cold, cached, after_blocks


@pytest.mark.parametrize("prompt_len", [40, 33])
def test_a_seeded_request_is_bitwise_the_same_cold_and_cached_when_batch_invariant(
    prompt_len: int, tiny_model_dir: Path
) -> None:
    cold, *warm = cold_and_cached("native", prompt_len, tiny_model_dir, batch_invariant=True)
    for cached in warm:
        assert cached[0] == cold[0]
        assert cached[1] == cold[1], "the logits differ"


@pytest.mark.parametrize("prompt_len", [40, 33])
@pytest.mark.parametrize("ops", ["torch", "native"])
def test_a_seeded_request_keeps_its_tokens_cold_and_cached(
    ops: str, prompt_len: int, tiny_model_dir: Path
) -> None:
    cold, *warm = cold_and_cached(ops, prompt_len, tiny_model_dir)
    for cached in warm:
        assert cached[0] == cold[0]
        assert cached[1] == pytest.approx(cold[1], abs=1e-5)
