"""Tests for Sequence's finish rules: EOS and stop ids after min_tokens, and the length limit."""

import pytest

from vbatch.engine.sequence import Sequence, SequenceStatus
from vbatch.protocol import FinishReason
from vbatch.sampling_params import SamplingParams

EOS = frozenset({2})


def after(tokens: list[int], **params: object) -> Sequence:
    seq = Sequence("r", [7, 8, 9], SamplingParams(**params))
    for token_id in tokens:
        seq.append_token(token_id)
    return seq


@pytest.mark.parametrize(
    ("tokens", "params", "expected"),
    [
        ([5], {}, None),
        ([2], {}, (FinishReason.STOP, None)),
        ([2], {"ignore_eos": True}, None),
        ([2], {"min_tokens": 1}, None),
        ([5, 2], {"min_tokens": 1}, (FinishReason.STOP, None)),
        ([30], {"stop_token_ids": [30]}, (FinishReason.STOP, 30)),
        ([2], {"stop_token_ids": [2]}, (FinishReason.STOP, None)),
        ([2], {"stop_token_ids": [2], "ignore_eos": True}, (FinishReason.STOP, 2)),
        ([5, 6], {"max_tokens": 2}, (FinishReason.LENGTH, None)),
        (
            [5, 30],
            {"max_tokens": 2, "stop_token_ids": [30], "min_tokens": 2},
            (FinishReason.LENGTH, None),
        ),
    ],
)
def test_finish_on_the_newest_token(
    tokens: list[int], params: dict[str, object], expected: tuple[FinishReason, int | None] | None
) -> None:
    seq = after(tokens, **params)
    assert seq.finish_on(tokens[-1], EOS) == (expected is not None)
    if expected is None:
        assert seq.status == SequenceStatus.WAITING and seq.finish_reason is None
    else:
        assert seq.status == SequenceStatus.FINISHED
        assert (seq.finish_reason, seq.stop_reason) == expected


def test_a_decode_step_changes_only_the_token_list() -> None:
    seq = after([])
    seq.num_computed_tokens = 2
    seq.token_ids.append(11)
    assert seq.num_computed_tokens == 3 and seq.num_uncomputed_tokens == 1
    seq.append_token(12)
    assert seq.num_computed_tokens == 3 and seq.output_token_ids == [11, 12]
