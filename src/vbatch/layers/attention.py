"""Paged attention: the batch metadata, the backend interface, and the pure-torch reference."""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch


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
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(abc.ABC):
    """Writes this step's K/V into the paged cache, then attends causally over each context.

    Shapes: q [num_tokens, num_heads, head_dim]; k, v [num_tokens, num_kv_heads, head_dim];
    k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]. Returns
    [num_tokens, num_heads, head_dim]. num_heads is a multiple of num_kv_heads (GQA).
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
    ) -> torch.Tensor: ...


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    # [num_blocks * block_size, num_kv_heads, head_dim]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)
