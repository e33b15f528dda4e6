"""Paged attention: the batch metadata, the backend interface, and the pure-torch reference."""

from __future__ import annotations

import abc
import contextlib
import itertools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from vbatch.engine.sampling_metadata import to_device

CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class AttentionMetadata:
    """Where each token of a flat, mixed prefill/decode batch reads and writes K/V.

    Sequences appear in batch order; sequence i owns query rows
    `query_start_loc[i]:query_start_loc[i+1]`, which are its last `query_len` positions out of
    `seq_lens[i]` (its context length including this step's tokens). Block tables are padded
    with 0 past each sequence's last block. A slot is `block_id * block_size + offset`.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64, on device
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, on device
    seq_lens: torch.Tensor  # [num_seqs] int32, on device
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks_per_seq] int32, on device
    query_lens_cpu: list[int]
    seq_lens_cpu: np.ndarray  # [num_seqs] int32, seq_lens on the host
    max_query_len: int
    max_seq_len: int
    # [num_seqs] int32 on the host, 1 where a sequence's rows are a prefill chunk (prompt
    # positions or a recompute); None in a step of decode rows only. The native CPU kernel
    # attends flagged sequences by tiles and the others row by row, so a prompt position is
    # computed the same way whether its prompt was chunked or partly found in the prefix cache.
    prompt_chunks: torch.Tensor | None = None

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(abc.ABC):
    """Writes this step's K/V into the paged cache, then attends causally over each context.

    Shapes: q [num_tokens, num_heads, head_dim]; k, v [num_tokens, num_kv_heads, head_dim];
    k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]. Returns
    [num_tokens, num_heads, head_dim] in q's dtype. num_heads is a multiple of num_kv_heads
    (GQA). The caches may hold a narrower dtype than q (a 16-bit cache under a float32 model):
    K/V round to it on write and widen back to q's dtype on read.

    Per layer: `sliding_window` W limits a query at position p to keys in (p - W, p], as
    transformers' sliding_window; `softcap` c maps each scaled score s to c * tanh(s / c) before
    the softmax (Gemma 2's attention logit soft-capping). None means off.
    """

    name: str = "abstract"

    @abc.abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor: ...


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_kv_heads, head_dim = k_cache.shape[2:]
    # [num_blocks * block_size, num_kv_heads, head_dim]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


@dataclass
class BatchPlan:
    """How one step's batch splits: sequences within a backend's limits are batched together
    (`short_*`, in batch order; built only when some chunk is long); longer prefill chunks run
    one by one."""

    meta: AttentionMetadata
    seq_lens_cpu: np.ndarray  # a copy of meta's when planned
    long_chunks: list[tuple[int, int, int, int]]  # (seq index, first row, query_len, seq_len)
    short_rows: torch.Tensor | None = None  # [num_short_tokens] int64 query rows
    short_query_start_loc: torch.Tensor | None = None  # [num_short + 1] int32
    short_seq_lens: torch.Tensor | None = None  # [num_short] int32
    short_block_tables: torch.Tensor | None = None  # [num_short, max_num_blocks_per_seq]
    max_short_seq_len: int = 0


class BatchPlanner:
    """Splits a batch for a backend, once per step: every layer sees the same metadata. A
    sequence is short when its query_len is at most `max_short_query_len`, or query_len *
    seq_len (the query-key pairs it attends over) at most `max_short_work`."""

    def __init__(self, max_short_query_len: int, max_short_work: int = 0) -> None:
        self.max_short_query_len = max_short_query_len
        self.max_short_work = max_short_work
        self._plan: BatchPlan | None = None

    def plan(self, meta: AttentionMetadata) -> BatchPlan:
        plan = self._plan
        if (
            plan is not None
            and plan.meta is meta
            and np.array_equal(plan.seq_lens_cpu, meta.seq_lens_cpu)
        ):
            return plan
        shorts: list[tuple[int, int, int, int]] = []
        longs: list[tuple[int, int, int, int]] = []
        start = 0
        lens = zip(meta.query_lens_cpu, meta.seq_lens_cpu.tolist(), strict=True)
        for seq_index, (query_len, seq_len) in enumerate(lens):
            is_short = (
                query_len <= self.max_short_query_len or query_len * seq_len <= self.max_short_work
            )
            (shorts if is_short else longs).append((seq_index, start, query_len, seq_len))
            start += query_len
        plan = BatchPlan(meta, meta.seq_lens_cpu.copy(), longs)
        if shorts and longs:
            device = meta.block_tables.device
            rows = [row for _, first, n, _ in shorts for row in range(first, first + n)]
            seq_indices = to_device(torch.tensor([short[0] for short in shorts]), device)
            plan.short_rows = to_device(torch.tensor(rows), device)
            plan.short_query_start_loc = to_device(
                torch.tensor(
                    [0, *itertools.accumulate(short[2] for short in shorts)], dtype=torch.int32
                ),
                device,
            )
            plan.short_block_tables = meta.block_tables.index_select(0, seq_indices)
            plan.short_seq_lens = meta.seq_lens.index_select(0, seq_indices)
            plan.max_short_seq_len = max(short[3] for short in shorts)
        self._plan = plan
        return plan


def attend_long_chunks(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: BatchPlan,
    out: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> None:
    """SDPA over each long prefill chunk's gathered context, causal from its cached prefix;
    with a sliding window, only from the block holding the chunk's first query's first key."""
    block_size = k_cache.shape[1]
    for seq_index, start, query_len, seq_len in plan.long_chunks:
        first_key = 0
        if sliding_window is not None:
            first_key = max(0, seq_len - query_len - sliding_window + 1)
        first_block = first_key // block_size
        offset = first_block * block_size  # the position of the first gathered key
        num_blocks = -(-seq_len // block_size)
        block_table = plan.meta.block_tables[seq_index, first_block:num_blocks].long()
        # [1, num_kv_heads, seq_len - offset, head_dim]
        seq_k = k_cache.index_select(0, block_table).flatten(0, 1)[: seq_len - offset]
        seq_v = v_cache.index_select(0, block_table).flatten(0, 1)[: seq_len - offset]
        seq_k = seq_k.to(q.dtype).transpose(0, 1)[None]
        seq_v = seq_v.to(q.dtype).transpose(0, 1)[None]
        seq_q = q[start : start + query_len].transpose(0, 1)[None]
        mask = None
        if query_len != seq_len or sliding_window is not None or softcap is not None:
            key_pos = torch.arange(offset, seq_len, device=q.device)
            query_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)
            mask = _causal_mask(query_pos, key_pos, sliding_window)
        seq_out = _attend(seq_q, seq_k, seq_v, mask, scale, softcap)
        out[start : start + query_len] = seq_out[0].transpose(0, 1)


def _causal_mask(
    query_pos: torch.Tensor, key_pos: torch.Tensor, sliding_window: int | None
) -> torch.Tensor:
    """[num_queries, num_keys] bool: which keys each query sees."""
    mask = key_pos[None, :] <= query_pos[:, None]
    if sliding_window is not None:
        mask &= key_pos[None, :] > query_pos[:, None] - sliding_window
    return mask


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """Attention over [batch, heads, len, head_dim] inputs (GQA: k and v may have fewer heads);
    `mask` None means causal. A soft cap needs the scores, so it runs the eager math, which
    rounds like transformers' eager attention."""
    if softcap is None:
        # NOTE: on CUDA not cuDNN's SDPA, which builds a plan per new shape: with prompt lengths
        # varying, it took 2-5 s of an 8192-token prefill step on an H200. On CPU 4-D inputs
        # reach the fused kernel; 3-D ones fall back to the math path.
        with sdpa_kernel(CUDA_SDPA_BACKENDS) if q.is_cuda else contextlib.nullcontext():
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
            )
    assert mask is not None, "the soft-capped path takes an explicit mask"
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


class TorchAttentionBackend(AttentionBackend):
    """Pure-torch reference: gathers each context from the paged cache and runs SDPA.

    Decode rows (query_len 1) are gathered as one padded [num_decodes, max_seq_len] batch with
    a length mask; prefill chunks run one sequence at a time with a causal mask offset by the
    cached prefix. Cache slots past a sequence's length must hold finite values (zero-init).
    """

    name = "torch"

    def __init__(self) -> None:
        self._planner = BatchPlanner(max_short_query_len=1)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_decode_only:
            return _paged_decode(
                q,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.seq_lens,
                meta.max_seq_len,
                scale,
                sliding_window,
                softcap,
            )
        plan = self._planner.plan(meta)
        out = torch.empty_like(q)
        if plan.short_rows is not None:
            assert plan.short_block_tables is not None and plan.short_seq_lens is not None
            out[plan.short_rows] = _paged_decode(
                q.index_select(0, plan.short_rows),
                k_cache,
                v_cache,
                plan.short_block_tables,
                plan.short_seq_lens,
                plan.max_short_seq_len,
                scale,
                sliding_window,
                softcap,
            )
        attend_long_chunks(q, k_cache, v_cache, plan, out, scale, sliding_window, softcap)
        return out


def _paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One query row per sequence: q [num_seqs, num_heads, head_dim] → same shape."""
    num_seqs = q.shape[0]
    block_size = k_cache.shape[1]
    num_blocks = -(-max_seq_len // block_size)
    block_ids = block_tables[:, :num_blocks].flatten().long()
    max_len = num_blocks * block_size
    # [num_seqs, num_kv_heads, max_len, head_dim]
    keys = k_cache.index_select(0, block_ids).view(num_seqs, max_len, *k_cache.shape[2:])
    values = v_cache.index_select(0, block_ids).view(num_seqs, max_len, *v_cache.shape[2:])
    keys, values = keys.to(q.dtype), values.to(q.dtype)
    key_pos = torch.arange(max_len, device=q.device)
    # [num_seqs, 1, 1, max_len]
    mask = _causal_mask(seq_lens - 1, key_pos, sliding_window).view(num_seqs, 1, 1, max_len)
    keys, values = keys.transpose(1, 2), values.transpose(1, 2)
    out = _attend(q.unsqueeze(2), keys, values, mask, scale, softcap)
    return out.squeeze(2)
