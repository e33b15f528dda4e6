"""HostBatch: one step's host-side batch arrays (ids, positions, slots, block tables); no torch."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from vbatch.engine.scheduler import SchedulerOutput


@dataclass
class HostBatch:
    """The arrays a step's AttentionMetadata and model inputs are made of, in batch order.

    Invariants: sequence i owns token rows `query_start_loc[i]:query_start_loc[i+1]`;
    `logits_rows[k]` is the last token row of sequence `sample_rows[k]`; block tables are padded
    with 0 past each sequence's last block.
    """

    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64
    query_start_loc: np.ndarray  # [num_seqs + 1] int32
    seq_lens: np.ndarray  # [num_seqs] int32
    block_tables: np.ndarray  # [num_seqs, max_num_blocks] int32
    logits_rows: np.ndarray  # [num_sampling_seqs] int64
    sample_rows: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int


def build_host_batch(out: SchedulerOutput, block_size: int) -> HostBatch:
    """The host arrays of `out`, read from its seqs before update() moves them on."""
    if max(out.num_new_tokens) == 1:
        return _build_single_token(out, block_size)
    return _build_mixed(out, block_size)


def _build_single_token(out: SchedulerOutput, block_size: int) -> HostBatch:
    # NOTE: one token per seq (the decode steady state). After a CPU forward pass has swept the
    # caches a numpy call costs ~15 µs, far more than a Python pass over 256 seqs, so this path
    # builds plain lists, packs them with two array constructions and gathers the block tables.
    seqs = out.seqs
    num_seqs = len(seqs)
    positions = [seq.num_computed_tokens for seq in seqs]
    input_ids = [seq.token_ids[p] for seq, p in zip(seqs, positions)]
    tables = [seq.block_table for seq in seqs]
    slots = [
        table[p // block_size] * block_size + p % block_size for table, p in zip(tables, positions)
    ]
    seq_lens = [p + 1 for p in positions]
    mask = out.sampling_mask
    sample_rows = list(range(num_seqs)) if all(mask) else [i for i, s in enumerate(mask) if s]
    max_num_blocks = max(map(len, tables))
    int64s = np.array(input_ids + positions + slots + sample_rows, dtype=np.int64)
    int32s = np.array(seq_lens + list(range(num_seqs + 1)), dtype=np.int32)
    n = num_seqs
    return HostBatch(
        input_ids=int64s[:n],
        positions=int64s[n : 2 * n],
        slot_mapping=int64s[2 * n : 3 * n],
        query_start_loc=int32s[n : 2 * n + 1],
        seq_lens=int32s[:n],
        block_tables=_block_tables(out, max_num_blocks),
        logits_rows=int64s[3 * n :],
        sample_rows=sample_rows,
        seq_lens_cpu=seq_lens,
        max_query_len=1,
        max_seq_len=max(seq_lens),
    )


def _build_mixed(out: SchedulerOutput, block_size: int) -> HostBatch:
    seqs, num_new = out.seqs, out.num_new_tokens
    num_seqs = len(seqs)
    starts = np.array([s.num_computed_tokens for s in seqs], dtype=np.int64)
    query_lens = np.array(num_new, dtype=np.int64)
    seq_lens = starts + query_lens
    input_ids = np.fromiter(
        itertools.chain.from_iterable(
            s.token_ids[c : c + n] for s, c, n in zip(seqs, starts.tolist(), num_new)
        ),
        np.int64,
    )
    num_tokens = len(input_ids)
    seq_index = np.repeat(np.arange(num_seqs), query_lens)
    offsets = np.arange(num_tokens) - np.repeat(np.cumsum(query_lens) - query_lens, query_lens)
    positions = starts[seq_index] + offsets
    block_tables = _block_tables(out, max(len(s.block_table) for s in seqs))
    blocks = block_tables[seq_index, positions // block_size].astype(np.int64)
    slot_mapping = blocks * block_size + positions % block_size
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int32)
    np.cumsum(query_lens, out=query_start_loc[1:])
    sample_rows = np.flatnonzero(out.sampling_mask)
    seq_lens_cpu = seq_lens.tolist()
    return HostBatch(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens.astype(np.int32),
        block_tables=block_tables,
        logits_rows=query_start_loc[1:][sample_rows].astype(np.int64) - 1,
        sample_rows=sample_rows.tolist(),
        seq_lens_cpu=seq_lens_cpu,
        max_query_len=max(num_new),
        max_seq_len=max(seq_lens_cpu),
    )


def _block_tables(out: SchedulerOutput, max_num_blocks: int) -> np.ndarray:
    """[num_seqs, max_num_blocks] int32, 0-padded; from the BlockManager's rows when given."""
    if out.block_tables is not None:
        return out.block_tables[out.block_rows, :max_num_blocks]
    block_tables = np.zeros((len(out.seqs), max_num_blocks), dtype=np.int32)
    for row, seq in zip(block_tables, out.seqs):
        row[: len(seq.block_table)] = seq.block_table
    return block_tables
