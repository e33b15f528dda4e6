"""DecodeGraphRunner: decode-only steps on fixed buffers, replayed from CUDA graphs per bucket."""

from __future__ import annotations

import gc

import numpy as np
import torch
from torch import nn

from vbatch.layers.attention import AttentionMetadata

KVCache = tuple[torch.Tensor, torch.Tensor]
SMALL_BATCH_SIZES = (1, 2, 4)
BATCH_SIZE_STEP = 8


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    """The buckets: 1, 2, 4, then every multiple of 8, and `max_batch_size` itself last."""
    sizes = [size for size in SMALL_BATCH_SIZES if size < max_batch_size]
    sizes += range(BATCH_SIZE_STEP, max_batch_size, BATCH_SIZE_STEP)
    return [*sizes, max_batch_size]


class DecodeGraphRunner:
    """Runs a decode-only step of n <= max_batch_size seqs as the smallest bucket >= n.

    Invariants: the step reads only the static buffers and writes only `logits` and the KV
    cache. Rows from n up to the bucket are padding: token 0 at position 0 with seq_len 1 and
    block table row [pad_block, ...], so they write and read only the first slot of `pad_block`,
    a KV block no sequence owns. On CUDA each bucket's step is a captured graph, replayed; with
    `use_graphs` False (every other device) the same step runs eagerly, so CPU tests cover it.
    """

    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[KVCache],
        vocab_size: int,
        max_batch_size: int,
        max_num_blocks_per_seq: int,
        pad_block: int,
        use_graphs: bool,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.batch_sizes = graph_batch_sizes(max_batch_size)
        self.max_batch_size = max_batch_size
        self.max_num_blocks_per_seq = max_num_blocks_per_seq
        self.use_graphs = use_graphs
        device = kv_caches[0][0].device
        block_size = kv_caches[0][0].shape[1]
        self.pad_block = pad_block
        self.pad_slot = pad_block * block_size
        # NOTE: a static upper bound; the native op never reads it, the torch backend gathers
        # this many positions per row and masks them by seq_lens.
        self.max_seq_len = max_num_blocks_per_seq * block_size
        with torch.device(device):
            self.input_ids = torch.zeros(max_batch_size, dtype=torch.int64)
            self.positions = torch.zeros(max_batch_size, dtype=torch.int64)
            self.slot_mapping = torch.full((max_batch_size,), self.pad_slot, dtype=torch.int64)
            self.query_start_loc = torch.arange(max_batch_size + 1, dtype=torch.int32)
            self.seq_lens = torch.ones(max_batch_size, dtype=torch.int32)
            # NOTE: past a real row's last block its columns may hold stale block ids, which
            # nothing reads unmasked.
            self.block_tables = torch.full(
                (max_batch_size, max_num_blocks_per_seq), pad_block, dtype=torch.int32
            )
            self.logits_rows = torch.zeros(max_batch_size, dtype=torch.int64)
            self.logits = torch.empty(max_batch_size, vocab_size, dtype=torch.float32)
        self._metas = {size: self._static_meta(size) for size in self.batch_sizes}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._num_real_rows = 0  # rows [0, this) of the buffers hold the last step's seqs
        self._num_real_logits_rows = 0

    def _static_meta(self, batch_size: int) -> AttentionMetadata:
        # NOTE: the host fields are bounds, fixed per bucket; a decode-only step's attention
        # reads only the device tensors and max_seq_len.
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch_size],
            query_start_loc=self.query_start_loc[: batch_size + 1],
            seq_lens=self.seq_lens[:batch_size],
            block_tables=self.block_tables[:batch_size],
            query_lens_cpu=[1] * batch_size,
            seq_lens_cpu=np.full(batch_size, self.max_seq_len, dtype=np.int32),
            max_query_len=1,
            max_seq_len=self.max_seq_len,
        )

    def bucket(self, num_seqs: int) -> int:
        return next(size for size in self.batch_sizes if size >= num_seqs)

    def can_run(self, meta: AttentionMetadata) -> bool:
        """Whether a step is decode-only and fits the buffers."""
        num_seqs, num_blocks = meta.block_tables.shape
        return (
            meta.is_decode_only
            and num_seqs <= self.max_batch_size
            and num_blocks <= self.max_num_blocks_per_seq
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every bucket's step, largest first, sharing one memory pool (CUDA only)."""
        assert self.use_graphs and not self._graphs
        pool = torch.cuda.graph_pool_handle()
        # NOTE: a collection during capture may free CUDA objects of earlier runners (pinned
        # buffers, graphs), and such a call invalidates the capture. A second runner built in
        # one process failed its capture so on an H200; the collection is the likely cause.
        gc.collect()
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            for size in reversed(self.batch_sizes):
                # NOTE: the eager warm-up builds lazy tables and library handles outside
                # capture; every row is padding, so it writes only the pad slot.
                self._forward(size)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._forward(size)
                self._graphs[size] = graph
        finally:
            if was_enabled:
                gc.enable()

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        logits_rows: torch.Tensor,
    ) -> torch.Tensor:
        """[len(logits_rows), vocab_size] float32 logits of a step that can_run; a view of
        `logits`, valid until the next run."""
        assert self.can_run(meta)
        num_seqs, num_blocks = meta.block_tables.shape
        num_logits_rows = logits_rows.shape[0]
        size = self.bucket(num_seqs)
        self.input_ids[:num_seqs].copy_(input_ids)
        self.positions[:num_seqs].copy_(positions)
        self.slot_mapping[:num_seqs].copy_(meta.slot_mapping)
        self.seq_lens[:num_seqs].copy_(meta.seq_lens)
        self.block_tables[:num_seqs, :num_blocks].copy_(meta.block_tables)
        self.logits_rows[:num_logits_rows].copy_(logits_rows)
        self._reset_padding(num_seqs, num_logits_rows)
        if self.use_graphs:
            self._graphs[size].replay()
        else:
            self._forward(size)
        return self.logits[:num_logits_rows]

    def _reset_padding(self, num_seqs: int, num_logits_rows: int) -> None:
        """Turns rows the previous step filled past this step's into padding again."""
        if self._num_real_rows > num_seqs:
            stale = slice(num_seqs, self._num_real_rows)
            self.input_ids[stale] = 0
            self.positions[stale] = 0
            self.slot_mapping[stale] = self.pad_slot
            self.seq_lens[stale] = 1
            self.block_tables[stale, 0] = self.pad_block
        if self._num_real_logits_rows > num_logits_rows:
            # NOTE: a stale row index may point past a smaller bucket's hidden states.
            self.logits_rows[num_logits_rows : self._num_real_logits_rows] = 0
        self._num_real_rows = num_seqs
        self._num_real_logits_rows = num_logits_rows

    def _forward(self, size: int) -> None:
        hidden = self.model(
            self.input_ids[:size], self.positions[:size], self.kv_caches, self._metas[size]
        )
        logits = self.model.compute_logits(hidden.index_select(0, self.logits_rows[:size]))
        self.logits[:size].copy_(logits)
