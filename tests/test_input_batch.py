"""Tests for build_host_batch: the one-token fast path and the BlockManager rows agree with the
general path on the seqs' own lists."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from vbatch.engine import input_batch
from vbatch.engine.block_manager import BlockManager
from vbatch.engine.input_batch import (
    AdvanceArrays,
    DecodeBatch,
    GatheredBlockTables,
    HostBatch,
    advance_host_arrays,
    build_host_batch,
)
from vbatch.engine.scheduler import Scheduler, SchedulerConfig
from vbatch.engine.sequence import Sequence
from vbatch.engine.steps import SchedulerOutput
from vbatch.sampling_params import SamplingParams

BLOCK_SIZE = 4


def one_token_batch() -> tuple[SchedulerOutput, BlockManager]:
    """Decodes at several context lengths plus a prompt chunk of one token that does not sample."""
    bm = BlockManager(num_blocks=64, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    seqs = []
    for length in (5, 9, 4, 13):
        seq = Sequence("r", list(range(10 + length, 10 + 2 * length)), SamplingParams())
        bm.allocate(seq, length)
        seq.num_computed_tokens = length - 1
        seqs.append(seq)
    chunk = Sequence("c", list(range(50, 58)), SamplingParams())
    bm.allocate(chunk, 3)
    chunk.num_computed_tokens = 2
    seqs.append(chunk)
    out = SchedulerOutput(seqs=seqs, num_new_tokens=[1] * len(seqs))
    return out, bm


def assert_same(a: HostBatch, b: HostBatch) -> None:
    for field in dataclasses.fields(HostBatch):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.tolist() == y.tolist(), field.name
        else:
            assert x == y, field.name


def test_one_token_path_matches_the_general_path() -> None:
    out, _ = one_token_batch()
    fast = build_host_batch(out, BLOCK_SIZE)
    assert_same(fast, input_batch._build_mixed(out, BLOCK_SIZE, False))
    assert fast.sample_rows == [0, 1, 2, 3] and fast.logits_rows.tolist() == [0, 1, 2, 3]
    assert fast.positions.tolist() == [4, 8, 3, 12, 2]
    assert fast.input_ids.tolist() == [19, 27, 17, 35, 52]
    table = out.seqs[3].block_table
    assert fast.slot_mapping[3] == table[3] * BLOCK_SIZE
    assert fast.block_tables[0].tolist() == [*out.seqs[0].block_table, 0, 0]


def test_prompt_rows_are_flagged_for_the_attention_kernel() -> None:
    """A one-token step flags the seqs computing a prompt position (a tail after a prefix-cache
    hit), not those decoding; a step of decodes only flags none."""
    bm = BlockManager(num_blocks=16, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    decoding = Sequence("d", [1, 2, 3], SamplingParams())
    bm.allocate(decoding, 3)
    decoding.token_ids.append(4)
    decoding.num_computed_tokens = 3
    tail = Sequence("t", [5, 6, 7, 8, 9], SamplingParams())
    bm.allocate(tail, 5)
    tail.num_computed_tokens = 4
    both = SchedulerOutput(seqs=[decoding, tail], num_new_tokens=[1, 1])
    for host in (
        build_host_batch(both, BLOCK_SIZE),
        input_batch._build_mixed(both, BLOCK_SIZE, False),
    ):
        assert host.prompt_chunks is not None and host.prompt_chunks.tolist() == [0, 1]
    alone = SchedulerOutput(seqs=[decoding], num_new_tokens=[1])
    assert build_host_batch(alone, BLOCK_SIZE).prompt_chunks is None


def test_block_manager_rows_match_the_seqs_lists() -> None:
    out, bm = one_token_batch()
    rows = dataclasses.replace(
        out, block_tables=bm.tables, block_rows=[s.block_row for s in out.seqs]
    )
    assert_same(build_host_batch(rows, BLOCK_SIZE), build_host_batch(out, BLOCK_SIZE))
    prompts = [Sequence("p", list(range(3, 3 + n)), SamplingParams()) for n in (8, 6)]
    for seq in prompts:
        bm.allocate(seq, seq.num_tokens)
    prefill = SchedulerOutput(seqs=prompts, num_new_tokens=[8, 6])
    with_rows = dataclasses.replace(
        prefill, block_tables=bm.tables, block_rows=[s.block_row for s in prompts]
    )
    assert_same(build_host_batch(with_rows, BLOCK_SIZE), build_host_batch(prefill, BLOCK_SIZE))


def test_decode_steps_reuse_the_gathered_tables_until_the_rows_change() -> None:
    out, bm = one_token_batch()

    def with_rows(seqs: list[Sequence]) -> SchedulerOutput:
        return SchedulerOutput(
            seqs=seqs,
            num_new_tokens=[1] * len(seqs),
            block_tables=bm.tables,
            block_rows=[s.block_row for s in seqs],
            block_tables_version=bm.tables_version,
        )

    gathered = GatheredBlockTables()
    first = build_host_batch(with_rows(out.seqs), BLOCK_SIZE, gathered).block_tables
    assert build_host_batch(with_rows(out.seqs), BLOCK_SIZE, gathered).block_tables is first
    reordered = build_host_batch(with_rows(out.seqs[::-1]), BLOCK_SIZE, gathered)
    assert reordered.block_tables.tolist() == first.tolist()[::-1]
    grown = out.seqs[2]
    assert bm.append_slots(grown, 2) and len(grown.block_table) == 2
    after = build_host_batch(with_rows(out.seqs), BLOCK_SIZE, gathered)
    assert after.block_tables[2, :2].tolist() == grown.block_table
    assert_same(
        after, build_host_batch(SchedulerOutput(seqs=out.seqs, num_new_tokens=[1] * 5), BLOCK_SIZE)
    )


def advance_natively(host: HostBatch, token_ids: list[int]) -> None:
    """DecodeBatch's array update through the native op, as the CPU model runner makes it."""
    from vbatch.layers import native

    if not native.is_available():
        pytest.skip("native kernels could not be built here (see the logged notice)")
    n = host.num_tokens
    int64s, int32s = torch.from_numpy(host.int64s), torch.from_numpy(host.int32s)
    torch.ops.vbatch.advance_decode(
        int64s[:n],
        int64s[n : 2 * n],
        int64s[2 * n : 3 * n],
        int32s[:n],
        torch.tensor(token_ids),
        torch.from_numpy(host.block_tables),
        BLOCK_SIZE,
    )


def advance_in_numpy(host: HostBatch, token_ids: list[int]) -> None:
    """DecodeBatch's array update as the model runner makes it without native ops: the arrays
    move on, then the sampled ids become the input ids."""
    advance_host_arrays(host, BLOCK_SIZE)
    host.int64s[: host.num_tokens] = token_ids


@pytest.mark.parametrize(
    "advance_arrays", [advance_in_numpy, advance_natively], ids=["numpy", "native"]
)
def test_an_advanced_decode_batch_equals_a_fresh_build(advance_arrays: AdvanceArrays) -> None:
    """Through block crossings, finishes, an admission, an abort and preemptions (14 blocks)."""
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=6,
            max_num_batched_tokens=32,
            max_model_len=128,
            block_size=BLOCK_SIZE,
            num_kv_blocks=14,
            enable_prefix_caching=False,
        ),
        eos_token_ids=[],
    )
    for i, (prompt_len, max_tokens) in enumerate([(3, 9), (6, 14), (5, 20), (2, 7), (7, 12)]):
        sched.add(
            Sequence(
                str(i),
                list(range(20 + i, 20 + i + prompt_len)),
                SamplingParams(max_tokens=max_tokens),
            )
        )
    gathered, decode = GatheredBlockTables(), DecodeBatch(advance_arrays)
    previous: HostBatch | None = None
    num_advanced = 0
    for num_steps in range(200):
        if num_steps == 6:
            sched.add(Sequence("late", [7, 8, 9, 10, 11], SamplingParams(max_tokens=10)))
        if num_steps == 12:
            sched.abort([sched.running[1]])
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        host = build_host_batch(out, BLOCK_SIZE, gathered, decode)
        num_advanced += host is previous
        assert_same(host, build_host_batch(dataclasses.replace(out, block_tables=None), BLOCK_SIZE))
        previous = host
        tokens = [30 + (num_steps * 5 + i) % 50 for i in out.sampling_indices]
        decode.record(out.step_id, tokens)
        sched.update(out, tokens)
    assert not sched.has_unfinished() and sched.num_preemptions > 0
    assert num_advanced >= 5
