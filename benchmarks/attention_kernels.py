"""Attention time per step: native paged-attention ops vs the torch gather + SDPA path.

The decode case is one decode row per sequence; the prefill case is a step of long prefill
chunks behind a cached prefix (the native tiled kernel against per-chunk gather + SDPA).

Run: python -m benchmarks.attention_kernels [--case decode|prefill] [--threads 2]
    [--num-seqs 64] [--context 300] [--kv-cache-dtype float32|bfloat16|float16]
    [--block-order shuffled|in-order]
    [--num-chunks 12] [--min-chunk 20] [--max-chunk 400] [--cached-prefix 16]
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from vbatch.layers import native
from vbatch.layers.attention import (
    AttentionMetadata,
    BatchPlanner,
    TorchAttentionBackend,
    attend_long_chunks,
)


def make_decode_step(
    num_seqs: int,
    context: int,
    heads: tuple[int, int, int],
    block_size: int,
    num_layers: int,
    cache_dtype: torch.dtype = torch.float32,
    is_shuffled: bool = True,
) -> tuple[list[tuple[torch.Tensor, ...]], AttentionMetadata]:
    """Per-layer (q, k, v, k_cache, v_cache) and one decode batch over shuffled blocks, or over
    blocks in order (as prompts allocate them at prefill); q, k, v are float32, the caches
    `cache_dtype`."""
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(0)
    seq_lens = torch.randint(context - 20, context + 21, (num_seqs,), generator=gen)
    max_num_blocks = math.ceil(int(seq_lens.max()) / block_size)
    num_blocks = num_seqs * max_num_blocks
    order = torch.randperm(num_blocks, generator=gen) if is_shuffled else torch.arange(num_blocks)
    block_tables = order.view(num_seqs, max_num_blocks)
    last = seq_lens - 1
    slot_mapping = block_tables[torch.arange(num_seqs), last // block_size] * block_size
    meta = AttentionMetadata(
        slot_mapping=slot_mapping + last % block_size,
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32),
        seq_lens=seq_lens.to(torch.int32),
        block_tables=block_tables.to(torch.int32),
        query_lens_cpu=[1] * num_seqs,
        seq_lens_cpu=seq_lens.numpy().astype(np.int32),
        max_query_len=1,
        max_seq_len=int(seq_lens.max()),
    )
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    layers = [
        (
            torch.randn(num_seqs, num_heads, head_dim, generator=gen),
            torch.randn(num_seqs, num_kv_heads, head_dim, generator=gen),
            torch.randn(num_seqs, num_kv_heads, head_dim, generator=gen),
            torch.randn(cache_shape, generator=gen).to(cache_dtype),
            torch.randn(cache_shape, generator=gen).to(cache_dtype),
        )
        for _ in range(num_layers)
    ]
    return layers, meta


def make_prefill_step(
    query_lens: list[int],
    cached_prefix: int,
    heads: tuple[int, int, int],
    block_size: int,
    num_layers: int,
    cache_dtype: torch.dtype = torch.float32,
) -> tuple[list[tuple[torch.Tensor, ...]], AttentionMetadata]:
    """Per-layer (q, k_cache, v_cache) and one batch of prefill chunks, each behind a cached
    prefix of `cached_prefix` tokens, over shuffled blocks; the caches already hold every row."""
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(0)
    seq_lens = [cached_prefix + query_len for query_len in query_lens]
    max_num_blocks = math.ceil(max(seq_lens) / block_size)
    num_blocks = len(seq_lens) * max_num_blocks
    block_tables = torch.randperm(num_blocks, generator=gen).view(len(seq_lens), max_num_blocks)
    slots = [
        int(block_tables[i, pos // block_size]) * block_size + pos % block_size
        for i, seq_len in enumerate(seq_lens)
        for pos in range(cached_prefix, seq_len)
    ]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables.to(torch.int32),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=np.array(seq_lens, dtype=np.int32),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    layers = [
        (
            torch.randn(sum(query_lens), num_heads, head_dim, generator=gen),
            torch.randn(cache_shape, generator=gen).to(cache_dtype),
            torch.randn(cache_shape, generator=gen).to(cache_dtype),
        )
        for _ in range(num_layers)
    ]
    return layers, meta


def time_step(
    attention: Callable[..., torch.Tensor],
    layers: list[tuple[torch.Tensor, ...]],
    meta: AttentionMetadata,
    scale: float,
    num_steps: int,
) -> float:
    """Median milliseconds for one step (one attention call per layer)."""
    times = []
    for _ in range(num_steps + 2):
        start = time.perf_counter()
        for layer in layers:
            attention(*layer, meta, scale)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[2:])


def run_decode(args: argparse.Namespace, cache_dtype: torch.dtype) -> None:
    heads, scale = (9, 3, 64), 64**-0.5  # SmolLM2-135M
    layers, meta = make_decode_step(
        args.num_seqs,
        args.context,
        heads,
        16,
        args.num_layers,
        cache_dtype,
        is_shuffled=args.block_order == "shuffled",
    )
    native_backend, torch_backend = native.NativeAttentionBackend(), TorchAttentionBackend()
    torch.testing.assert_close(
        native_backend.forward(*layers[0], meta, scale),
        torch_backend.forward(*layers[0], meta, scale),
    )

    native_ms = time_step(native_backend.forward, layers, meta, scale, args.num_steps)
    gather_ms = time_step(torch_backend.forward, layers, meta, scale, args.num_steps)
    print(
        f"decode step: {args.num_seqs} seqs x ~{args.context} tokens, H=9 KVH=3 D=64, "
        f"{args.num_layers} layers, {args.threads} threads, {args.kv_cache_dtype} cache, "
        f"{args.block_order} blocks"
    )
    print(f"native       {native_ms:8.2f} ms/step")
    print(f"torch gather {gather_ms:8.2f} ms/step")
    print(f"speedup      {gather_ms / native_ms:8.2f}x")


def run_prefill(args: argparse.Namespace, cache_dtype: torch.dtype) -> None:
    heads, scale = (9, 3, 64), 64**-0.5  # SmolLM2-135M
    gen = torch.Generator().manual_seed(1)
    query_lens = torch.randint(
        args.min_chunk, args.max_chunk + 1, (args.num_chunks,), generator=gen
    ).tolist()
    layers, meta = make_prefill_step(
        query_lens, args.cached_prefix, heads, 16, args.num_layers, cache_dtype
    )
    plan = BatchPlanner(max_short_query_len=native.MAX_NATIVE_QUERY_LEN).plan(meta)

    def tiled(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *_: object) -> None:
        torch.ops.vbatch.paged_attention(
            q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale
        )

    def gather_sdpa(
        q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *_: object
    ) -> None:
        attend_long_chunks(q, k_cache, v_cache, plan, torch.empty_like(q), scale)

    q, k_cache, v_cache = layers[0]
    expected = torch.empty_like(q)
    attend_long_chunks(q, k_cache, v_cache, plan, expected, scale)
    got = torch.ops.vbatch.paged_attention(
        q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale
    )
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)

    tiled_ms, gather_ms = [], []
    # NOTE: A and B alternate so that load from other processes hits both alike.
    for _ in range(args.repeats):
        tiled_ms.append(time_step(tiled, layers, meta, scale, args.num_steps))
        gather_ms.append(time_step(gather_sdpa, layers, meta, scale, args.num_steps))
    print(
        f"prefill step: {args.num_chunks} chunks of {sum(query_lens)} tokens "
        f"({args.min_chunk}-{args.max_chunk}) behind a {args.cached_prefix}-token cached prefix, "
        f"H=9 KVH=3 D=64, {args.num_layers} layers, {args.threads} threads, "
        f"{args.kv_cache_dtype} cache"
    )
    print(f"native tiled  {statistics.median(tiled_ms):8.2f} ms/step  {fmt(tiled_ms)}")
    print(f"gather + SDPA {statistics.median(gather_ms):8.2f} ms/step  {fmt(gather_ms)}")
    speedups = [g / t for t, g in zip(tiled_ms, gather_ms, strict=True)]
    print(f"speedup       {statistics.median(speedups):8.2f}x       {fmt(speedups)}")


def fmt(values: list[float]) -> str:
    return "[" + ", ".join(f"{value:.2f}" for value in values) + "]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--case", choices=("decode", "prefill"), default="decode")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--num-chunks", type=int, default=12)
    parser.add_argument("--min-chunk", type=int, default=20)
    parser.add_argument("--max-chunk", type=int, default=400)
    parser.add_argument("--cached-prefix", type=int, default=16)
    parser.add_argument("--num-layers", type=int, default=30)
    parser.add_argument("--num-steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3, help="alternating A/B rounds (prefill)")
    parser.add_argument("--block-order", choices=("shuffled", "in-order"), default="shuffled")
    parser.add_argument(
        "--kv-cache-dtype", choices=("float32", "bfloat16", "float16"), default="float32"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not native.is_available():
        raise SystemExit("native kernels are unavailable; see the logged notice")
    cache_dtype = getattr(torch, args.kv_cache_dtype)
    if args.case == "decode":
        run_decode(args, cache_dtype)
    else:
        run_prefill(args, cache_dtype)


if __name__ == "__main__":
    main()
