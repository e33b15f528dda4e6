"""Tests for PrefillClaims on a real BlockManager: one seq computes a shared prompt block."""

from vbatch.engine.block_manager import BlockManager
from vbatch.engine.prefill_claims import PrefillClaims
from vbatch.engine.sequence import Sequence
from vbatch.sampling_params import SamplingParams


def seq(prompt: list[int]) -> Sequence:
    return Sequence("r", prompt, SamplingParams(max_tokens=4))


def test_a_claimed_block_makes_others_wait_until_released() -> None:
    claims = PrefillClaims(BlockManager(32, 4))
    shared = [5, 6, 7, 8, 9, 10, 11, 12]
    first, second, other = seq([*shared, 1]), seq([*shared, 2, 3]), seq([40, 41, 42, 43, 44])
    assert not claims.is_computing_next(second, [])
    claims.claim(first, [])
    assert claims.is_computing_next(second, [])
    assert not claims.is_computing_next(first, []), "its own claim"
    assert not claims.is_computing_next(other, []), "another prompt"
    claims.claim(second, [])
    claims.release(first)
    assert not claims.is_computing_next(seq([*shared, 7]), []), "the second claimed nothing"


def test_claims_start_after_the_cached_blocks() -> None:
    manager = BlockManager(32, 4)
    claims = PrefillClaims(manager)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    owner = seq(prompt)
    manager.allocate(owner, owner.num_tokens)
    owner.num_computed_tokens = 4
    manager.cache_full_blocks(owner)
    cached = manager.match_prefix(seq(prompt))
    assert len(cached) == 1
    claims.claim(owner, cached)
    waiter = seq([*prompt[:8], 99])
    assert claims.is_computing_next(waiter, cached)
    assert not claims.is_computing_next(seq([*prompt[:4], 50, 51, 52, 53, 54]), cached)
    claims.release(owner)
    assert not claims.is_computing_next(waiter, cached)
