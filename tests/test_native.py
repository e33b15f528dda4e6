"""Tests for the native vbatch:: ops (paged attention, fused RMSNorm and rotary) and their build."""

from __future__ import annotations

import logging
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from vbatch.layers import native
from vbatch.layers.attention import AttentionMetadata, TorchAttentionBackend, write_kv_cache
from vbatch.layers.norm import RMSNorm
from vbatch.layers.quantization import NATIVE, Int8DynamicLinear
from vbatch.layers.rotary import RotaryEmbedding

SMOLLM2_HEADS = (9, 3, 64)  # num_heads, num_kv_heads, head_dim
MHA_HEADS = (4, 4, 32)
MIXED = [(33, 33), (17, 1), (16, 1), (40, 7), (1, 1), (15, 15), (50, 20)]


@pytest.fixture(scope="module")
def ops() -> None:
    if not native.is_available():
        pytest.skip("native kernels could not be built here (see the logged notice)")


def make_batch(
    specs: list[tuple[int, int]],
    heads: tuple[int, int, int],
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """q, k, v, k_cache, v_cache, meta for sequences given as (seq_len, query_len).

    Blocks are handed out in a shuffled order so block tables are non-contiguous; the cache
    starts full of random values that stand for earlier context (and garbage in unused blocks).
    """
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(seed)
    num_blocks_per_seq = [math.ceil(seq_len / block_size) for seq_len, _ in specs]
    num_blocks = sum(num_blocks_per_seq) + 3
    free_blocks = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.zeros(len(specs), max(num_blocks_per_seq) + 1, dtype=torch.int32)
    slots: list[int] = []
    for i, ((seq_len, query_len), num_seq_blocks) in enumerate(
        zip(specs, num_blocks_per_seq, strict=True)
    ):
        table = [free_blocks.pop() for _ in range(num_seq_blocks)]
        block_tables[i, :num_seq_blocks] = torch.tensor(table, dtype=torch.int32)
        for pos in range(seq_len - query_len, seq_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    num_tokens = len(slots)
    query_lens = [query_len for _, query_len in specs]
    seq_lens = [seq_len for seq_len, _ in specs]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()]).to(
            dtype=torch.int32, device=device
        ),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        query_lens_cpu=query_lens,
        seq_lens_cpu=np.array(seq_lens, dtype=np.int32),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    q = randn(num_tokens, num_heads, head_dim)
    k, v = randn(num_tokens, num_kv_heads, head_dim), randn(num_tokens, num_kv_heads, head_dim)
    return q, k, v, randn(*cache_shape), randn(*cache_shape), meta


def reference_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Dense causal attention in float64, one sequence at a time, through the block tables;
    a query at position p sees keys in (p - sliding_window, p]; scores soft-capped if asked."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = q.shape[1] // num_kv_heads
    # NOTE: NaN marks slots no query may read; masked out here, they must not poison the sums.
    flat_k = k_cache.reshape(-1, num_kv_heads, head_dim).double().cpu().nan_to_num()
    flat_v = v_cache.reshape(-1, num_kv_heads, head_dim).double().cpu().nan_to_num()
    block_tables = meta.block_tables.cpu().long()
    out = torch.empty(q.shape, dtype=torch.float64)
    start = 0
    for i, (seq_len, query_len) in enumerate(
        zip(meta.seq_lens_cpu.tolist(), meta.query_lens_cpu, strict=True)
    ):
        pos = torch.arange(seq_len)
        slots = block_tables[i, pos // block_size] * block_size + pos % block_size
        keys = flat_k[slots].repeat_interleave(group, dim=1)  # [seq_len, num_heads, head_dim]
        values = flat_v[slots].repeat_interleave(group, dim=1)
        queries = q[start : start + query_len].double().cpu()
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        query_pos = torch.arange(seq_len - query_len, seq_len)
        is_masked = pos[None, None, :] > query_pos[None, :, None]
        if sliding_window is not None:
            is_masked |= pos[None, None, :] <= query_pos[None, :, None] - sliding_window
        scores.masked_fill_(is_masked, float("-inf"))
        out[start : start + query_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
        start += query_len
    return out


def run_native_and_reference(
    batch: tuple,
    scale: float = 0.125,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v, k_cache, v_cache, meta = batch
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    write_kv_cache(k, v, ref_k_cache, ref_v_cache, meta.slot_mapping)
    out = native.NativeAttentionBackend().forward(
        q, k, v, k_cache, v_cache, meta, scale, sliding_window, softcap
    )
    for cache, ref_cache in ((k_cache, ref_k_cache), (v_cache, ref_v_cache)):
        torch.testing.assert_close(cache, ref_cache, rtol=0, atol=0, equal_nan=True)
    ref = reference_attention(q, ref_k_cache, ref_v_cache, meta, scale, sliding_window, softcap)
    return out, ref


@pytest.mark.parametrize("heads", [SMOLLM2_HEADS, MHA_HEADS])
@pytest.mark.parametrize(
    "specs",
    [
        [(n, 1) for n in (1, 15, 16, 17, 33)],
        [(n, n) for n in (1, 15, 16, 17, 33)],
        MIXED,
    ],
    ids=["decode", "prefill", "mixed"],
)
def test_matches_reference(ops: None, heads: tuple[int, int, int], specs: list) -> None:
    out, ref = run_native_and_reference(make_batch(specs, heads))
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert (out.double() - ref).abs().max().item() < 1e-5


def test_op_alone_handles_long_prefill_chunks(ops: None) -> None:
    """Chunks over MAX_NATIVE_QUERY_LEN take the op's tiled kernel, the rest go token by token."""
    q, k, v, k_cache, v_cache, meta = make_batch(MIXED, SMOLLM2_HEADS)
    assert max(meta.query_lens_cpu) > native.MAX_NATIVE_QUERY_LEN
    write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.ops.vbatch.paged_attention(
        q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.125
    )
    ref = reference_attention(q, k_cache, v_cache, meta, 0.125)
    assert (out.double() - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("tail", [1, 5, 8, 19])
def test_a_prompt_row_is_attended_alike_whatever_its_chunk(
    ops: None, tail: int, window: int | None
) -> None:
    """Flagged as prompt chunks, the last `tail` rows of a 70-row prefill, sent alone behind
    their cached prefix (a prefix-cache hit), give the bits the full chunk gave them."""
    q, k, v, k_cache, v_cache, meta = make_batch([(70, 70)], SMOLLM2_HEADS)
    write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    args = (k_cache, v_cache)
    flag = torch.ones(1, dtype=torch.int32)
    full = torch.ops.vbatch.paged_attention(
        q, *args, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.125, window or 0
    )
    tail_starts = torch.tensor([0, tail], dtype=torch.int32)
    alone = torch.ops.vbatch.paged_attention(
        q[-tail:],
        *args,
        tail_starts,
        meta.seq_lens,
        meta.block_tables,
        0.125,
        window or 0,
        0.0,
        flag,
    )
    assert torch.equal(alone, full[-tail:])
    with pytest.raises(RuntimeError, match="one entry per sequence"):
        torch.ops.vbatch.paged_attention(
            q,
            *args,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            0.125,
            0,
            0.0,
            torch.ones(2, dtype=torch.int32),
        )


# (seq_len, query_len): chunks from position 0 and behind cached prefixes shorter and longer
# than the chunk, lengths on and off multiples of 16, both sides of the per-token limit (8).
TILED_SPECS = [
    (300, 300),
    (316, 300),
    (57, 9),
    (8, 8),
    (200, 37),
    (16, 16),
    (48, 32),
    (1, 1),
    (140, 129),
    (33, 17),
    (90, 1),
]


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("heads", "block_size"),
    [(SMOLLM2_HEADS, 16), ((4, 4, 16), 32), ((8, 2, 128), 5), ((6, 3, 40), 8), ((2, 1, 64), 1)],
    ids=["gqa-d64-bs16", "mha-d16-bs32", "gqa-d128-bs5", "gqa-d40-bs8", "gqa-d64-bs1"],
)
def test_tiled_prefill_matches_reference(
    ops: None, cache_dtype: torch.dtype, heads: tuple[int, int, int], block_size: int
) -> None:
    batch = narrow_caches(make_batch(TILED_SPECS, heads, block_size, seed=7), cache_dtype)
    out, ref = run_native_and_reference(batch, scale=heads[2] ** -0.5)
    assert out.dtype == torch.float32
    assert (out.double() - ref).abs().max().item() < 1e-5


def test_tiled_prefill_reads_no_slot_past_the_context(ops: None) -> None:
    """NaN in every cache slot outside the contexts (block padding, spare blocks) stays unread."""
    specs = [(37, 37), (61, 45), (130, 98)]
    batch = make_batch(specs, SMOLLM2_HEADS)
    fill_unused_slots_with_nan(batch)
    q, k, v, k_cache, v_cache, meta = batch
    out = native.NativeAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, 0.125)
    assert (out.double() - reference_attention(q, k_cache, v_cache, meta, 0.125)).abs().max() < 1e-5


def fill_unused_slots_with_nan(batch: tuple, sliding_window: int | None = None) -> None:
    """Writes NaN to every cache slot outside the contexts (block padding, spare blocks), and
    with a window, before every query's window (blocks that could be freed)."""
    _, _, _, k_cache, v_cache, meta = batch
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    is_used = torch.zeros(k_cache.shape[0] * block_size, dtype=torch.bool)
    for i, (seq_len, query_len) in enumerate(
        zip(meta.seq_lens_cpu.tolist(), meta.query_lens_cpu, strict=True)
    ):
        first = 0 if sliding_window is None else max(0, seq_len - query_len - sliding_window + 1)
        pos = torch.arange(first, seq_len)
        slots = meta.block_tables[i, pos // block_size].long() * block_size + pos % block_size
        is_used[slots] = True
    k_cache.view(-1, num_kv_heads, head_dim)[~is_used] = float("nan")
    v_cache.view(-1, num_kv_heads, head_dim)[~is_used] = float("nan")


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "block_size"),
    [
        (SMOLLM2_HEADS, 16),
        ((8, 2, 128), 5),
        ((6, 3, 40), 1),
        ((6, 2, 36), 3),
        ((4, 1, 192), 16),
    ],
    ids=["gqa-d64-bs16", "gqa-d128-bs5", "gqa-d40-bs1", "gqa-d36-bs3", "d192-per-token-bs16"],
)
def test_long_decode_contexts_match_reference(
    ops: None, cache_dtype: torch.dtype, heads: tuple[int, int, int], block_size: int
) -> None:
    """Decode contexts across several of the two-phase kernel's chunks (1024 rows), reading no
    slot past the context: head dims that fill whole vectors or end in a partial one (40 under
    AVX-512, 36 under both), group sizes 3 and 4; head_dim 192 takes the per-token path."""
    specs = [(1024, 1), (1025, 1), (2100, 1), (1100, 3), (65, 1), (64, 1), (200, 2), (7, 1)]
    batch = narrow_caches(make_batch(specs, heads, block_size, seed=11), cache_dtype)
    fill_unused_slots_with_nan(batch)
    q, k, v, k_cache, v_cache, meta = batch
    scale = heads[2] ** -0.5
    out = native.NativeAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, scale)
    ref = reference_attention(q, k_cache, v_cache, meta, scale)
    assert (out.double() - ref).abs().max().item() < 1e-5


# Decodes, short chunks (per-token path) and long chunks (tiled) whose contexts outrun the window.
WINDOW_SPECS = [(1, 1), (5, 1), (40, 1), (300, 1), (9, 4), (77, 8), (16, 16), (70, 33), (200, 150)]


@pytest.mark.parametrize(
    ("heads", "block_size", "cache_dtype"),
    [
        (SMOLLM2_HEADS, 16, torch.float32),
        ((8, 2, 128), 5, torch.bfloat16),
        ((6, 3, 40), 1, torch.float32),
        ((4, 1, 192), 16, torch.bfloat16),
    ],
    ids=["gqa-d64-bs16", "gqa-d128-bs5-bf16", "gqa-d40-bs1", "d192-per-token-bs16-bf16"],
)
@pytest.mark.parametrize(
    ("sliding_window", "softcap"), [(1, None), (7, None), (50, 2.0), (None, 0.7), (1000, None)]
)
def test_sliding_window_and_softcap_match_reference(
    ops: None,
    cache_dtype: torch.dtype,
    heads: tuple[int, int, int],
    block_size: int,
    sliding_window: int | None,
    softcap: float | None,
) -> None:
    """Every kernel path keeps each query to its window and soft-caps its scores, reading no
    slot before the window (NaN there); windows from 1 to wider than any context."""
    batch = narrow_caches(make_batch(WINDOW_SPECS, heads, block_size, seed=13), cache_dtype)
    fill_unused_slots_with_nan(batch, sliding_window)
    out, ref = run_native_and_reference(batch, heads[2] ** -0.5, sliding_window, softcap)
    assert (out.double() - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize(("sliding_window", "softcap"), [(6, None), (20, 1.5), (None, 3.0)])
def test_sliding_window_and_softcap_agree_with_torch_backend(
    ops: None, sliding_window: int | None, softcap: float | None
) -> None:
    q, k, v, k_cache, v_cache, meta = make_batch(WINDOW_SPECS, SMOLLM2_HEADS, seed=17)
    torch_k_cache, torch_v_cache = k_cache.clone(), v_cache.clone()
    args = (meta, 0.125, sliding_window, softcap)
    out = native.NativeAttentionBackend().forward(q, k, v, k_cache, v_cache, *args)
    expected = TorchAttentionBackend().forward(q, k, v, torch_k_cache, torch_v_cache, *args)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    ref = reference_attention(q, k_cache, v_cache, *args)
    assert (expected.double() - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("seed", range(3))
def test_mixed_step_with_long_chunks_agrees_with_torch_backend(ops: None, seed: int) -> None:
    """Decodes, short chunks and long chunks in one step, as the scheduler builds them."""
    rng = torch.Generator().manual_seed(300 + seed)
    specs = []
    for _ in range(10):
        query_len = int(torch.randint(1, 5, (1,), generator=rng))  # decode or short chunk
        specs.append((query_len + int(torch.randint(0, 300, (1,), generator=rng)), query_len))
    for _ in range(4):
        query_len = int(torch.randint(9, 400, (1,), generator=rng))
        specs.append((query_len + [0, 16, 48, 500][len(specs) % 4], query_len))
    order = torch.randperm(len(specs), generator=rng).tolist()
    q, k, v, k_cache, v_cache, meta = make_batch([specs[i] for i in order], SMOLLM2_HEADS)
    torch_k_cache, torch_v_cache = k_cache.clone(), v_cache.clone()
    out = native.NativeAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, 0.125)
    expected = TorchAttentionBackend().forward(q, k, v, torch_k_cache, torch_v_cache, meta, 0.125)
    assert torch.equal(k_cache, torch_k_cache) and torch.equal(v_cache, torch_v_cache)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(6))
def test_random_batches_match_reference(ops: None, seed: int) -> None:
    rng = torch.Generator().manual_seed(100 + seed)
    num_seqs = int(torch.randint(1, 12, (1,), generator=rng))
    seq_lens = torch.randint(1, 90, (num_seqs,), generator=rng).tolist()
    specs = [(n, int(torch.randint(1, n + 1, (1,), generator=rng))) for n in seq_lens]
    block_size = [16, 8, 1, 32, 16, 5][seed]
    out, ref = run_native_and_reference(make_batch(specs, SMOLLM2_HEADS, block_size, seed=seed))
    assert (out.double() - ref).abs().max().item() < 1e-5


def test_agrees_with_torch_backend(ops: None) -> None:
    q, k, v, k_cache, v_cache, meta = make_batch(MIXED, SMOLLM2_HEADS)
    torch_k_cache, torch_v_cache = k_cache.clone(), v_cache.clone()
    out = native.NativeAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, 0.125)
    expected = TorchAttentionBackend().forward(q, k, v, torch_k_cache, torch_v_cache, meta, 0.125)
    assert torch.equal(k_cache, torch_k_cache)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_strided_q_from_fused_projection(ops: None) -> None:
    q, k, v, k_cache, v_cache, meta = make_batch(MIXED, SMOLLM2_HEADS)
    num_tokens = q.shape[0]
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    q_view, k_view, v_view = (
        t.view(num_tokens, -1, 64) for t in qkv.split([9 * 64, 3 * 64, 3 * 64], dim=1)
    )
    assert not q_view.is_contiguous()
    out, ref = run_native_and_reference((q_view, k_view, v_view, k_cache, v_cache, meta))
    assert (out.double() - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_caches(ops: None, dtype: torch.dtype) -> None:
    out, ref = run_native_and_reference(make_batch(MIXED, SMOLLM2_HEADS, dtype=dtype))
    assert out.dtype == dtype
    assert (out.double() - ref).abs().max().item() < 2e-2


def narrow_caches(batch: tuple, cache_dtype: torch.dtype) -> tuple:
    """`batch` (float32) with its caches stored in `cache_dtype`."""
    q, k, v, k_cache, v_cache, meta = batch
    return q, k, v, k_cache.to(cache_dtype), v_cache.to(cache_dtype), meta


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [SMOLLM2_HEADS, MHA_HEADS])
@pytest.mark.parametrize("seed", range(3))
def test_16bit_cache_under_float32_q(
    ops: None, cache_dtype: torch.dtype, heads: tuple[int, int, int], seed: int
) -> None:
    """float32 math over the rounded cache values, close to an all-float32 cache."""
    rng = torch.Generator().manual_seed(200 + seed)
    num_seqs = int(torch.randint(1, 10, (1,), generator=rng))
    seq_lens = torch.randint(1, 70, (num_seqs,), generator=rng).tolist()
    specs = [*MIXED, *((n, int(torch.randint(1, n + 1, (1,), generator=rng))) for n in seq_lens)]
    block_size = [16, 5, 32][seed]
    batch = make_batch(specs, heads, block_size, seed=seed)
    out, ref = run_native_and_reference(narrow_caches(batch, cache_dtype))
    assert out.dtype == torch.float32
    assert (out.double() - ref).abs().max().item() < 1e-5
    _, exact = run_native_and_reference(batch)
    tolerance = 3e-2 if cache_dtype == torch.bfloat16 else 4e-3
    assert (out.double() - exact.double()).abs().max().item() < tolerance


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_16bit_cache_agrees_with_torch_backend(ops: None, cache_dtype: torch.dtype) -> None:
    q, k, v, k_cache, v_cache, meta = narrow_caches(make_batch(MIXED, SMOLLM2_HEADS), cache_dtype)
    torch_k_cache, torch_v_cache = k_cache.clone(), v_cache.clone()
    out = native.NativeAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, 0.125)
    expected = TorchAttentionBackend().forward(q, k, v, torch_k_cache, torch_v_cache, meta, 0.125)
    assert torch.equal(k_cache, torch_k_cache) and torch.equal(v_cache, torch_v_cache)
    assert out.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_reshape_and_cache_rounds_into_16bit_cache(ops: None, cache_dtype: torch.dtype) -> None:
    _, k, v, k_cache, v_cache, meta = narrow_caches(
        make_batch([(20, 4), (9, 9)], SMOLLM2_HEADS), cache_dtype
    )
    # NOTE: values halfway between two bfloat16s check round-to-nearest-even against torch.
    k[0, 0, :4] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3.0e-3])
    slot_mapping = meta.slot_mapping.clone()
    slot_mapping[1] = -1
    before = k_cache.clone()
    torch.ops.vbatch.reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)
    flat_k, flat_v = k_cache.view(-1, 3, 64), v_cache.view(-1, 3, 64)
    written = slot_mapping[slot_mapping >= 0]
    assert torch.equal(flat_k[written], k[slot_mapping >= 0].to(cache_dtype))
    assert torch.equal(flat_v[written], v[slot_mapping >= 0].to(cache_dtype))
    assert torch.equal(flat_k[meta.slot_mapping[1]], before.view(-1, 3, 64)[meta.slot_mapping[1]])
    round_trip = flat_k[written].float()
    tolerance = 2**-8 if cache_dtype == torch.bfloat16 else 2**-11
    assert torch.allclose(round_trip, k[slot_mapping >= 0], rtol=tolerance, atol=1e-4)


def test_same_result_for_any_thread_count(ops: None) -> None:
    q, _, _, k_cache, v_cache, meta = make_batch([*MIXED, *TILED_SPECS], SMOLLM2_HEADS)
    args = (q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.125)
    num_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = torch.ops.vbatch.paged_attention(*args)
        torch.set_num_threads(2)
        parallel = torch.ops.vbatch.paged_attention(*args)
    finally:
        torch.set_num_threads(num_threads)
    assert torch.equal(serial, parallel)


def test_reshape_and_cache_skips_negative_slots(ops: None) -> None:
    _, k, v, k_cache, v_cache, meta = make_batch([(20, 4)], SMOLLM2_HEADS)
    slot_mapping = meta.slot_mapping.clone()
    slot_mapping[1] = -1
    before = k_cache.clone()
    torch.ops.vbatch.reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)
    flat_k, flat_before = k_cache.view(-1, 3, 64), before.view(-1, 3, 64)
    assert torch.equal(flat_k[meta.slot_mapping[1]], flat_before[meta.slot_mapping[1]])
    assert torch.equal(flat_k[meta.slot_mapping[0]], k[0])


def test_rejects_bad_inputs(ops: None) -> None:
    q, _, _, k_cache, v_cache, meta = make_batch(MIXED, SMOLLM2_HEADS)
    lens = (meta.query_start_loc, meta.seq_lens)
    with pytest.raises(RuntimeError, match="share a dtype"):
        torch.ops.vbatch.paged_attention(
            q.double(), k_cache, v_cache, *lens, meta.block_tables, 1.0
        )
    # NOTE: only float32 activations may go with a narrower cache, and K and V share one dtype.
    with pytest.raises(RuntimeError, match="share a dtype"):
        torch.ops.vbatch.paged_attention(
            q.half(), k_cache.bfloat16(), v_cache.bfloat16(), *lens, meta.block_tables, 1.0
        )
    with pytest.raises(RuntimeError, match="share a dtype"):
        torch.ops.vbatch.paged_attention(
            q, k_cache.bfloat16(), v_cache.half(), *lens, meta.block_tables, 1.0
        )
    k = q[:, :3].half()
    with pytest.raises(RuntimeError, match="share a dtype"):
        torch.ops.vbatch.reshape_and_cache(
            k, k, k_cache.bfloat16(), v_cache.bfloat16(), meta.slot_mapping
        )
    bad_tables = meta.block_tables.clone()
    bad_tables[0, 0] = k_cache.shape[0]
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.vbatch.paged_attention(q, k_cache, v_cache, *lens, bad_tables, 1.0)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_opcheck(ops: None, cache_dtype: torch.dtype) -> None:
    specs = [*MIXED, (150, 100)]  # one chunk takes the tiled kernel over several tiles
    q, k, v, k_cache, v_cache, meta = narrow_caches(make_batch(specs, SMOLLM2_HEADS), cache_dtype)
    torch.library.opcheck(
        torch.ops.vbatch.reshape_and_cache.default, (k, v, k_cache, v_cache, meta.slot_mapping)
    )
    torch.library.opcheck(
        torch.ops.vbatch.paged_attention.default,
        (q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.125),
    )


def fused_inputs(
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, RotaryEmbedding]:
    """(x [7, 96], residual, weight, positions [7], RotaryEmbedding for head_dim 16)."""
    gen = torch.Generator().manual_seed(3)
    x = (3 * torch.randn(7, 96, generator=gen)).to(dtype)
    residual = torch.randn(7, 96, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(96, generator=gen)).to(dtype)
    positions = torch.tensor([0, 1, 5, 63, 2, 17, 40])
    return x, residual, weight, positions, RotaryEmbedding(16, 64, 10000.0, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_norm_ops_match_torch(ops: None, dtype: torch.dtype) -> None:
    x, residual, weight, _, _ = fused_inputs(dtype)
    reference = RMSNorm(96, 1e-6).to(dtype)
    reference.weight.data.copy_(weight)
    fused = RMSNorm(96, 1e-6, use_native_ops=True).to(dtype)
    fused.weight.data.copy_(weight)
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else {}
    with torch.inference_mode():
        torch.testing.assert_close(fused(x), reference(x), **tolerance)
        expected_out, expected_residual = reference.add_and_norm(x, residual)
        got_x, got_residual = x.clone(), residual.clone()
        out, new_residual = fused.add_and_norm(got_x, got_residual)
    assert out.data_ptr() == got_x.data_ptr() and new_residual.data_ptr() == got_residual.data_ptr()
    torch.testing.assert_close(new_residual, expected_residual, atol=0, rtol=0)
    torch.testing.assert_close(out, expected_out, **tolerance)


def test_rotary_in_place_on_strided_slice_matches_torch(ops: None) -> None:
    _, _, _, positions, rotary = fused_inputs()
    # [num_tokens, 4 q heads + 2 k heads + 2 v heads, head_dim]: rotate the q and k heads only
    qkv = torch.randn(7, 8, 16)
    expected = rotary.for_positions(positions, torch.float32).rotate(qkv[:, :6])
    native_batch = rotary.for_positions(positions, torch.float32, use_native_ops=True)
    got = qkv.clone()
    native_batch.rotate(got[:, :6])
    torch.testing.assert_close(got[:, :6], expected, atol=1e-6, rtol=1e-6)
    assert torch.equal(got[:, 6:], qkv[:, 6:])
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.vbatch.rotary_embedding(
            positions + 64, got[:, :6], native_batch.cos, native_batch.sin
        )


def test_fused_ops_opcheck(ops: None) -> None:
    x, residual, weight, positions, rotary = fused_inputs()
    tables = rotary.for_positions(positions, torch.float32, use_native_ops=True)
    torch.library.opcheck(torch.ops.vbatch.rms_norm.default, (x, weight, 1e-6))
    torch.library.opcheck(
        torch.ops.vbatch.fused_add_rms_norm.default, (x.clone(), residual.clone(), weight, 1e-6)
    )
    torch.library.opcheck(
        torch.ops.vbatch.rotary_embedding.default,
        (positions, torch.randn(7, 6, 16), tables.cos, tables.sin),
    )


def advance_inputs() -> tuple[torch.Tensor, ...]:
    """(input_ids, positions, slot_mapping, seq_lens, token_ids, block_tables) of 3 decode rows
    at positions 14, 15 and 16 with block size 16: the second row's next token opens a block."""
    positions = torch.tensor([14, 15, 16])
    block_tables = torch.tensor([[5, 6, 0], [7, 8, 0], [9, 10, 11]], dtype=torch.int32)
    slots = torch.tensor([5 * 16 + 14, 7 * 16 + 15, 10 * 16 + 0])
    lens = (positions + 1).to(torch.int32)
    return torch.tensor([3, 4, 5]), positions, slots, lens, torch.tensor([7, 8, 9]), block_tables


def test_advance_decode_moves_each_row_on_by_one(ops: None) -> None:
    input_ids, positions, slots, lens, token_ids, block_tables = advance_inputs()
    torch.ops.vbatch.advance_decode(
        input_ids, positions, slots, lens, token_ids, block_tables[:, :2], 16
    )
    assert input_ids.tolist() == [7, 8, 9]
    assert positions.tolist() == [15, 16, 17]
    assert slots.tolist() == [5 * 16 + 15, 8 * 16 + 0, 10 * 16 + 1]
    assert lens.tolist() == [16, 17, 18]
    torch.library.opcheck(
        torch.ops.vbatch.advance_decode.default, (*advance_inputs()[:5], block_tables, 16)
    )


def test_advance_decode_past_the_block_table_changes_nothing(ops: None) -> None:
    inputs = advance_inputs()
    before = [t.clone() for t in inputs]
    # NOTE: the first row's next position (15) fits one block of 16; the others' (16, 17) do not.
    with pytest.raises(RuntimeError, match="past its block table"):
        torch.ops.vbatch.advance_decode(*inputs[:5], inputs[5][:, :1], 16)
    assert all(torch.equal(a, b) for a, b in zip(inputs, before, strict=True))
    with pytest.raises(RuntimeError, match="wrong dtype"):
        torch.ops.vbatch.advance_decode(*inputs[:4], inputs[4].int(), inputs[5], 16)


def logsumexp_over_tiles(logits: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
    """log_softmax(logits)[targets] per row through vbatch::logsumexp_update, `chunk` columns
    of `logits` per tile."""
    num_rows, vocab = logits.shape
    row_max = torch.full((num_rows,), float("-inf"))
    row_sum = torch.zeros(num_rows, dtype=torch.float64)
    picked = torch.empty(num_rows)
    buffer = torch.empty(num_rows, chunk)
    for start in range(0, vocab, chunk):
        tile = buffer[:, : min(chunk, vocab - start)]
        tile.copy_(logits[:, start : start + chunk])
        torch.ops.vbatch.logsumexp_update(tile, targets, start, row_max, row_sum, picked)
    return (picked.double() - row_max.double() - row_sum.log()).float()


def test_logsumexp_over_vocab_tiles_matches_log_softmax(ops: None) -> None:
    torch.manual_seed(0)
    logits = torch.randn(67, 5000) * 8
    # NOTE: a row whose first tiles are all -inf, and one with a huge logit in its last tile.
    logits[1, :4000] = float("-inf")
    logits[2, 4999] = 80.0
    targets = torch.randint(0, 5000, (67,))
    targets[1] = 4500
    want = torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]
    for chunk in (1024, 3072, 5000):
        got = logsumexp_over_tiles(logits, targets, chunk)
        assert (got - want).abs().max().item() <= 1e-5
    with pytest.raises(RuntimeError, match="row_sum must be"):
        torch.ops.vbatch.logsumexp_update(
            logits[:, :64], targets, 0, torch.zeros(67), torch.zeros(67), torch.zeros(67)
        )


def test_build_key_tracks_sources(tmp_path: Path) -> None:
    csrc_dir = native.find_csrc_dir()
    assert csrc_dir is not None
    copy = tmp_path / "csrc"
    shutil.copytree(csrc_dir, copy)
    key = native.build_key(copy, with_cuda=False)
    assert native.build_key(copy, with_cuda=True) != key
    with (copy / "cpu" / "paged_attention.cpp").open("a") as f:
        f.write("\n")
    assert native.build_key(copy, with_cuda=False) != key


def test_build_key_tracks_cpu_flags_and_target_isa(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    csrc_dir = native.find_csrc_dir()
    assert csrc_dir is not None
    monkeypatch.delenv(native.MARCH_ENV, raising=False)
    key = native.build_key(csrc_dir, with_cuda=False)
    monkeypatch.setenv(native.MARCH_ENV, "haswell")
    assert native.march_flag() == "-march=haswell"
    assert native.build_key(csrc_dir, with_cuda=False) != key
    monkeypatch.delenv(native.MARCH_ENV)
    monkeypatch.setattr(native, "cpu_flags", lambda: "flags : fpu sse2 avx2")
    assert native.build_key(csrc_dir, with_cuda=False) != key


def test_failed_build_logs_one_line_and_returns_false(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    csrc_dir = native.find_csrc_dir()
    assert csrc_dir is not None
    broken = tmp_path / "csrc"
    shutil.copytree(csrc_dir, broken)
    # NOTE: the other sources become one-line stubs, so the build fails in seconds, not minutes.
    for index, source in enumerate(sorted(broken.rglob("*.cpp"))):
        source.write_text(f"int unused_{index};\n")
    (broken / "cpu" / "paged_attention.cpp").write_text("#error deliberately broken\n")
    with caplog.at_level(logging.WARNING, logger="vbatch.layers.native"):
        assert not native.try_build_and_load(broken, tmp_path / "cache", with_cuda=False)
    (record,) = caplog.records
    assert "deliberately broken" in record.getMessage()
    assert "\n" not in record.getMessage()


@pytest.mark.slow
def test_concurrent_builds_share_one_result(tmp_path: Path) -> None:
    script = (
        "import sys, torch; from pathlib import Path; from vbatch.layers import native; "
        "sys.exit(0 if native.try_build_and_load(native.find_csrc_dir(), Path(sys.argv[1]), "
        "False) else 1)"
    )
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path)]) for _ in range(2)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    assert len(list((tmp_path / "native").glob("*/vbatch_native.so"))) == 1


# NOTE: stands in for nvcc in check_cuda_compile.sh: the same flags, but the list of every file
# the compile reads (nvcc -M) instead of the object file.
NVCC_DEPENDENCIES = """#!/usr/bin/env bash
args=()
while [ $# -gt 0 ]; do
  if [ "$1" = -o ]; then shift 2; else args+=("$1"); shift; fi
done
exec "$REAL_NVCC" "${args[@]}" -M -o "$DEPENDENCY_FILE"
"""


def cuda_compile_key(script: Path, nvcc: str, tmp_path: Path) -> str:
    """A digest of everything the compile check's result depends on: the script, the content of
    every file nvcc reads for it (sources, torch's, CUDA's and the system's headers), nvcc's and
    the host compiler's versions and the environment the script reads."""
    import hashlib
    import os

    wrapper, dependency_file = tmp_path / "nvcc-dependencies", tmp_path / "dependencies.d"
    wrapper.write_text(NVCC_DEPENDENCIES)
    wrapper.chmod(0o755)
    env = {**os.environ, "NVCC": str(wrapper), "REAL_NVCC": nvcc}
    env["DEPENDENCY_FILE"] = str(dependency_file)
    result = subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr[-4000:]
    dependencies = dependency_file.read_text().replace("\\\n", " ").split(":", 1)[1].split()
    digest = hashlib.sha256(script.read_bytes())
    # NOTE: the one file gone is the header stub the script writes into its temporary directory.
    for path in sorted(p for p in set(dependencies) if Path(p).is_file()):
        digest.update(path.encode() + b"\0" + Path(path).read_bytes())
    for tool in (nvcc, "gcc", "g++"):
        version = subprocess.run([tool, "--version"], capture_output=True, timeout=60).stdout
        digest.update(version)
    digest.update(repr([os.environ.get(name) for name in ("CUDA_ARCH", "NVCC")]).encode())
    return digest.hexdigest()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_cuda_source_compiles_with_nvcc(tmp_path: Path) -> None:
    """The compile takes 30-60 s here, so a pass is remembered under a digest of all its inputs
    (as a build cache does): only a compile of unchanged inputs is skipped."""
    from vbatch.models.loader import cache_dir

    script = Path(__file__).resolve().parents[1] / "csrc" / "check_cuda_compile.sh"
    nvcc = shutil.which("nvcc")
    assert nvcc is not None
    passed = cache_dir() / "cuda-compile-checks" / cuda_compile_key(script, nvcc, tmp_path)
    if passed.exists():
        return
    result = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    passed.parent.mkdir(parents=True, exist_ok=True)
    passed.touch()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_reference(ops: None, dtype: torch.dtype) -> None:
    """The op's rows and, past the op's limits, a chunk through SDPA, in one batch."""
    long_chunk = (300, 260)
    assert long_chunk[0] * long_chunk[1] > native.MAX_NATIVE_CHUNK_WORK
    specs = [*MIXED, long_chunk]
    q, k, v, k_cache, v_cache, meta = make_batch(specs, SMOLLM2_HEADS, dtype=dtype, device="cuda")
    out, ref = run_native_and_reference((q, k, v, k_cache, v_cache, meta))
    assert out.is_cuda and out.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.double().cpu() - ref).abs().max().item() < tolerance


def encoder_inputs(
    lens: list[int], num_heads: int, head_dim: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v [tokens, heads, head_dim] (views of one fused projection, as the encoder's) and
    the int32 prompt starts."""
    generator = torch.Generator().manual_seed(seed)
    fused = torch.randn(sum(lens), 3, num_heads, head_dim, generator=generator)
    starts = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32)
    return fused[:, 0], fused[:, 1], fused[:, 2], starts


@pytest.mark.parametrize(("num_heads", "head_dim"), [(4, 32), (3, 24), (2, 100), (12, 64)])
def test_encoder_attention_matches_sdpa_per_prompt(
    ops: None, num_heads: int, head_dim: int
) -> None:
    from vbatch.models.bert import _attend_per_prompt

    lens = [1, 7, 8, 9, 33, 120, 2]
    q, k, v, starts = encoder_inputs(lens, num_heads, head_dim)
    got = torch.ops.vbatch.encoder_attention(q, k, v, starts, head_dim**-0.5)
    want = _attend_per_prompt(q, k, v, lens)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_encoder_attention_keeps_prompts_apart(ops: None) -> None:
    q, k, v, starts = encoder_inputs([5, 6], 2, 16)
    alone = torch.ops.vbatch.encoder_attention(q[:5], k[:5], v[:5], starts[:2], 0.25)
    changed = v.clone()
    changed[5:] += 100.0
    both = torch.ops.vbatch.encoder_attention(q, k, changed, starts, 0.25)
    assert torch.equal(both[:5], alone)


def test_encoder_attention_rejects_bad_inputs(ops: None) -> None:
    q, k, v, starts = encoder_inputs([3, 4], 2, 8)
    op = torch.ops.vbatch.encoder_attention
    with pytest.raises(RuntimeError, match="from 0 to num_tokens"):
        op(q, k, v, torch.tensor([0, 3, 6], dtype=torch.int32), 1.0)
    with pytest.raises(RuntimeError, match="every prompt needs a token"):
        op(q, k, v, torch.tensor([0, 3, 3, 7], dtype=torch.int32), 1.0)
    with pytest.raises(RuntimeError, match="float32"):
        op(q.double(), k.double(), v.double(), starts, 1.0)
    with pytest.raises(RuntimeError, match="int32"):
        op(q, k, v, starts.long(), 1.0)
    torch.library.opcheck(torch.ops.vbatch.encoder_attention.default, (q, k, v, starts, 0.5))


def test_gelu_erf_matches_exact_gelu_in_float64(ops: None) -> None:
    # The reference is float64: torch's own float32 gelu is off by up to 1.2e-6 on AVX-512.
    x = torch.cat([torch.linspace(-12.0, 12.0, 100_003), torch.randn(70_001) * 3])
    want = torch.nn.functional.gelu(x.double())
    got = x.clone()
    torch.ops.vbatch.gelu_erf_(got)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    torch.library.opcheck(torch.ops.vbatch.gelu_erf_.default, (x[:100].clone(),))
    with pytest.raises(RuntimeError, match="contiguous float32"):
        torch.ops.vbatch.gelu_erf_(x.view(2, -1).t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_float64_on_the_halves_of_a_fused_output(
    ops: None, dtype: torch.dtype
) -> None:
    generator = torch.Generator().manual_seed(0)
    gate_up = torch.randn(300, 2 * 1537, generator=generator) * 6
    gate_up[0, :40] = torch.linspace(-100.0, 100.0, 40)
    gate_up = gate_up.to(dtype)
    gate, up = gate_up.split(1537, dim=-1)
    got = torch.ops.vbatch.silu_mul(gate, up)
    want = torch.nn.functional.silu(gate.double()) * up.double()
    assert got.shape == gate.shape and got.is_contiguous() and got.dtype == dtype
    tolerance = {"rtol": 2e-6, "atol": 1e-6} if dtype == torch.float32 else {}
    torch.testing.assert_close(got, want.to(dtype), **tolerance)
    transposed = gate_up.t().contiguous()
    torch.testing.assert_close(
        torch.ops.vbatch.silu_mul(transposed[:1537], transposed[1537:]), got.t()
    )
    torch.library.opcheck(torch.ops.vbatch.silu_mul.default, (gate[:9], up[:9]))
    with pytest.raises(RuntimeError, match="one shape with contiguous rows"):
        torch.ops.vbatch.silu_mul(gate, up[:, :-1])
    with pytest.raises(RuntimeError, match="one shape with contiguous rows"):
        torch.ops.vbatch.silu_mul(gate.t(), up.t())
    with pytest.raises(RuntimeError, match="share a dtype"):
        torch.ops.vbatch.silu_mul(gate, up.float() if dtype != torch.float32 else up.double())


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    ("rows", "out_features", "in_features"),
    [(1, 40, 33), (7, 100, 64), (13, 576, 576), (70, 37, 1)],
)
def test_packed_linear_matches_float64(
    ops: None, rows: int, out_features: int, in_features: int, bias: bool
) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    packed = torch.ops.vbatch.pack_linear_weight(weight)
    got = torch.ops.vbatch.packed_linear(x, packed, out_features, b)
    want = torch.nn.functional.linear(
        x.double(), weight.double(), None if b is None else b.double()
    )
    assert got.shape == (rows, out_features)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * in_features**0.5)


@pytest.mark.parametrize(
    ("rows", "out_features", "in_features"),
    [(1, 40, 576), (7, 100, 33), (13, 576, 1536), (70, 37, 2), (0, 8, 8)],
)
def test_int8_packed_mm_is_exact_at_full_range(
    ops: None, rows: int, out_features: int, in_features: int
) -> None:
    """Products at 127 x 127 and -128 x 127: pairs of them overflow the saturating int16 sums
    that int8 GEMMs without VNNI use, so only a kernel that keeps them apart gets these right."""
    gen = torch.Generator().manual_seed(rows)
    a = torch.randint(-128, 128, (rows, in_features), generator=gen, dtype=torch.int8)
    w = torch.randint(-127, 128, (out_features, in_features), generator=gen, dtype=torch.int8)
    if rows:
        a[0], w[0] = 127, 127
        a[-1], w[-1] = -128, 127
    packed = torch.ops.vbatch.pack_int8_weight(w)
    got = torch.ops.vbatch.int8_packed_mm(a, packed, out_features)
    assert got.dtype == torch.int32 and got.shape == (rows, out_features)
    assert torch.equal(got.long(), a.long() @ w.long().t())
    torch.library.opcheck(torch.ops.vbatch.pack_int8_weight.default, (w,))
    torch.library.opcheck(torch.ops.vbatch.int8_packed_mm.default, (a, packed, out_features))


def test_int8_packed_mm_takes_minus_128_activations_and_refuses_it_in_weights(ops: None) -> None:
    w = torch.full((8, 16), -127, dtype=torch.int8)
    w[1] = 127
    packed = torch.ops.vbatch.pack_int8_weight(w)
    a = torch.full((2, 16), -128, dtype=torch.int8)
    got = torch.ops.vbatch.int8_packed_mm(a, packed, 8)
    assert torch.equal(got.long(), a.long() @ w.long().t())
    with pytest.raises(RuntimeError, match=r"\[-127, 127\]"):
        torch.ops.vbatch.pack_int8_weight(torch.full((2, 16), -128, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="this build's pack_int8_weight"):
        torch.ops.vbatch.int8_packed_mm(torch.ones(2, 20, dtype=torch.int8), packed, 8)


def quantized_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x's rows as symmetric int8 by their largest magnitude, in torch ops: (values, scales)."""
    scale = x.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    return torch.round(x / scale[:, None]).to(torch.int8), scale


def test_int8_quantize_rows_rounds_as_torch_does(ops: None) -> None:
    """Half-way values go to the even neighbour, as torch.round; an all-zero row has scale
    1e-12 / 127 and zeros."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 70, generator=gen) * torch.logspace(-3, 3, 9)[:, None]
    x[0, :5] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5])
    x[1] = 0.0
    q, scale = torch.ops.vbatch.int8_quantize_rows(x)
    want_q, want_scale = quantized_rows(x)
    assert torch.equal(q, want_q) and torch.equal(scale, want_scale)
    assert q[0, :5].tolist() == [127, 2, -4, 0, 0]
    torch.library.opcheck(torch.ops.vbatch.int8_quantize_rows.default, (x,))


def native_int8_layer(
    weight: torch.Tensor, bias: torch.Tensor, swiglu: bool
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(packed weight, [col_scale, col_sums, col_bias]) as the engine's int8 layer gives them to
    vbatch::int8_linear."""
    layer = Int8DynamicLinear(weight, bias, NATIVE, swiglu=swiglu)
    assert layer.swiglu_size == (weight.shape[0] // 2 if swiglu else None)
    return layer.packed, layer.columns


@pytest.mark.parametrize(
    ("rows", "out_features", "in_features"),
    [(1, 40, 576), (7, 100, 33), (13, 576, 1536), (70, 38, 2), (300, 64, 64), (0, 8, 8)],
)
def test_int8_linear_is_its_exact_int32_sums_rescaled(
    ops: None, rows: int, out_features: int, in_features: int
) -> None:
    """Against the same quantization summed in int64: the rows' and weights' full range (127 x
    127 everywhere in row 0, whose offset bytes under VNNI are 255) comes back exact before the
    float32 rescaling; the SwiGLU form is silu_mul of the plain form's gate and up, and
    int8_scale_sums (torch._int_mm's rescaling) gives the same bits."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    if rows:
        x[0], weight[0] = 1.0, 1.0
        x[-1] *= 1000.0
    q_x, x_scale = quantized_rows(x)
    q_weight, w_scale = quantized_rows(weight)
    sums = q_x.long() @ q_weight.long().t()
    want = sums.float() * x_scale[:, None] * w_scale + bias
    packed, columns = native_int8_layer(weight, bias, swiglu=False)
    got = torch.ops.vbatch.int8_linear(x, packed, *columns, out_features, False)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    if rows:
        assert int(sums[0, 0]) == 127 * 127 * in_features
    intermediate = out_features // 2
    packed, columns = native_int8_layer(weight, bias, swiglu=True)
    act = torch.ops.vbatch.int8_linear(x, packed, *columns, intermediate, True)
    assert torch.equal(act, torch.ops.vbatch.silu_mul(*got.split(intermediate, dim=-1)))
    scaled = torch.ops.vbatch.int8_scale_sums(sums.int(), x_scale, w_scale, bias, True)
    assert torch.equal(scaled, act)
    torch.library.opcheck(
        torch.ops.vbatch.int8_linear.default, (x, packed, *columns, intermediate, True)
    )
    torch.library.opcheck(
        torch.ops.vbatch.int8_scale_sums.default, (sums.int(), x_scale, w_scale, bias, False)
    )
    torch.library.opcheck(torch.ops.vbatch.pack_int8_linear.default, (q_weight,))


def test_int8_linear_refuses_a_mismatched_packing(ops: None) -> None:
    weight = torch.randn(40, 32)
    packed, columns = native_int8_layer(weight, torch.zeros(40), swiglu=False)
    x = torch.randn(2, 32)
    with pytest.raises(RuntimeError, match="this build's pack_int8_linear for 20"):
        torch.ops.vbatch.int8_linear(torch.randn(2, 20), packed, *columns, 40, False)
    with pytest.raises(RuntimeError, match="out_features 200 does not match"):
        torch.ops.vbatch.int8_linear(x, packed, *columns, 200, False)
    with pytest.raises(RuntimeError, match=rf"must be contiguous \[{len(columns[0])}\]"):
        torch.ops.vbatch.int8_linear(x, packed, *columns[:2], torch.zeros(3), 40, False)


def test_packed_linear_gives_each_row_the_same_bits_in_any_batch(ops: None) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(45, 96, generator=gen)
    packed = torch.ops.vbatch.pack_linear_weight(torch.randn(200, 96, generator=gen))
    full = torch.ops.vbatch.packed_linear(x, packed, 200, None)
    num_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = torch.ops.vbatch.packed_linear(x, packed, 200, None)
    finally:
        torch.set_num_threads(num_threads)
    assert torch.equal(serial, full)
    for first, last in ((0, 1), (5, 6), (3, 10), (44, 45), (7, 45)):
        assert torch.equal(
            torch.ops.vbatch.packed_linear(x[first:last], packed, 200, None), full[first:last]
        )


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    ("rows", "intermediate", "in_features"),
    [(1, 8, 9), (5, 37, 20), (13, 1536, 576), (64, 100, 64), (70, 16, 1), (600, 48, 40)],
)
def test_packed_swiglu_gives_the_bits_of_packed_linear_then_silu_mul(
    ops: None, rows: int, intermediate: int, in_features: int, bias: bool
) -> None:
    gen = torch.Generator().manual_seed(intermediate)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(2 * intermediate, in_features, generator=gen)
    b = torch.randn(2 * intermediate, generator=gen) if bias else None
    gate_up = torch.ops.vbatch.packed_linear(
        x, torch.ops.vbatch.pack_linear_weight(weight), 2 * intermediate, b
    )
    want = torch.ops.vbatch.silu_mul(*gate_up.split(intermediate, dim=-1))
    packed = torch.ops.vbatch.pack_swiglu_weight(weight)
    got = torch.ops.vbatch.packed_swiglu(x, packed, intermediate, b)
    assert got.shape == (rows, intermediate)
    assert torch.equal(got, want)
    torch.library.opcheck(torch.ops.vbatch.packed_swiglu.default, (x[:3], packed, intermediate, b))


@pytest.mark.parametrize("kernel", ["silu_mul", "packed_swiglu", "int8_scale_sums"])
def test_a_kernel_that_flushes_denormals_gives_each_thread_its_setting_back(
    ops: None, kernel: str
) -> None:
    """The SiLU kernels flush denormals while they run (a lane an AVX2 vector computes and then
    drops took a microcode assist per vector), and restore each thread's setting: torch's
    arithmetic after them, on every thread, still gives denormals."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(256, 64, generator=gen)
        weight = torch.randn(2 * 1536, 64, generator=gen)
        if kernel == "silu_mul":
            torch.ops.vbatch.silu_mul(*(x @ weight.t()).split(1536, dim=-1))
        elif kernel == "packed_swiglu":
            packed = torch.ops.vbatch.pack_swiglu_weight(weight)
            torch.ops.vbatch.packed_swiglu(x, packed, 1536, None)
        else:
            sums = torch.randint(-1000, 1000, (256, 2 * 1536), dtype=torch.int32, generator=gen)
            ones = torch.ones(2 * 1536)
            torch.ops.vbatch.int8_scale_sums(sums, torch.ones(256), ones, ones * 0, True)
        tiny = torch.full((1 << 20,), 1e-38) / 4
    finally:
        torch.set_num_threads(num_threads)
    assert bool((tiny > 0).all()), "a thread kept flushing denormals to zero"


def test_packed_swiglu_rejects_bad_inputs(ops: None) -> None:
    packed = torch.ops.vbatch.pack_swiglu_weight(torch.randn(80, 16))
    op = torch.ops.vbatch.packed_swiglu
    with pytest.raises(RuntimeError, match="gate rows then"):
        torch.ops.vbatch.pack_swiglu_weight(torch.randn(81, 16))
    with pytest.raises(RuntimeError, match="packed must come from this build's packing"):
        op(torch.randn(3, 8), packed, 40, None)
    with pytest.raises(RuntimeError, match="does not match"):
        op(torch.randn(3, 16), packed, 400, None)
    with pytest.raises(RuntimeError, match="bias must be float32"):
        op(torch.randn(3, 16), packed, 40, torch.randn(40))
    assert op(torch.randn(0, 16), packed, 40, None).shape == (0, 40)


def test_packed_linear_rejects_bad_inputs(ops: None) -> None:
    weight = torch.randn(40, 16)
    packed = torch.ops.vbatch.pack_linear_weight(weight)
    op = torch.ops.vbatch.packed_linear
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.vbatch.pack_linear_weight(weight.double())
    with pytest.raises(RuntimeError, match="x must be a 2-D float32"):
        op(torch.randn(3, 16).double(), packed, 40, None)
    with pytest.raises(RuntimeError, match="16 input features"):
        op(torch.randn(3, 16), torch.ops.vbatch.pack_linear_weight(torch.randn(40, 8)), 40, None)
    with pytest.raises(RuntimeError, match="does not match"):
        op(torch.randn(3, 16), packed, 400, None)
    with pytest.raises(RuntimeError, match="bias must be float32"):
        op(torch.randn(3, 16), packed, 40, torch.randn(39))
    torch.library.opcheck(op.default, (torch.randn(5, 16), packed, 40, torch.randn(40)))
    torch.library.opcheck(op.default, (torch.randn(0, 16), packed, 40, None))


def _packed_chunks(weight: torch.Tensor, chunk_cols: int) -> list[torch.Tensor]:
    return [
        torch.ops.vbatch.pack_linear_weight(weight[start : start + chunk_cols])
        for start in range(0, weight.shape[0], chunk_cols)
    ]


@pytest.mark.parametrize(
    ("rows", "vocab", "in_features"),
    [(1, 40, 33), (7, 3 * 64 + 5, 64), (13, 700, 576), (70, 37, 2), (300, 130, 16)],
)
def test_packed_head_argmax_is_the_argmax_of_packed_linear(
    ops: None, rows: int, vocab: int, in_features: int
) -> None:
    chunk_cols = 64
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(vocab, in_features, generator=gen)
    logits = torch.ops.vbatch.packed_linear(
        x, torch.ops.vbatch.pack_linear_weight(weight), vocab, None
    )
    chunks = _packed_chunks(weight, chunk_cols)
    got = torch.ops.vbatch.packed_head_argmax(x, chunks, chunk_cols, vocab)
    assert got.dtype == torch.int64
    assert torch.equal(got, logits.argmax(dim=-1))
    num_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(torch.ops.vbatch.packed_head_argmax(x, chunks, chunk_cols, vocab), got)
    finally:
        torch.set_num_threads(num_threads)
    torch.library.opcheck(
        torch.ops.vbatch.packed_head_argmax.default, (x[:3], chunks, chunk_cols, vocab)
    )


def test_packed_head_argmax_takes_the_first_maximum_and_the_first_nan(ops: None) -> None:
    """Ties across lanes, panels, chunks and the threads' ranges go to the lowest column, as in
    torch.argmax; a NaN logit wins over every number, and the first NaN over the others."""
    vocab, chunk_cols = 300, 64
    weight = torch.zeros(vocab, 4)
    for column in (250, 17, 130, 299):
        weight[column, 0] = 1.0
    x = torch.tensor([[1.0, 0.0, 0.0, 0.0], [-1.0, 0.0, 0.0, 0.0]])
    chunks = _packed_chunks(weight, chunk_cols)
    got = torch.ops.vbatch.packed_head_argmax(x, chunks, chunk_cols, vocab)
    # NOTE: row 1 scores -1 at the four columns and 0 elsewhere: its first 0 is column 0.
    assert got.tolist() == [17, 0]
    weight[[200, 40], 1] = float("nan")
    nan_x = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    got = torch.ops.vbatch.packed_head_argmax(
        nan_x, _packed_chunks(weight, chunk_cols), chunk_cols, vocab
    )
    assert got.tolist() == [40]


def test_packed_head_argmax_rejects_bad_inputs(ops: None) -> None:
    chunks = _packed_chunks(torch.randn(100, 16), 64)
    op = torch.ops.vbatch.packed_head_argmax
    with pytest.raises(RuntimeError, match="positive multiple"):
        op(torch.randn(2, 16), chunks, 60, 100)
    with pytest.raises(RuntimeError, match="do not make"):
        op(torch.randn(2, 16), chunks, 64, 200)
    wide = _packed_chunks(torch.randn(200, 16), 128)
    with pytest.raises(RuntimeError, match="must pack"):
        op(torch.randn(2, 16), [wide[1], wide[1]], 128, 200)
    with pytest.raises(RuntimeError, match="have 8 input features"):
        op(torch.randn(2, 8), chunks, 64, 100)
    assert op(torch.randn(0, 16), chunks, 64, 100).shape == (0,)
