"""Tests for StepApplier on a real BlockManager: aborted seqs' tokens are dropped, finished seqs
are freed, and a continuing decode step goes through the DecodeRun; and DecodeRun itself: which
continuing decode steps it applies, and the seqs it reports as opening a block."""

from vbatch.engine.applier import DecodeRun, StepApplier
from vbatch.engine.block_manager import BlockManager
from vbatch.engine.prefill_claims import PrefillClaims
from vbatch.engine.sequence import Sequence
from vbatch.engine.steps import SchedulerOutput
from vbatch.protocol import FinishReason, TokenLogprobs
from vbatch.sampling_params import SamplingParams

EOS = 2
BLOCK_SIZE = 4


def decoding(manager: BlockManager, prompts: list[list[int]], **params: object) -> list[Sequence]:
    """Seqs with their prompts computed but the last token, as after a chunked prefill."""
    seqs = []
    for prompt in prompts:
        seq = Sequence("r", prompt, SamplingParams(**params))
        manager.allocate(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens - 1
        seq.max_num_tokens = seq.num_prompt_tokens + seq.params.max_tokens
        seq.finish_token_ids = frozenset({EOS})
        seqs.append(seq)
    return seqs


def make_applier(manager: BlockManager) -> StepApplier:
    return StepApplier(manager, PrefillClaims(manager), frozenset({EOS}))


def test_a_seq_aborted_after_planning_loses_its_token_and_logprob() -> None:
    manager = BlockManager(32, 4)
    applier = make_applier(manager)
    a, b, c = decoding(manager, [[5, 6, 7, 8, 9], [5, 6, 7], [11, 12]], max_tokens=8)
    out = SchedulerOutput(seqs=[a, b, c], num_new_tokens=[1, 1, 1])
    b.finish(FinishReason.ABORT)
    logprobs = [TokenLogprobs(-float(k), [], []) for k in range(3)]
    applied = applier.apply(out, [20, 21, EOS], logprobs, num_running=3)
    update = applied.update
    assert update.seqs == [a, c] and update.token_ids == [20, EOS]
    assert update.logprobs == [logprobs[0], logprobs[2]]
    assert update.finished == [c] and c.finish_reason == FinishReason.STOP
    assert c.block_row == -1 and not c.block_table, "a finished seq is freed"
    assert applied.crossing is None, "a seq left the step"
    assert applier.num_generation_tokens == 2


def test_continuing_decode_steps_report_the_seqs_that_open_a_block() -> None:
    manager = BlockManager(32, 4)
    applier = make_applier(manager)
    a, b = decoding(manager, [[5, 6, 7], [5, 6, 7, 8, 9, 10]], max_tokens=20)
    first = SchedulerOutput(seqs=[a, b], num_new_tokens=[1, 1])
    applied = applier.apply(first, [30, 31], None, num_running=2)
    assert applied.crossing == [] and a.num_tokens == 4
    assert applied.update.started == [a, b], "their last prompt token was computed"
    second = SchedulerOutput(seqs=[a, b], num_new_tokens=[1, 1], continues_step=first.step_id)
    applied = applier.apply(second, [32, 33], None, num_running=2)
    assert applied.crossing == [a], "a's new token is its 5th, to be computed in a new block"
    assert a.token_ids[-2:] == [30, 32] and b.num_tokens == 8
    third = SchedulerOutput(seqs=[a, b], num_new_tokens=[1, 1], continues_step=second.step_id)
    assert applier.apply(third, [34, 35], None, num_running=2).crossing == [b]
    fourth = SchedulerOutput(seqs=[a, b], num_new_tokens=[1, 1], continues_step=third.step_id)
    applied = applier.apply(fourth, [EOS, 36], None, num_running=3)
    assert applied.update.finished == [a] and applied.crossing is None
    assert applier.num_generation_tokens == 8 and applier.num_prompt_tokens == 2


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
