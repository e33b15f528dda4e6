"""A seeded request run cold, then again with its prompt in the prefix cache (issue 24).

The seeded draw depends only on the request (its own generator, one uniform per step), so the
tokens can change only where the logits do. With the torch backend the cached prompt blocks and
the recomputed tail hold the same K/V bits as a cold prefill, so both runs agree bit for bit.
The native CPU kernel attends a chunk of up to 8 query tokens token by token and a longer one by
16-token tiles, which round differently: the 8-token tail after a 32-token hit differs from the
same positions of a cold 40-token prefill in the last bits, from the second layer on.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vbatch.config import EngineConfig
from vbatch.engine.core import EngineCore
from vbatch.layers import native
from vbatch.protocol import AddRequest, pack_token_ids
from vbatch.sampling_params import SamplingParams

PROMPT = list(range(1000, 1040))
PARAMS = SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True, logprobs=0)


def run(core: EngineCore, request_id: str) -> tuple[list[int], list[float], int]:
    """The request's tokens, their logprobs and its prompt-cache hit."""
    assert core.add_request(AddRequest(request_id, pack_token_ids(PROMPT), PARAMS)) == []
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


@pytest.mark.parametrize(
    "ops",
    [
        "torch",
        pytest.param(
            "native",
            marks=pytest.mark.xfail(
                strict=True, reason="per-token and tiled native attention round differently"
            ),
        ),
    ],
)
def test_a_seeded_request_is_the_same_cold_and_cached(ops: str, tiny_model_dir: Path) -> None:
    if ops == "native" and not native.is_available():
        pytest.skip("native kernels could not be built here")
    core = EngineCore(
        EngineConfig(model=str(tiny_model_dir), device="cpu", num_threads=1, attention_backend=ops)
    )
    cold = run(core, "cold")
    cached = run(core, "cached")
    core.shutdown()
    assert (cold[2], cached[2]) == (0, 32)
    assert cached[0] == cold[0]
    assert cached[1] == cold[1], "the logits differ"
