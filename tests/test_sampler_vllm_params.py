"""The sampler's vLLM parameters (logit_bias, allowed_token_ids, bad_words, min_tokens) and the
argmax declarations the greedy shortcut reads."""

from __future__ import annotations

import pytest
import torch

from vbatch.engine.sampler import Sampler
from vbatch.engine.sampling_metadata import SamplingMetadata
from vbatch.engine.sequence import Sequence
from vbatch.sampling_params import CHANGES_ARGMAX, SamplingParams

CPU = torch.device("cpu")
VOCAB = 64


def greedy_tokens(params: list[SamplingParams], logits: torch.Tensor, outputs=()) -> list[int]:
    seqs = [Sequence(f"r{i}", [1, 2, 3], p) for i, p in enumerate(params)]
    for seq, out in zip(seqs, outputs, strict=False):
        for token in out:
            seq.append_token(token)
    meta = SamplingMetadata.build(seqs, CPU, VOCAB, {}, eos_token_ids=[0])
    return Sampler()(logits, meta).token_ids.tolist()


def logits_with_top(*tops: int) -> torch.Tensor:
    logits = torch.zeros(len(tops), VOCAB)
    for row, top in enumerate(tops):
        logits[row, top] = 5.0
        logits[row, 7] = 4.0
    return logits


def test_every_sampling_field_declares_whether_it_changes_the_argmax() -> None:
    # NOTE: a field added without a declaration would be silently skipped by greedy rows.
    assert set(CHANGES_ARGMAX) == set(SamplingParams.field_names())


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(temperature=0, logit_bias={9: 10.0}), 9),
        (SamplingParams(temperature=0, logit_bias={3: -10.0}), 7),
        (SamplingParams(temperature=0, allowed_token_ids=[9, 11]), 9),
        (SamplingParams(temperature=0, bad_words_token_ids=[[3]]), 7),
        (SamplingParams(temperature=0, presence_penalty=2.0), 3),
    ],
)
def test_each_argmax_changer_reaches_greedy_rows(params: SamplingParams, expected: int) -> None:
    # NOTE: row 1 is plain greedy beside it; the shortcut must not take the pair.
    plain = SamplingParams(temperature=0)
    assert greedy_tokens([params, plain], logits_with_top(3, 3)) == [expected, 3]


def test_a_multi_token_bad_word_bans_its_last_token_only_after_its_prefix() -> None:
    params = SamplingParams(temperature=0, bad_words_token_ids=[[20, 3]])
    logits = logits_with_top(3, 3)
    assert greedy_tokens([params, params], logits, outputs=[[20], [21]]) == [7, 3]


def test_a_greedy_step_with_a_multi_token_bad_word_is_never_reused() -> None:
    """Before its prefix, the word bans nothing, but the steps that continue this one may:
    their metadata must be built again (a reused plain-greedy one ignored the ban)."""
    seq = Sequence("r", [1, 2, 3], SamplingParams(temperature=0, bad_words_token_ids=[[20, 3]]))
    before = SamplingMetadata.build([seq], CPU, VOCAB, {})
    assert before.banned is None and not before.is_plain_greedy
    single = Sequence("s", [1, 2, 3], SamplingParams(temperature=0, bad_words_token_ids=[[3]]))
    assert not SamplingMetadata.build([single], CPU, VOCAB, {}).bans_may_start


def test_min_tokens_bans_eos_until_reached_then_the_shortcut_returns() -> None:
    params = SamplingParams(temperature=0, min_tokens=2, max_tokens=8)
    logits = logits_with_top(0)
    assert greedy_tokens([params], logits, outputs=[[5]]) == [7]
    assert greedy_tokens([params], logits, outputs=[[5, 6]]) == [0]
    seq = Sequence("r", [1, 2, 3], params)
    seq.append_token(5)
    seq.append_token(6)
    assert SamplingMetadata.build([seq], CPU, VOCAB, {}).is_plain_greedy


def test_allowed_tokens_hold_for_sampled_rows_too() -> None:
    params = SamplingParams(temperature=1.0, seed=3, allowed_token_ids=[40, 41])
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    assert set(greedy_tokens([params] * 4, logits)) <= {40, 41}
