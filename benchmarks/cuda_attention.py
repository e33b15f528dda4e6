"""Decode attention on CUDA: vbatch's paged-attention op over one decode step of SmolLM2-135M's
heads (9 query heads, 3 KV heads, head_dim 64) in bfloat16, timed with CUDA events, with its
output checked against float32 attention over the same gathered K/V.

Prints microseconds per layer, the K/V bytes a layer reads, and the rate that makes.

python -m benchmarks.cuda_attention [--num-seqs 256] [--context 200] [--num-layers 30]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.attention_kernels import make_decode_step
from vbatch.layers import native

HEADS = (9, 3, 64)
BLOCK_SIZE = 16


def reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: list[int],
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Float32 attention of each decode row over its gathered context."""
    num_heads, num_kv_heads, head_dim = HEADS
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for row, seq_len in enumerate(seq_lens):
        positions = torch.arange(seq_len, device=q.device)
        slots = block_tables[row, positions // BLOCK_SIZE].long() * BLOCK_SIZE
        slots += positions % BLOCK_SIZE
        keys = k_cache.view(-1, num_kv_heads, head_dim)[slots].float().repeat_interleave(group, 1)
        values = v_cache.view(-1, num_kv_heads, head_dim)[slots].float()
        values = values.repeat_interleave(group, 1)
        scores = torch.einsum("hd,thd->ht", q[row].float(), keys) * scale
        out[row] = torch.einsum("ht,thd->hd", scores.softmax(-1), values)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--num-layers", type=int, default=30)
    parser.add_argument("--num-steps", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    if not native.is_available():
        raise SystemExit("native kernels are unavailable; see the logged notice")
    device = torch.device("cuda")
    layers, meta = make_decode_step(
        args.num_seqs, args.context, HEADS, BLOCK_SIZE, args.num_layers, torch.bfloat16
    )
    on_device = [
        (q.to(device, torch.bfloat16), k_cache.to(device), v_cache.to(device))
        for q, _, _, k_cache, v_cache in layers
    ]
    query_start_loc = meta.query_start_loc.to(device)
    seq_lens = meta.seq_lens.to(device)
    block_tables = meta.block_tables.to(device)
    scale = HEADS[2] ** -0.5

    def step() -> list[torch.Tensor]:
        return [
            torch.ops.vbatch.paged_attention(
                q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, 0, 0.0, None
            )
            for q, k_cache, v_cache in on_device
        ]

    outputs = step()
    q, k_cache, v_cache = on_device[0]
    expected = reference(q, k_cache, v_cache, meta.seq_lens.tolist(), block_tables, scale)
    max_error = (outputs[0].float() - expected).abs().max().item()
    times_ms = []
    for _ in range(args.num_steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times_ms.append(start.elapsed_time(end))
    per_layer_us = statistics.median(times_ms) * 1e3 / args.num_layers
    num_heads, num_kv_heads, head_dim = HEADS
    # NOTE: a position's K and V rows of its KV heads, in bfloat16.
    position_bytes = 2 * num_kv_heads * head_dim * torch.bfloat16.itemsize
    layer_bytes = int(meta.seq_lens.sum()) * position_bytes
    print(
        f"{torch.cuda.get_device_name()}: {args.num_seqs} decode rows x ~{args.context} tokens, "
        f"H={num_heads} KVH={num_kv_heads} D={head_dim}, bfloat16, {args.num_layers} layers"
    )
    print(
        f"paged attention: {per_layer_us:.1f} us a layer (median of {args.num_steps} steps), "
        f"{layer_bytes / 1e6:.1f} MB of K/V a layer read at {layer_bytes / per_layer_us / 1e3:.0f} "
        f"GB/s; max |out - float32 reference| {max_error:.2e}"
    )


if __name__ == "__main__":
    main()
