"""Tests for the Scheduler, driven by a deterministic fake model: budgets, chunked prefill,
preemption, finish rules, aborts and prefix caching."""

import random

import pytest

from vbatch.engine.scheduler import Scheduler, SchedulerConfig
from vbatch.engine.sequence import Sequence, SequenceStatus
from vbatch.engine.steps import SchedulerOutput, StepUpdate
from vbatch.protocol import FinishReason, TokenLogprobs
from vbatch.sampling_params import SamplingParams

EOS = 2


def make_scheduler(**overrides: int | bool) -> Scheduler:
    values = dict(
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=256,
        block_size=4,
        num_kv_blocks=64,
        enable_prefix_caching=True,
    )
    values.update(overrides)
    return Scheduler(SchedulerConfig(**values), eos_token_ids=[EOS])


def fake_token(seq: Sequence) -> int:
    """A token that depends only on the seq's tokens so far, never EOS."""
    return 10 + (sum(seq.token_ids[-3:]) * 7 + seq.num_tokens + seq.index) % 89


def add(
    sched: Scheduler, request_id: str, prompt: list[int], index: int = 0, **params: object
) -> Sequence:
    seq = Sequence(request_id, prompt, SamplingParams(**params), index)
    sched.add(seq)
    return seq


def check_step(sched: Scheduler, out: SchedulerOutput) -> None:
    config = sched.config
    assert out.num_batched_tokens <= config.max_num_batched_tokens
    assert len(out.seqs) <= config.max_num_seqs and sched.num_running <= config.max_num_seqs
    assert len({seq.seq_id for seq in out.seqs}) == len(out.seqs)
    for seq, num_new, is_sampling in zip(
        out.seqs, out.num_new_tokens, out.sampling_mask, strict=True
    ):
        assert seq.status == SequenceStatus.RUNNING and num_new > 0
        assert len(seq.block_table) * config.block_size >= seq.num_computed_tokens + num_new
        assert is_sampling == (seq.num_computed_tokens + num_new == seq.num_tokens)
    bm = sched.block_manager
    assert out.block_tables is bm.tables
    for seq, row in zip(out.seqs, out.block_rows, strict=True):
        assert bm.tables[row, : len(seq.block_table)].tolist() == seq.block_table
    ref_counts = [0] * bm.num_blocks
    for seq in sched.running:
        for block_id in seq.block_table[seq.num_dropped_blocks :]:
            ref_counts[block_id] += 1
    for block_id in bm.pinned:
        ref_counts[block_id] += 1
    assert ref_counts == bm.ref_counts
    for seq in sched.waiting:
        assert seq.block_table == [] and seq.num_computed_tokens == 0


def step(sched: Scheduler, token_fn=fake_token) -> tuple[SchedulerOutput, list[Sequence]]:
    """One scheduled and applied step; returns it and the seqs that got a token."""
    out = sched.schedule()
    check_step(sched, out)
    tokens = [token_fn(out.seqs[i]) for i in out.sampling_indices]
    update = sched.update(out, tokens)
    assert update.token_ids == tokens and len(update.seqs) == len(tokens)
    assert {s.seq_id for s in update.finished} <= {s.seq_id for s in update.seqs}
    assert all(s.is_finished for s in update.finished)
    return out, update.seqs


def run_to_end(sched: Scheduler, token_fn=fake_token, max_steps: int = 10_000) -> int:
    for num_steps in range(max_steps):
        if not sched.has_unfinished():
            assert sched.block_manager.usage == 0.0
            return num_steps
        step(sched, token_fn)
    raise AssertionError("the scheduler did not finish")


def test_chunked_prefill_samples_only_on_the_last_chunk() -> None:
    sched = make_scheduler(max_num_batched_tokens=16)
    seq = add(sched, "a", list(range(3, 53)), max_tokens=2)
    chunks = []
    for _ in range(4):
        out, outputs = step(sched)
        chunks.append((out.num_new_tokens, out.sampling_mask, len(outputs)))
    assert chunks == [([16], [False], 0), ([16], [False], 0), ([16], [False], 0), ([2], [True], 1)]
    assert seq.num_computed_tokens == 50 and seq.num_output_tokens == 1
    out, _ = step(sched)
    assert out.num_new_tokens == [1] and seq.finish_reason == FinishReason.LENGTH


def test_running_first_then_waiting_chunked_to_the_rest_of_the_budget() -> None:
    sched = make_scheduler(max_num_batched_tokens=32)
    a = add(sched, "a", list(range(3, 13)), max_tokens=50)
    step(sched)
    b = add(sched, "b", list(range(3, 103)), max_tokens=5)
    out, _ = step(sched)
    assert out.seqs == [a, b] and out.num_new_tokens == [1, 31]
    assert out.sampling_mask == [True, False] and out.sampling_indices == [0]
    out, _ = step(sched)
    assert out.seqs == [a, b] and out.num_new_tokens == [1, 31]


def test_max_num_seqs_caps_the_running_set() -> None:
    sched = make_scheduler(max_num_seqs=2)
    seqs = [add(sched, str(i), [5, 6, 7], max_tokens=3) for i in range(5)]
    out, _ = step(sched)
    assert out.seqs == seqs[:2]
    assert sched.num_running == 2 and sched.num_waiting == 3
    assert run_to_end(sched) > 0
    assert all(seq.num_output_tokens == 3 for seq in seqs)


def test_running_set_never_outgrows_the_token_budget() -> None:
    sched = make_scheduler(max_num_seqs=8, max_num_batched_tokens=4)
    for i in range(6):
        add(sched, str(i), [5], max_tokens=3)
    step(sched)
    out, _ = step(sched)
    assert sched.num_running == 4 and len(out.seqs) == 4 and all(out.sampling_mask)


def test_budget_and_invariants_hold_on_a_random_workload() -> None:
    rng = random.Random(0)
    shared = [rng.randrange(3, 500) for _ in range(24)]

    def workload(sched: Scheduler) -> list[Sequence]:
        rng = random.Random(1)
        seqs = []
        for i in range(40):
            prefix = shared[: rng.choice([0, 6, 8, 23, 24])]
            prompt = prefix + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 30))]
            n = rng.choice([1, 1, 3])
            params = SamplingParams(n=n, max_tokens=rng.randrange(1, 20))
            for index in range(n):
                seq = Sequence(str(i), prompt, params, index)
                sched.add(seq)
                seqs.append(seq)
        return seqs

    tight = make_scheduler(max_num_batched_tokens=24, num_kv_blocks=20, max_num_seqs=6)
    roomy = make_scheduler(max_num_batched_tokens=4096, num_kv_blocks=4096, max_num_seqs=256)
    tight_seqs, roomy_seqs = workload(tight), workload(roomy)
    run_to_end(tight)
    run_to_end(roomy)
    assert tight.num_preemptions > 0 and tight.block_manager.num_prefix_hits > 0
    assert roomy.num_preemptions == 0
    for t, r in zip(tight_seqs, roomy_seqs, strict=True):
        assert t.token_ids == r.token_ids and t.finish_reason == FinishReason.LENGTH


def test_preemption_requeues_the_newest_and_recomputes_it() -> None:
    sched = make_scheduler(num_kv_blocks=4)
    a = add(sched, "a", [3, 4, 5, 6, 7, 8, 9], max_tokens=4)
    b = add(sched, "b", [13, 14, 15, 16, 17, 18, 19], max_tokens=4)
    c = add(sched, "c", [1, 2, 3], max_tokens=1)
    step(sched)
    step(sched)
    assert sched.block_manager.num_free_blocks == 0 and sched.num_waiting == 1

    out, _ = step(sched)
    assert out.preempted == [b] and out.seqs == [a]
    assert list(sched.waiting) == [b, c], "preempted seqs go to the head of the queue"
    assert b.status == SequenceStatus.WAITING and b.block_table == []
    assert b.num_computed_tokens == b.num_cached_tokens == 0
    assert b.num_output_tokens == 2 and sched.num_preemptions == b.num_preemptions == 1

    step(sched)
    assert a.is_finished
    out, _ = step(sched)
    assert out.seqs[0] is b and out.num_new_tokens[0] == 9 - 4 and out.sampling_mask[0]
    # NOTE: its re-admission hit its own first block, but no prompt token came from the cache.
    assert b.num_computed_tokens == 9 and b.num_cached_tokens == 0
    run_to_end(sched)

    reference = make_scheduler()
    ref = add(reference, "b", [13, 14, 15, 16, 17, 18, 19], max_tokens=4)
    run_to_end(reference)
    assert b.token_ids == ref.token_ids and b.finish_reason == FinishReason.LENGTH
    assert c.num_output_tokens == 1


def test_newest_seq_preempts_itself() -> None:
    sched = make_scheduler(num_kv_blocks=4)
    a = add(sched, "a", [3, 4, 5, 6, 7, 8, 9], max_tokens=8)
    b = add(sched, "b", [13, 14, 15], max_tokens=8)
    step(sched)
    step(sched)
    out, _ = step(sched)
    assert out.seqs == [a] and out.preempted == [b]
    assert list(sched.waiting) == [b]
    run_to_end(sched)
    assert a.num_output_tokens == b.num_output_tokens == 8


def test_no_admission_in_a_step_that_preempted() -> None:
    sched = make_scheduler(num_kv_blocks=5, max_num_batched_tokens=8, enable_prefix_caching=False)
    a = add(sched, "a", list(range(3, 11)), max_tokens=10)
    b = add(sched, "b", list(range(3, 15)), max_tokens=1)
    step(sched)
    step(sched)
    out, _ = step(sched)
    # NOTE: b's freed blocks would fit its next 7-token chunk, but it must not thrash back in.
    assert out.seqs == [a] and out.preempted == [b]
    assert list(sched.waiting) == [b] and sched.block_manager.num_free_blocks == 2
    run_to_end(sched)
    assert b.num_output_tokens == 1


@pytest.mark.parametrize(
    ("params", "emitted", "expected_output", "reason", "stop_reason"),
    [
        ({}, [5, EOS, 6], [5, EOS], FinishReason.STOP, None),
        (
            {"ignore_eos": True, "max_tokens": 3},
            [5, EOS, 6],
            [5, EOS, 6],
            FinishReason.LENGTH,
            None,
        ),
        ({"stop_token_ids": [7]}, [5, 7, 6], [5, 7], FinishReason.STOP, 7),
        ({"stop_token_ids": [EOS]}, [EOS], [EOS], FinishReason.STOP, None),
        ({"stop_token_ids": [EOS], "ignore_eos": True}, [EOS], [EOS], FinishReason.STOP, EOS),
        ({"max_tokens": 2}, [5, 6, 7], [5, 6], FinishReason.LENGTH, None),
        ({"min_tokens": 2}, [EOS, EOS, EOS, 5], [EOS, EOS, EOS], FinishReason.STOP, None),
        ({"min_tokens": 1, "stop_token_ids": [7]}, [7, 7], [7, 7], FinishReason.STOP, 7),
        ({"min_tokens": 2, "max_tokens": 2}, [EOS, EOS, 5], [EOS, EOS], FinishReason.LENGTH, None),
    ],
)
def test_finish_rules(
    params: dict, emitted: list[int], expected_output: list[int], reason: FinishReason, stop_reason
) -> None:
    sched = make_scheduler()
    seq = add(sched, "r", [3, 4, 5], **{"max_tokens": 10, **params})
    run_to_end(sched, lambda s: emitted[s.num_output_tokens])
    assert seq.output_token_ids == expected_output
    assert (seq.finish_reason, seq.stop_reason) == (reason, stop_reason)
    assert seq.status == SequenceStatus.FINISHED and seq.block_table == []


def test_max_model_len_finishes_with_length() -> None:
    sched = make_scheduler(max_model_len=13)
    seq = add(sched, "r", list(range(3, 13)), max_tokens=100)
    run_to_end(sched)
    assert seq.num_tokens == 13 and seq.num_output_tokens == 3
    assert seq.finish_reason == FinishReason.LENGTH


def test_update_returns_seqs_with_tokens_and_logprobs() -> None:
    sched = make_scheduler(max_num_batched_tokens=4)
    a = add(sched, "a", [3, 4], max_tokens=1)
    b = add(sched, "b", [5, 6, 7, 8, 9], max_tokens=1)
    out = sched.schedule()
    assert out.num_new_tokens == [2, 2] and out.sampling_indices == [0]
    logprob = TokenLogprobs(logprob=-0.5, top_token_ids=[11], top_logprobs=[-0.5])
    update = sched.update(out, [11], [logprob])
    assert update == StepUpdate([a], [11], [logprob], finished=[a], started=[a])
    assert a.output_token_ids == [11] and a.finish_reason == FinishReason.LENGTH
    assert b.num_computed_tokens == 2 and b.num_output_tokens == 0
    with pytest.raises(AssertionError):
        sched.update(sched.schedule(), [1, 2])


def test_abort_waiting_and_running_samples() -> None:
    sched = make_scheduler(max_num_seqs=2)
    running = add(sched, "run", [3, 4, 5], max_tokens=50)
    pair = [add(sched, "pair", [6, 7, 8], index, n=2, max_tokens=50) for index in range(2)]
    other = add(sched, "other", [9, 10], max_tokens=2)
    step(sched)
    assert sched.running == [running, pair[0]] and list(sched.waiting) == [pair[1], other]

    sched.abort(pair)
    assert all(s.finish_reason == FinishReason.ABORT and s.block_table == [] for s in pair)
    assert sched.running == [running] and list(sched.waiting) == [other]
    out, _ = step(sched)
    assert out.seqs == [running, other]

    sched.abort([running, pair[0]])
    assert pair[0].finish_reason == FinishReason.ABORT
    run_to_end(sched)
    assert running.finish_reason == FinishReason.ABORT and other.num_output_tokens == 2


def test_abort_between_schedule_and_update_drops_its_token() -> None:
    sched = make_scheduler()
    a = add(sched, "a", [3, 4], max_tokens=5)
    b = add(sched, "b", [5, 6], max_tokens=5)
    out = sched.schedule()
    sched.abort([a])
    logprobs = [TokenLogprobs(-1.0, [], []), TokenLogprobs(-2.0, [], [])]
    update = sched.update(out, [11, 12], logprobs)
    assert update == StepUpdate([b], [12], logprobs[1:], finished=[], started=[b])
    assert b.output_token_ids == [12] and a.output_token_ids == []


def test_abort_between_schedule_and_update_of_a_decode_step_drops_its_token() -> None:
    sched = make_scheduler()
    a = add(sched, "a", [3, 4], max_tokens=5)
    b = add(sched, "b", [5, 6], max_tokens=2)
    c = add(sched, "c", [7, 8], max_tokens=5)
    step(sched)
    out = sched.schedule()
    assert out.num_new_tokens == [1, 1, 1]
    sched.abort([a])
    update = sched.update(out, [11, 12, 13])
    assert update.seqs == [b, c] and update.token_ids == [12, 13] and update.finished == [b]
    assert a.num_computed_tokens == 2 and len(a.output_token_ids) == 1
    assert c.num_computed_tokens == 3 and c.output_token_ids[-1] == 13
    assert sched.running == [c] and sched.stats().num_generation_tokens == 5


def test_one_token_prompt_samples_its_first_token_in_a_decode_shaped_step() -> None:
    sched = make_scheduler()
    seq = add(sched, "a", [5], max_tokens=3)
    out = sched.schedule()
    update = sched.update(out, [9])
    assert update.started == [seq] and seq.num_computed_tokens == 1 and seq.token_ids == [5, 9]
    stats = sched.stats()
    assert (stats.num_prompt_tokens, stats.num_generation_tokens) == (1, 1)


def test_decode_steps_grow_tables_at_block_boundaries_and_preempt_when_full() -> None:
    sched = make_scheduler(num_kv_blocks=5, max_num_batched_tokens=64)
    old = add(sched, "old", [3, 4, 5], max_tokens=12)
    new = add(sched, "new", [6, 7, 8], max_tokens=12)
    step(sched)
    for _ in range(5):
        out, _ = step(sched)
        assert out.num_new_tokens == [1, 1]
    assert len(old.block_table) == len(new.block_table) == 2
    while not out.preempted:
        out, _ = step(sched)
    assert out.preempted == [new] and out.seqs == [old] and new.block_table == []
    run_to_end(sched)
    assert len(old.output_token_ids) == len(new.output_token_ids) == 12


def test_blocks_filled_by_decode_steps_are_cached() -> None:
    sched = make_scheduler()
    first = add(sched, "a", [3, 4, 5], max_tokens=6)
    run_to_end(sched)
    second = add(sched, "b", first.token_ids)
    step(sched)
    assert second.num_cached_tokens == 8
    assert second.block_table[:2] == sched.block_manager.match_prefix(first)


def test_abort_before_a_decode_step_gives_the_aborted_seq_no_block() -> None:
    sched = make_scheduler()
    a = add(sched, "a", [3, 4, 5], max_tokens=8)
    b = add(sched, "b", [6, 7, 8], max_tokens=8)
    step(sched)
    step(sched)
    assert a.num_computed_tokens == 4 and len(a.block_table) == 1
    sched.abort([a])
    out, _ = step(sched)
    assert out.seqs == [b] and a.block_table == [] and len(b.block_table) == 2


def test_a_hand_built_decode_step_leaves_a_prefilling_seq_chunked() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    a = add(sched, "a", [3, 4], max_tokens=8)
    b = add(sched, "b", list(range(10, 30)), max_tokens=8)
    step(sched)
    step(sched)
    num_computed = b.num_computed_tokens
    sched.update(SchedulerOutput(seqs=[a], num_new_tokens=[1]), [fake_token(a)])
    out, _ = step(sched)
    assert out.seqs == [a, b] and out.num_new_tokens == [1, 7]
    assert b.num_computed_tokens == num_computed + 7


def test_check_prompt() -> None:
    sched = make_scheduler(max_model_len=20, num_kv_blocks=4, block_size=4)
    params = SamplingParams(max_tokens=1)
    assert sched.check_prompt(0, params) is not None
    assert sched.check_prompt(15, params) is None
    assert sched.check_prompt(19, SamplingParams(max_tokens=1)) is not None
    assert "maximum model length" in sched.check_prompt(20, params)
    assert "KV cache" in sched.check_prompt(15, SamplingParams(max_tokens=2))


def test_check_prompt_with_a_window_counts_the_blocks_held_at_once() -> None:
    sched = make_scheduler(
        max_model_len=200, num_kv_blocks=8, block_size=4, max_num_batched_tokens=8
    )
    assert "KV cache" in sched.check_prompt(100, SamplingParams(max_tokens=10))
    windowed = make_scheduler(
        max_model_len=200,
        num_kv_blocks=8,
        block_size=4,
        max_num_batched_tokens=8,
        sliding_window=10,
    )
    assert windowed.max_live_blocks == 8
    assert windowed.check_prompt(100, SamplingParams(max_tokens=10)) is None
    seqs = [
        add(windowed, "a", list(range(10, 110)), max_tokens=10),
        add(windowed, "b", list(range(50, 110)), max_tokens=30),
    ]
    bm = windowed.block_manager
    most_used = 0
    while windowed.has_unfinished():
        step(windowed)
        most_used = max(most_used, bm.num_blocks - bm.num_free_blocks)
        for seq in windowed.running:
            assert seq.num_dropped_blocks * 4 <= max(0, seq.num_computed_tokens - 10)
            assert len(seq.block_table) - seq.num_dropped_blocks <= windowed.max_live_blocks
    assert all(seq.num_output_tokens == seq.params.max_tokens for seq in seqs)
    assert most_used <= 8 and bm.usage == 0.0


def test_prefix_cache_hit_skips_the_shared_blocks() -> None:
    sched = make_scheduler()
    prompt = list(range(3, 21))
    a = add(sched, "a", prompt, max_tokens=2)
    run_to_end(sched)
    b = add(sched, "b", [*prompt[:12], 99, 98], max_tokens=2)
    out, _ = step(sched)
    assert out.num_new_tokens == [2] and b.num_cached_tokens == 12
    run_to_end(sched)
    stats = sched.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (18 + 14, 12)
    assert stats.num_generation_tokens == 4 and stats.num_prompt_tokens == 18 + 2
    assert a.num_cached_tokens == 0


def test_a_prefix_ending_inside_a_block_is_copied_not_computed() -> None:
    sched = make_scheduler()
    prompt = list(range(3, 13))
    a = add(sched, "a", prompt, max_tokens=2)
    out, _ = step(sched)
    source = a.block_table[1]
    assert out.kv_copies == []
    run_to_end(sched)
    b = add(sched, "b", [*prompt[:6], 99, 98], max_tokens=2)
    out, _ = step(sched)
    assert out.seqs == [b] and out.num_new_tokens == [2]
    assert out.kv_copies == [(source, b.block_table[1], 2)]
    assert b.num_cached_tokens == 6 and not sched.block_manager.pinned
    run_to_end(sched)
    assert sched.stats().prefix_cache_hits == 6


def test_samples_of_one_request_share_the_prompt_blocks() -> None:
    sched = make_scheduler()
    samples = [add(sched, "r", list(range(3, 21)), index, n=3, max_tokens=3) for index in range(3)]
    out, _ = step(sched)
    assert out.seqs == samples[:1] and sched.num_waiting == 2
    out, _ = step(sched)
    assert out.seqs == samples and out.num_new_tokens == [1, 2, 2]
    assert [s.num_cached_tokens for s in samples] == [0, 16, 16]
    assert samples[1].block_table[:4] == samples[0].block_table[:4]
    run_to_end(sched)
    assert len({tuple(s.output_token_ids) for s in samples}) == 3


def test_requests_sharing_a_prefix_compute_it_once() -> None:
    """Admitted together, the first computes the shared blocks; the rest wait for its step,
    then hit the cache, also when the shared part takes the first one two steps."""
    sched = make_scheduler(max_num_batched_tokens=16)
    shared = list(range(3, 23))  # 5 blocks of 4
    seqs = [add(sched, str(i), [*shared, 50 + i, 60 + i], max_tokens=2) for i in range(3)]
    other = add(sched, "other", [70, 71, 72, 73, 74], max_tokens=2)
    out, _ = step(sched)
    assert out.seqs == seqs[:1] and out.num_new_tokens == [16]
    out, _ = step(sched)
    # NOTE: 4 of the 5 shared blocks are cached; the fifth is still the first seq's to compute.
    assert out.seqs == seqs[:1] and sched.num_waiting == 3
    out, _ = step(sched)
    assert out.seqs == [*seqs, other] and out.num_new_tokens == [1, 2, 2, 5]
    assert [seq.num_cached_tokens for seq in seqs] == [0, 20, 20]
    run_to_end(sched)
    stats = sched.stats()
    assert stats.prefix_cache_hits == 40 and stats.num_prompt_tokens == 22 + 2 * 2 + 5


def test_an_aborted_prefix_owner_lets_the_queue_go_on() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    shared = list(range(3, 23))
    first = add(sched, "a", [*shared, 50], max_tokens=2)
    second = add(sched, "b", [*shared, 51], max_tokens=2)
    step(sched)
    assert sched.num_running == 1 and sched.num_waiting == 1
    sched.abort([first])
    out, _ = step(sched)
    assert out.seqs == [second] and second.num_cached_tokens == 8


def test_prefix_caching_disabled_computes_every_token() -> None:
    sched = make_scheduler(enable_prefix_caching=False)
    for index in range(2):
        add(sched, "r", list(range(3, 21)), index, n=2, max_tokens=2)
    out, _ = step(sched)
    assert out.num_new_tokens == [18, 18]
    run_to_end(sched)
    assert sched.stats().prefix_cache_hits == 0


def test_empty_schedule_and_stats() -> None:
    sched = make_scheduler()
    out = sched.schedule()
    assert out.is_empty and out.num_batched_tokens == 0 and out.sampling_indices == []
    assert sched.update(out, []) == StepUpdate([], [], None, [], [])
    add(sched, "a", [3, 4, 5], max_tokens=1)
    assert sched.has_unfinished() and sched.stats().num_waiting == 1
    run_to_end(sched)
    stats = sched.stats()
    assert (stats.num_steps, stats.num_scheduled_tokens, stats.kv_usage) == (1, 3, 0.0)
    assert not sched.has_unfinished()


def test_a_decode_step_continues_the_last_only_with_the_same_seqs_each_one_token_on() -> None:
    sched = make_scheduler(max_num_seqs=4)
    a = add(sched, "a", [5, 6, 7], max_tokens=4)
    b = add(sched, "b", [8, 9], max_tokens=20)
    prefill, _ = step(sched)
    first, _ = step(sched)
    assert prefill.continues_step == -1 and first.continues_step == -1
    second, _ = step(sched)
    assert second.continues_step == first.step_id and second.seqs == [a, b]
    third, _ = step(sched)
    assert third.continues_step == second.step_id
    assert a.is_finished  # its 4th token came in `third`, so `b` decodes alone next
    alone, _ = step(sched)
    assert alone.continues_step == -1 and alone.seqs == [b]
    continued, _ = step(sched)
    assert continued.continues_step == alone.step_id
    c = add(sched, "c", [3, 4])
    admitted, _ = step(sched)
    assert admitted.continues_step == -1 and admitted.seqs == [b, c]
    decode, _ = step(sched)
    assert decode.continues_step == -1 and decode.num_batched_tokens == 2
    sched.abort([c])
    after_abort, _ = step(sched)
    assert after_abort.continues_step == -1 and after_abort.seqs == [b]


def snapshot(sched: Scheduler, seqs: list[Sequence]) -> list[object]:
    """Everything a step leaves in the seqs and the scheduler's counters."""
    state: list[object] = [sched.num_running, sched.num_waiting, sched.num_preemptions]
    state += [sched.num_generation_tokens, sched.num_prompt_tokens, sched.block_manager.usage]
    for seq in seqs:
        state.append(
            (
                list(seq.token_ids),
                seq.num_computed_tokens,
                len(seq.block_table),
                seq.status,
                seq.finish_reason,
                seq.stop_reason,
            )
        )
    return state


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_continued_decode_steps_apply_like_the_general_path(enable_prefix_caching: bool) -> None:
    """Two schedulers take the same tokens; one applies every step by the general path (its
    outputs are marked as continuing nothing), the other applies continuing decode steps
    through its DecodeRun. Tokens include EOS, stop ids (before and after min_tokens) and
    repeats; requests end by length, stop and abort, and are admitted mid-run."""
    rng = random.Random(5)
    scheds = [
        make_scheduler(
            max_num_seqs=6, num_kv_blocks=40, enable_prefix_caching=enable_prefix_caching
        )
        for _ in range(2)
    ]
    seqs: list[list[Sequence]] = [[], []]
    shared = [rng.randrange(10, 99) for _ in range(9)]

    def add_both(request_id: str, prompt: list[int], **params: object) -> None:
        for sched, own in zip(scheds, seqs, strict=True):
            own.append(add(sched, request_id, prompt, **params))

    for i in range(5):
        prompt = shared[: 3 + 2 * i] + [rng.randrange(10, 99) for _ in range(i)]
        add_both(str(i), prompt, max_tokens=20 + 9 * i, stop_token_ids=[77], min_tokens=i)
    add_both("long", shared[:4], max_tokens=300, ignore_eos=True)
    num_fast_steps = 0
    for num_steps in range(400):
        if num_steps in (11, 37):
            add_both(f"late{num_steps}", shared[:5], max_tokens=30)
        if not scheds[0].has_unfinished():
            break
        outs = [sched.schedule() for sched in scheds]
        if num_steps == 60:
            # NOTE: between schedule() and update(), as a client's abort can land.
            for sched, own in zip(scheds, seqs, strict=True):
                sched.abort([own[5]])
        assert [len(out.seqs) for out in outs] == [len(outs[1].seqs)] * 2
        num_fast_steps += outs[0].continues_step != -1
        outs[1].continues_step = -1
        draw = rng.random()
        tokens = [
            EOS if draw < 0.03 else 77 if draw < 0.06 else rng.randrange(10, 99)
            for _ in outs[0].sampling_indices
        ]
        updates = [sched.update(out, list(tokens)) for sched, out in zip(scheds, outs, strict=True)]
        assert [seq.seq_id for seq in updates[0].seqs] == [
            seqs[0][seqs[1].index(seq)].seq_id for seq in updates[1].seqs
        ]
        assert updates[0].token_ids == updates[1].token_ids
        assert len(updates[0].finished) == len(updates[1].finished)
        assert snapshot(scheds[0], seqs[0]) == snapshot(scheds[1], seqs[1])
    assert not scheds[0].has_unfinished() and num_fast_steps > 20
    assert {seq.finish_reason for seq in seqs[0]} == {
        FinishReason.STOP,
        FinishReason.LENGTH,
        FinishReason.ABORT,
    }


def test_schedule_ahead_continues_a_decode_step_before_its_update() -> None:
    sched = make_scheduler(max_num_seqs=2)
    a = add(sched, "a", list(range(3, 10)), max_tokens=20)
    b = add(sched, "b", list(range(3, 6)), max_tokens=3)
    step(sched)
    out = sched.schedule()
    ahead = sched.schedule_ahead(out)
    assert ahead is not None and ahead.continues_step == out.step_id and ahead.seqs == [a, b]
    # NOTE: room for the token `out` samples and the one `ahead` samples after it.
    assert [len(s.block_table) * 4 >= s.num_tokens + 1 for s in (a, b)] == [True, True]
    sched.update(out, [fake_token(a), fake_token(b)])
    assert sched.schedule_ahead(ahead) is None, "b's next token is its last"
    sched.update(ahead, [fake_token(a), fake_token(b)])
    assert b.is_finished and a.num_output_tokens == 3
    add(sched, "c", [5, 6, 7], max_tokens=4)
    out = sched.schedule()
    assert sched.schedule_ahead(out) is None, "c waits to be admitted, or has just been"


def test_schedule_ahead_leaves_penalised_sampling_alone() -> None:
    sched = make_scheduler()
    add(sched, "a", list(range(3, 10)), max_tokens=20, presence_penalty=0.5)
    step(sched)
    assert sched.schedule_ahead(sched.schedule()) is None


def test_schedule_ahead_leaves_a_step_with_a_prefill_chunk_alone() -> None:
    """A full running set at one token per seq: b's one-token prefill chunk does not sample, so
    a step continuing this one would compute that position again and sample it twice."""
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=2)
    a = add(sched, "a", [5], max_tokens=20)
    b = add(sched, "b", list(range(3, 12)), max_tokens=5)
    for _ in range(3):
        out = sched.schedule()
        assert out.seqs == [a, b] and out.num_new_tokens == [1, 1]
        assert out.sampling_mask == [True, False]
        assert sched.schedule_ahead(out) is None
        sched.update(out, [fake_token(a)])
    run_to_end(sched)
    assert b.num_output_tokens == 5


def test_a_preempted_seq_that_needs_the_whole_pool_runs_without_its_partial_hit() -> None:
    """Two samples of a 40-token prompt, each needing all 4 blocks: one is preempted, and once
    the other finishes its re-admission matched 2 cached blocks and a partial copy, whose pinned
    source made 5 blocks of 4. It waited with nothing running, for ever; it now recomputes."""
    sched = make_scheduler(block_size=16, num_kv_blocks=4, max_num_batched_tokens=32)
    prompt = [(17 * i) % 40000 + 100 for i in range(40)]
    first = add(sched, "r", prompt, index=0, max_tokens=23, ignore_eos=True)
    second = add(sched, "r", prompt, index=1, max_tokens=23, ignore_eos=True)
    run_to_end(sched, max_steps=200)
    assert sched.num_preemptions >= 1
    assert first.num_output_tokens == second.num_output_tokens == 23
