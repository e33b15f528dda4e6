"""Tests for SchedulerOutput: built by keyword only, and which seqs sample when the mask is left
to it."""

from __future__ import annotations

import pytest

from vbatch.engine.sequence import Sequence
from vbatch.engine.steps import SchedulerOutput
from vbatch.sampling_params import SamplingParams


def test_scheduler_output_is_keyword_only_and_derives_which_seqs_sample() -> None:
    prefill = Sequence("a", [1, 2, 3, 4], SamplingParams())
    chunk = Sequence("b", [5, 6, 7, 8, 9], SamplingParams())
    with pytest.raises(TypeError):
        SchedulerOutput([prefill, chunk], [4, 3])  # type: ignore[misc]
    out = SchedulerOutput(seqs=[prefill, chunk], num_new_tokens=[4, 3])
    assert out.sampling_mask == [True, False] and out.sampling_indices == [0]
    assert out.num_batched_tokens == 7 and out.continues_step == -1
