"""HostBatch: one step's host-side batch arrays (ids, positions, slots, block tables); no torch."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from vbatch.engine.steps import SchedulerOutput


@dataclass
class HostBatch:
    """The arrays a step's AttentionMetadata and model inputs are made of, in batch order, packed
    into two buffers so that a step moves them with one copy per dtype.

    Invariants: `int64s` is input_ids | positions | slot_mapping (num_tokens each) | logits_rows;
    `int32s` is seq_lens (num_seqs) | query_start_loc (num_seqs + 1); sequence i owns token rows
    `query_start_loc[i]:query_start_loc[i+1]`; `logits_rows[k]` is the last token row of sequence
    `sample_rows[k]`; block tables are padded with 0 past each sequence's last block.
    """

    int64s: np.ndarray  # [3 * num_tokens + num_sampling_seqs] int64
    int32s: np.ndarray  # [2 * num_seqs + 1] int32
    block_tables: np.ndarray  # [num_seqs, max_num_blocks] int32
    num_tokens: int
    sample_rows: list[int]
    max_query_len: int
    max_seq_len: int
    prompt_chunks: np.ndarray | None = None  # [num_seqs] int32, see AttentionMetadata

    @property
    def input_ids(self) -> np.ndarray:
        return self.int64s[: self.num_tokens]

    @property
    def positions(self) -> np.ndarray:
        return self.int64s[self.num_tokens : 2 * self.num_tokens]

    @property
    def slot_mapping(self) -> np.ndarray:
        return self.int64s[2 * self.num_tokens : 3 * self.num_tokens]

    @property
    def logits_rows(self) -> np.ndarray:
        return self.int64s[3 * self.num_tokens :]

    @property
    def num_seqs(self) -> int:
        return len(self.int32s) // 2

    @property
    def seq_lens(self) -> np.ndarray:
        return self.int32s[: self.num_seqs]

    @property
    def query_start_loc(self) -> np.ndarray:
        return self.int32s[self.num_seqs :]


@dataclass
class GatheredBlockTables:
    """The block tables one step gathered from a BlockManager's rows, kept for the next step.

    Invariant: `block_tables` is `source[rows, :block_tables.shape[1]]` as of tables version
    `version`; `source` is None until the first gather.
    """

    source: np.ndarray | None = None
    version: int = -1
    rows: list[int] | None = None
    block_tables: np.ndarray | None = None  # [num_seqs, max_num_blocks] int32

    def get(self, out: SchedulerOutput, max_num_blocks: int) -> np.ndarray | None:
        """The gather `out` needs, if it is the one kept."""
        block_tables = self.block_tables
        if (
            out.block_tables is self.source
            and out.block_tables_version == self.version
            and block_tables is not None
            and block_tables.shape[1] == max_num_blocks
            and out.block_rows == self.rows
        ):
            return block_tables
        return None

    def keep(self, out: SchedulerOutput, block_tables: np.ndarray) -> None:
        self.source = out.block_tables
        self.version = out.block_tables_version
        self.rows = out.block_rows
        self.block_tables = block_tables


AdvanceArrays = Callable[[HostBatch, Any], None]


def advance_host_arrays(host: HostBatch, block_size: int) -> None:
    """Move a decode batch's host arrays on by one token per row: positions and context lengths
    + 1, every slot read from `host.block_tables`; the input ids are left to the caller."""
    n = host.num_tokens
    int64s = host.int64s
    positions = int64s[n : 2 * n]
    positions += 1
    host.int32s[:n] += 1
    blocks = host.block_tables[np.arange(n), positions // block_size]
    int64s[2 * n : 3 * n] = blocks * block_size + positions % block_size


class DecodeBatch:
    """A decode step's HostBatch, kept and advanced in place by the steps that continue it (see
    SchedulerOutput).

    Invariants: when `host` is set it is the batch of output `step_id`, in which every seq
    computes one token and samples; `next_token_ids` is what that step sampled once the runner
    has recorded it, else None. `advance_arrays(host, next_token_ids)` moves the host arrays on
    (or the tensors viewing them) once the block tables of the new step are in place.
    """

    def __init__(self, advance_arrays: AdvanceArrays) -> None:
        self.host: HostBatch | None = None
        self.step_id = -1
        self.next_token_ids: Any = None
        self.block_rows: np.ndarray | None = None  # [num_seqs] intp, gathered on first need
        self._advance_arrays = advance_arrays

    def start(self, out: SchedulerOutput, host: HostBatch) -> None:
        """Keep `host`, the batch just built for `out`, if a later step can advance it."""
        self.next_token_ids = None
        if host.max_query_len != 1 or len(host.sample_rows) != host.num_tokens:
            self.host = None
            self.step_id = -1
            return
        self.host = host
        self.step_id = out.step_id
        self.block_rows = None

    def record(self, step_id: int, token_ids: Any) -> None:
        """Note the tokens step `step_id` sampled; they are the next step's input ids."""
        if step_id == self.step_id:
            self.next_token_ids = token_ids

    def advance(
        self, out: SchedulerOutput, block_size: int, gathered: GatheredBlockTables
    ) -> HostBatch | None:
        """The kept batch moved on to `out`, if `out` continues it; else None."""
        host = self.host
        token_ids = self.next_token_ids
        if host is None or token_ids is None or out.continues_step != self.step_id:
            return None
        assert out.block_tables is not None
        self.step_id = out.step_id
        self.next_token_ids = None
        host.max_seq_len += 1
        max_num_blocks = -(-host.max_seq_len // block_size)
        block_tables = gathered.get(out, max_num_blocks)
        if block_tables is None:
            if self.block_rows is None:
                self.block_rows = np.array(out.block_rows, dtype=np.intp)
            block_tables = out.block_tables[self.block_rows, :max_num_blocks]
            gathered.keep(out, block_tables)
        host.block_tables = block_tables
        host.prompt_chunks = None
        self._advance_arrays(host, token_ids)
        return host


def build_host_batch(
    out: SchedulerOutput,
    block_size: int,
    gathered: GatheredBlockTables | None = None,
    decode: DecodeBatch | None = None,
    outputs_by_row: bool = False,
) -> HostBatch:
    """The host arrays of `out`, read from its seqs before update() moves them on; `gathered`
    carries a decode step's block tables to the next step, which reuses them while unchanged;
    `decode` keeps a decode step's batch, which a step continuing it advances in place.
    `outputs_by_row` (batch-invariant mode, whose chunks end at the prompt): only prompt chunks
    are flagged as such, so a preempted seq's outputs are recomputed row by row, rounding as
    when they were decoded."""
    gathered = gathered or GatheredBlockTables()
    if decode is not None:
        host = decode.advance(out, block_size, gathered)
        if host is not None:
            return host
    if max(out.num_new_tokens) == 1:
        host = _build_single_token(out, block_size, gathered)
    else:
        host = _build_mixed(out, block_size, outputs_by_row)
    if decode is not None:
        decode.start(out, host)
    return host


def _build_single_token(
    out: SchedulerOutput, block_size: int, gathered: GatheredBlockTables
) -> HostBatch:
    # NOTE: one token per seq (the decode steady state). After a CPU forward pass has swept the
    # caches a numpy call costs ~15 µs, far more than a Python pass over 256 seqs, so this path
    # builds plain lists and makes them arrays with two conversions. Block tables change in one
    # decode step of block_size, so the last step's gather is reused; a new gather takes the
    # BlockManager rows in the int64 conversion, as an array index gathers faster than a list.
    seqs = out.seqs
    n = len(seqs)
    positions = [seq.num_computed_tokens for seq in seqs]
    input_ids = [seq.token_ids[p] for seq, p in zip(seqs, positions)]
    tables = [seq.block_table for seq in seqs]
    slots = [
        table[p // block_size] * block_size + p % block_size for table, p in zip(tables, positions)
    ]
    seq_lens = [p + 1 for p in positions]
    prompt_chunks = [int(p < seq.num_prompt_tokens) for seq, p in zip(seqs, positions)]
    mask = out.sampling_mask
    sample_rows = list(range(n)) if all(mask) else [i for i, s in enumerate(mask) if s]
    max_num_blocks = max(map(len, tables))
    num_int64s = 3 * n + len(sample_rows)
    block_tables = gathered.get(out, max_num_blocks)
    if block_tables is None and out.block_tables is not None:
        packed = np.array(
            input_ids + positions + slots + sample_rows + out.block_rows, dtype=np.int64
        )
        int64s = packed[:num_int64s]
        block_tables = out.block_tables[packed[num_int64s:], :max_num_blocks]
        gathered.keep(out, block_tables)
    else:
        int64s = np.array(input_ids + positions + slots + sample_rows, dtype=np.int64)
        if block_tables is None:
            block_tables = _block_tables_from_seqs(out, max_num_blocks)
    return HostBatch(
        int64s=int64s,
        int32s=np.array(seq_lens + list(range(n + 1)), dtype=np.int32),
        block_tables=block_tables,
        num_tokens=n,
        sample_rows=sample_rows,
        max_query_len=1,
        max_seq_len=max(seq_lens),
        prompt_chunks=np.array(prompt_chunks, dtype=np.int32) if any(prompt_chunks) else None,
    )


def _build_mixed(out: SchedulerOutput, block_size: int, outputs_by_row: bool) -> HostBatch:
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
    max_num_blocks = max(len(s.block_table) for s in seqs)
    if out.block_tables is None:
        block_tables = _block_tables_from_seqs(out, max_num_blocks)
    else:
        block_tables = out.block_tables[out.block_rows, :max_num_blocks]
    blocks = block_tables[seq_index, positions // block_size].astype(np.int64)
    slot_mapping = blocks * block_size + positions % block_size
    int32s = np.zeros(2 * num_seqs + 1, dtype=np.int32)
    int32s[:num_seqs] = seq_lens
    query_start_loc = int32s[num_seqs:]
    np.cumsum(query_lens, out=query_start_loc[1:])
    sample_rows = np.flatnonzero(out.sampling_mask)
    logits_rows = query_start_loc[1:][sample_rows].astype(np.int64) - 1
    num_prompt = np.fromiter((s.num_prompt_tokens for s in seqs), np.int64, num_seqs)
    is_prompt = starts < num_prompt
    prompt_chunks = (is_prompt if outputs_by_row else (query_lens > 1) | is_prompt).astype(np.int32)
    return HostBatch(
        int64s=np.concatenate([input_ids, positions, slot_mapping, logits_rows]),
        int32s=int32s,
        block_tables=block_tables,
        num_tokens=num_tokens,
        sample_rows=sample_rows.tolist(),
        max_query_len=max(num_new),
        max_seq_len=int(seq_lens.max()),
        prompt_chunks=prompt_chunks if outputs_by_row or prompt_chunks.any() else None,
    )


def _block_tables_from_seqs(out: SchedulerOutput, max_num_blocks: int) -> np.ndarray:
    """[num_seqs, max_num_blocks] int32, 0-padded, from the seqs' lists (a hand-built output)."""
    block_tables = np.zeros((len(out.seqs), max_num_blocks), dtype=np.int32)
    for row, seq in zip(block_tables, out.seqs):
        row[: len(seq.block_table)] = seq.block_table
    return block_tables
