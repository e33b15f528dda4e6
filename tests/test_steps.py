"""Tests for DecodeRun: which continuing decode steps it applies, and the seqs it reports as
opening a block."""

from __future__ import annotations

from vbatch.engine.sequence import Sequence
from vbatch.engine.steps import DecodeRun
from vbatch.sampling_params import SamplingParams

BLOCK_SIZE = 4


def decoding_seq(num_tokens: int, max_tokens: int, finish_ids: frozenset[int]) -> Sequence:
    """A seq in the decode steady state: every token computed but its last one."""
    seq = Sequence("r", list(range(100, 100 + num_tokens)), SamplingParams(max_tokens=max_tokens))
    seq.num_computed_tokens = num_tokens - 1
    seq.max_num_tokens = num_tokens + max_tokens
    seq.finish_token_ids = finish_ids
    return seq


def test_take_appends_and_names_the_seqs_whose_next_token_opens_a_block() -> None:
    seqs = [decoding_seq(n, 10, frozenset({2})) for n in (4, 5, 7)]
    run = DecodeRun(seqs, BLOCK_SIZE)
    crossings = []
    for step in range(6):
        crossing = run.take(step, [10 + step] * 3)
        assert crossing is not None
        crossings.append([seqs.index(seq) for seq in crossing])
        for seq in seqs:
            # NOTE: one token computed and one taken: still exactly one left to compute.
            assert seq.num_computed_tokens == seq.num_tokens - 1
            assert seq.token_ids[-1] == 10 + step
            assert (seq.num_computed_tokens % BLOCK_SIZE == 0) == (seq in crossing)
    assert crossings == [[0], [2], [], [1], [0], [2]]
    assert [seq.num_tokens for seq in seqs] == [10, 11, 13] and run.step_id == 5


def test_take_refuses_a_step_that_may_finish_a_seq_and_appends_nothing() -> None:
    seqs = [decoding_seq(4, 3, frozenset({2})), decoding_seq(6, 9, frozenset({2, 77}))]
    run = DecodeRun(seqs, BLOCK_SIZE)
    assert run.take(0, [77, 5]) is None, "77 stops the second seq"
    assert run.take(0, [5, 2]) is None, "2 is EOS"
    assert [seq.num_tokens for seq in seqs] == [4, 6]
    assert run.take(0, [5, 5]) is not None
    assert run.take(1, [5, 5]) is not None
    assert run.take(2, [5, 5]) is None, "the first seq's third token ends it by length"
    assert [seq.num_tokens for seq in seqs] == [6, 8] and run.step_id == 1
