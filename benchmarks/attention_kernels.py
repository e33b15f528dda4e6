"""Decode-step attention time: native paged-attention ops vs the torch gather + SDPA backend.

Run: python -m benchmarks.attention_kernels [--threads 2] [--num-seqs 64] [--context 300]
    [--kv-cache-dtype float32|bfloat16|float16]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch

from vbatch.layers import native
from vbatch.layers.attention import AttentionMetadata, TorchAttentionBackend


def make_decode_step(
    num_seqs: int,
    context: int,
    heads: tuple[int, int, int],
    block_size: int,
    num_layers: int,
    cache_dtype: torch.dtype = torch.float32,
) -> tuple[list[tuple[torch.Tensor, ...]], AttentionMetadata]:
    """Per-layer (q, k, v, k_cache, v_cache) and one decode batch over shuffled blocks; q, k, v
    are float32, the caches `cache_dtype`."""
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(0)
    seq_lens = torch.randint(context - 20, context + 21, (num_seqs,), generator=gen)
    max_num_blocks = math.ceil(int(seq_lens.max()) / block_size)
    num_blocks = num_seqs * max_num_blocks
    block_tables = torch.randperm(num_blocks, generator=gen).view(num_seqs, max_num_blocks)
    last = seq_lens - 1
    slot_mapping = block_tables[torch.arange(num_seqs), last // block_size] * block_size
    meta = AttentionMetadata(
        slot_mapping=slot_mapping + last % block_size,
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32),
        seq_lens=seq_lens.to(torch.int32),
        block_tables=block_tables.to(torch.int32),
        query_lens_cpu=[1] * num_seqs,
        seq_lens_cpu=seq_lens.tolist(),
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


def time_step(
    attention: Callable[..., torch.Tensor],
    layers: list[tuple[torch.Tensor, ...]],
    meta: AttentionMetadata,
    scale: float,
    num_steps: int,
) -> float:
    """Median milliseconds for one decode step (one attention call per layer)."""
    times = []
    for _ in range(num_steps + 2):
        start = time.perf_counter()
        for layer in layers:
            attention(*layer, meta, scale)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--num-layers", type=int, default=30)
    parser.add_argument("--num-steps", type=int, default=10)
    parser.add_argument(
        "--kv-cache-dtype", choices=("float32", "bfloat16", "float16"), default="float32"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not native.is_available():
        raise SystemExit("native kernels are unavailable; see the logged notice")

    heads, scale = (9, 3, 64), 64**-0.5  # SmolLM2-135M
    cache_dtype = getattr(torch, args.kv_cache_dtype)
    layers, meta = make_decode_step(
        args.num_seqs, args.context, heads, 16, args.num_layers, cache_dtype
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
        f"{args.num_layers} layers, {args.threads} threads, {args.kv_cache_dtype} cache"
    )
    print(f"native       {native_ms:8.2f} ms/step")
    print(f"torch gather {gather_ms:8.2f} ms/step")
    print(f"speedup      {gather_ms / native_ms:8.2f}x")


if __name__ == "__main__":
    main()
