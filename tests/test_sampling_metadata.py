"""Tests for SamplingMetadata: what a step's sampling inputs hold, and what they leave out."""

import torch

from vbatch.engine.sampling_metadata import SamplingMetadata, to_device, to_host
from vbatch.engine.sequence import Sequence
from vbatch.sampling_params import SamplingParams

VOCAB = 49152
CPU = torch.device("cpu")


def make_seqs(*params: SamplingParams) -> list[Sequence]:
    return [Sequence(f"r{i}", [1, 2, 3], p) for i, p in enumerate(params)]


def test_metadata_skips_unneeded_transforms() -> None:
    meta = SamplingMetadata.build(make_seqs(SamplingParams(top_k=50)), CPU, VOCAB, {})
    assert meta.top_k is not None and meta.num_candidates == 50
    assert meta.top_p is None and meta.min_p is None and meta.penalties is None
    assert meta.restricted_rows is None and not meta.needs_full_mass
    meta = SamplingMetadata.build(make_seqs(SamplingParams(min_p=0.1)), CPU, VOCAB, {})
    assert meta.top_k is None and meta.min_p is not None


def test_plain_greedy_batch_builds_no_tensors() -> None:
    greedy = SamplingParams(temperature=0.0)
    meta = SamplingMetadata.build(make_seqs(*[greedy] * 4), CPU, VOCAB, {}, eos_token_ids=[2])
    assert meta == SamplingMetadata(num_rows=4, vocab_size=VOCAB)
    # NOTE: a min_tokens a row has already reached needs nothing either.
    reached = make_seqs(SamplingParams(temperature=0.0, min_tokens=1), greedy)
    reached[0].append_token(7)
    assert SamplingMetadata.build(reached, CPU, VOCAB, {}, [2]) == SamplingMetadata(2, VOCAB)
    pending = SamplingMetadata.build(make_seqs(greedy, reached[0].params), CPU, VOCAB, {}, [2])
    assert pending.banned is not None and pending.banned[0].tolist() == [1]
    for other in (
        SamplingParams(temperature=0.0, logprobs=1),
        SamplingParams(temperature=0.0, repetition_penalty=1.1),
        SamplingParams(temperature=0.0, presence_penalty=0.1),
        SamplingParams(temperature=0.0, frequency_penalty=0.1),
        SamplingParams(),
    ):
        seqs = make_seqs(greedy, other)
        seqs[1].append_token(5)
        assert SamplingMetadata.build(seqs, CPU, VOCAB, {}) != SamplingMetadata(2, VOCAB), other


def test_host_copies_are_the_tensors_on_cpu() -> None:
    values = torch.arange(5)
    assert to_device(values, CPU) is values
    assert to_host([values])[0] is values


def test_a_greedy_row_with_a_penalty_is_never_plain_greedy_before_its_first_token() -> None:
    """Its frequency or presence penalty subtracts nothing yet, but the steps that continue this
    one must build their metadata again to apply it."""
    for penalty in ({"frequency_penalty": 0.5}, {"presence_penalty": 0.5}):
        (seq,) = make_seqs(SamplingParams(temperature=0.0, **penalty))
        meta = SamplingMetadata.build([seq], CPU, VOCAB, {})
        assert meta.penalties is None and not meta.is_plain_greedy, penalty
