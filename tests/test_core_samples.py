"""EngineCore on the tiny random model: the n samples of one request, aborted one at a time, and
finished at O(1) bookkeeping each."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from vbatch.config import EngineConfig
from vbatch.engine.core import EngineCore
from vbatch.engine.sequence import Sequence
from vbatch.protocol import AddRequest, EngineOutputs, FinishReason, pack_token_ids
from vbatch.sampling_params import MAX_N, SamplingParams


@pytest.fixture(scope="module")
def core(tiny_model_dir: Path) -> Iterator[EngineCore]:
    core = EngineCore(
        EngineConfig(
            model=str(tiny_model_dir),
            device="cpu",
            num_threads=1,
            max_num_seqs=MAX_N,
            num_kv_blocks=4 * MAX_N,
            attention_backend="torch",
        )
    )
    yield core
    core.shutdown()


def drain(core: EngineCore, tokens: Counter[tuple[str, int]], finishes: list) -> None:
    while core.has_unfinished():
        record(core.step(), tokens, finishes)


def record(out: EngineOutputs, tokens: Counter[tuple[str, int]], finishes: list) -> None:
    tokens.update(zip(out.request_ids, out.indices))
    finishes += out.finished


def test_aborting_one_sample_stops_only_that_sample(core: EngineCore) -> None:
    params = SamplingParams(n=3, max_tokens=20, temperature=1.0, seed=3, ignore_eos=True)
    generated_before = core.stats().num_generation_tokens
    assert core.add_request(AddRequest("r", pack_token_ids([1, 2, 3]), params)) == []
    tokens: Counter[tuple[str, int]] = Counter()
    finishes: list = []
    while tokens[("r", 1)] < 4:
        record(core.step(), tokens, finishes)
    (finish,) = core.abort(["r", "r", "nope", "r"], [1, 1, 0, 7])
    assert (finish.request_id, finish.index, finish.finish_reason) == ("r", 1, FinishReason.ABORT)
    assert core.abort(["r"], [1]) == []  # already finished: skipped
    assert core.num_unfinished == {"r": 2}
    aborted_at = tokens[("r", 1)]
    drain(core, tokens, finishes)
    assert tokens == {("r", 0): 20, ("r", 1): aborted_at, ("r", 2): 20}
    assert sorted((f.index, f.finish_reason) for f in finishes) == [
        (0, FinishReason.LENGTH),
        (2, FinishReason.LENGTH),
    ]
    assert core.stats().num_generation_tokens - generated_before == 40 + aborted_at
    assert core.requests == {} and core.num_unfinished == {}


def test_aborting_every_sample_one_by_one_ends_the_request(core: EngineCore) -> None:
    params = SamplingParams(n=2, max_tokens=50, temperature=1.0, ignore_eos=True)
    core.add_request(AddRequest("q", pack_token_ids([5, 6]), params))
    core.step()
    assert [f.index for f in core.abort(["q"], [0])] == [0]
    assert [f.index for f in core.abort(["q"], [1])] == [1]
    assert core.requests == {} and core.num_unfinished == {}
    assert not core.has_unfinished() or core.step().is_empty
    assert core.stats().num_running == 0


def test_finishing_n_samples_costs_linear_bookkeeping(
    core: EngineCore, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = Counter[str]()
    is_finished = Sequence.is_finished

    def counted(seq: Sequence) -> bool:
        reads["is_finished"] += 1
        return is_finished.fget(seq)  # type: ignore[misc]

    monkeypatch.setattr(Sequence, "is_finished", property(counted))
    params = SamplingParams(n=MAX_N, max_tokens=2, temperature=1.0, ignore_eos=True)
    core.add_request(AddRequest("big", pack_token_ids([7, 8, 9]), params))
    tokens: Counter[tuple[str, int]] = Counter()
    finishes: list = []
    drain(core, tokens, finishes)
    assert len(finishes) == MAX_N and sum(tokens.values()) == 2 * MAX_N
    # NOTE: each finish scanned all of the request's samples before: MAX_N**2 reads.
    assert reads["is_finished"] <= 4 * MAX_N
