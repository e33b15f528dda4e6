"""The torch paged-attention backend against a dense float64 reference, and backend selection."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable

import pytest
import torch

from vbatch.errors import ConfigError
from vbatch.layers import get_attention_backend
from vbatch.layers.attention import BatchPlanner, TorchAttentionBackend


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention for one sequence whose queries are its last q.shape[0] positions; a
    query at position p sees keys in (p - sliding_window, p]; scores soft-capped if asked."""
    query_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    query_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
    key_pos = torch.arange(seq_len)[None, :]
    is_masked = key_pos > query_pos
    if sliding_window is not None:
        is_masked |= key_pos <= query_pos - sliding_window
    scores = scores.masked_fill(is_masked, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


CASES = [
    # (block_size, num_heads, num_kv_heads, [(num_cached, query_len), ...])
    (4, 4, 4, [(0, 9), (0, 1), (0, 16)]),  # prefill only
    (4, 8, 2, [(7, 1), (0, 1), (15, 1), (3, 1)]),  # decode only, batched path
    (16, 6, 3, [(0, 5), (20, 1), (33, 12), (16, 1)]),  # mixed prefill chunks and decodes
    (1, 4, 1, [(5, 3), (0, 2)]),  # one token per block
    (8, 9, 3, [(63, 1), (0, 64), (8, 8)]),  # exact block boundaries
]


@pytest.mark.parametrize(("sliding_window", "softcap"), [(None, None), (1, None), (3, 1.5)])
@pytest.mark.parametrize(("block_size", "num_heads", "num_kv_heads", "specs"), CASES)
def test_torch_backend_matches_dense(
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    specs: list[tuple[int, int]],
    sliding_window: int | None,
    softcap: float | None,
    make_attention_metadata: Callable,
) -> None:
    rng = random.Random(block_size * 100 + num_heads)
    torch.manual_seed(block_size)
    head_dim, num_blocks = 16, 64
    scale = head_dim**-0.5
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    seq_lens = [num_cached + query_len for num_cached, query_len in specs]
    query_lens = [query_len for _, query_len in specs]
    block_tables = [[pool.pop() for _ in range(-(-n // block_size))] for n in seq_lens]
    full_k = [torch.randn(n, num_kv_heads, head_dim) for n in seq_lens]
    full_v = [torch.randn(n, num_kv_heads, head_dim) for n in seq_lens]
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = 100 * torch.randn(cache_shape), 100 * torch.randn(cache_shape)
    # NOTE: earlier steps wrote each sequence's cached prefix; the cache elsewhere is garbage.
    for i, (num_cached, _) in enumerate(specs):
        for pos in range(num_cached):
            block, offset = block_tables[i][pos // block_size], pos % block_size
            k_cache[block, offset] = full_k[i][pos]
            v_cache[block, offset] = full_v[i][pos]
    q = torch.randn(sum(query_lens), num_heads, head_dim)
    k = torch.cat(
        [seq_k[num_cached:] for seq_k, (num_cached, _) in zip(full_k, specs, strict=True)]
    )
    v = torch.cat(
        [seq_v[num_cached:] for seq_v, (num_cached, _) in zip(full_v, specs, strict=True)]
    )
    meta = make_attention_metadata(query_lens, seq_lens, block_tables, block_size)
    rule = (sliding_window, softcap)
    out = TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, scale, *rule)
    assert out.shape == q.shape
    starts = [0, *torch.tensor(query_lens).cumsum(0).tolist()]
    for i in range(len(specs)):
        rows = q[starts[i] : starts[i + 1]]
        expected = dense_attention(rows, full_k[i], full_v[i], scale, *rule)
        torch.testing.assert_close(
            out[starts[i] : starts[i + 1]].double(), expected, atol=1e-5, rtol=0
        )
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    torch.testing.assert_close(flat_k[meta.slot_mapping], k)


def test_decode_only_batch_equals_one_by_one(make_attention_metadata: Callable) -> None:
    """The batched decode path gives each sequence what it would get alone."""
    torch.manual_seed(3)
    block_size, num_blocks, num_kv_heads, head_dim = 4, 32, 2, 8
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(cache_shape), torch.randn(cache_shape)
    seq_lens = [5, 13, 1, 8]
    block_tables = [[3, 9], [0, 30, 7, 12], [21], [5, 6]]
    q = torch.randn(4, 4, head_dim)
    k, v = torch.randn(4, num_kv_heads, head_dim), torch.randn(4, num_kv_heads, head_dim)
    meta = make_attention_metadata([1] * 4, seq_lens, block_tables, block_size)
    backend = TorchAttentionBackend()
    batched = backend.forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, 0.3)
    for i in range(4):
        alone = make_attention_metadata([1], [seq_lens[i]], [block_tables[i]], block_size)
        out = backend.forward(
            q[i : i + 1], k[i : i + 1], v[i : i + 1], k_cache, v_cache, alone, 0.3
        )
        torch.testing.assert_close(batched[i : i + 1], out, atol=1e-6, rtol=0)


def test_planner_splits_by_query_len_or_work(make_attention_metadata: Callable) -> None:
    """Short: query_len <= 2, or query_len * seq_len <= 24. The short rows are built only when
    some chunk is long, and keep batch order."""
    planner = BatchPlanner(max_short_query_len=2, max_short_work=24)
    query_lens, seq_lens = [1, 6, 4, 2, 5], [9, 6, 6, 30, 5]
    tables = [[0, 1, 2], [3, 4], [5, 6], list(range(7, 15)), [15, 16]]
    plan = planner.plan(make_attention_metadata(query_lens, seq_lens, tables, 4))
    assert plan.long_chunks == [(1, 1, 6, 6), (4, 13, 5, 5)]
    assert plan.short_rows is not None and plan.short_seq_lens is not None
    assert plan.short_rows.tolist() == [0, 7, 8, 9, 10, 11, 12]
    assert plan.short_seq_lens.tolist() == [9, 6, 30]
    all_short = planner.plan(make_attention_metadata([1, 4], [9, 6], tables[:2], 4))
    assert all_short.long_chunks == [] and all_short.short_rows is None


@pytest.mark.gpu
def test_planning_a_cuda_batch_never_waits_for_the_gpu(make_attention_metadata: Callable) -> None:
    planner = BatchPlanner(max_short_query_len=2, max_short_work=24)
    tables = [[0, 1, 2], [3, 4], [5, 6]]
    meta = make_attention_metadata([1, 6, 4], [9, 6, 6], tables, 4, "cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        plan = planner.plan(meta)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert plan.short_rows is not None and plan.short_rows.is_cuda
    assert plan.short_rows.tolist() == [0, 7, 8, 9, 10]


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_16bit_cache_widens_to_q_dtype(
    cache_dtype: torch.dtype, make_attention_metadata: Callable
) -> None:
    """A narrower cache gives what a float32 cache holding the same rounded values gives."""
    torch.manual_seed(5)
    block_size, num_blocks, num_kv_heads, head_dim = 4, 32, 2, 16
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(cache_shape), torch.randn(cache_shape)
    # decodes (batched path) and prefill chunks (SDPA over the gathered context) together
    query_lens, seq_lens = [1, 6, 1, 3], [9, 6, 4, 11]
    block_tables = [[3, 9, 14], [0, 30], [21], [5, 6, 7]]
    q = torch.randn(sum(query_lens), 6, head_dim)
    k = torch.randn(sum(query_lens), num_kv_heads, head_dim)
    v = torch.randn(sum(query_lens), num_kv_heads, head_dim)
    meta = make_attention_metadata(query_lens, seq_lens, block_tables, block_size)
    narrow_k, narrow_v = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    wide_k, wide_v = narrow_k.float(), narrow_v.float()
    backend = TorchAttentionBackend()
    out = backend.forward(q, k, v, narrow_k, narrow_v, meta, 0.25)
    expected = backend.forward(
        q, k.to(cache_dtype).float(), v.to(cache_dtype).float(), wide_k, wide_v, meta, 0.25
    )
    assert out.dtype == torch.float32 and narrow_k.dtype == cache_dtype
    assert torch.equal(narrow_k.float(), wide_k) and torch.equal(narrow_v.float(), wide_v)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)


def test_get_attention_backend(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vbatch.layers import native as native_module

    cpu = torch.device("cpu")
    assert isinstance(get_attention_backend("torch", cpu), TorchAttentionBackend)
    if native_module.is_available():
        assert get_attention_backend("native", cpu).name == "native"
        assert get_attention_backend("auto", cpu).name == "native"
    monkeypatch.setattr(native_module, "is_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="vbatch.layers"):
        fallback = get_attention_backend("native", cpu)
    assert isinstance(fallback, TorchAttentionBackend)
    assert "native attention backend unavailable" in caplog.text
    assert isinstance(get_attention_backend("auto", cpu), TorchAttentionBackend)
    with pytest.raises(ConfigError, match="fast"):
        get_attention_backend("fast", cpu)
