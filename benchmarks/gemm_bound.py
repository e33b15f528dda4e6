"""GEMM bound: this machine's fp32 GEMM rate at decode shapes and the tok/s it allows SmolLM2,
at the fastest of the GEMMs the engine can choose (MKL, oneDNN, the native packed kernel).

python -m benchmarks.gemm_bound [--threads 2] [--batch 64] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from vbatch.layers.linear_choice import (
    available_backends,
    native_linear,
    onednn_linear,
    onednn_weight,
    prepared_weight,
)

# NOTE: SmolLM2-135M: hidden 576, 30 layers, 9 query / 3 KV heads of 64, MLP 1536, vocab 49152.
HIDDEN, NUM_LAYERS, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS = 576, 30, 64, 9, 3
INTERMEDIATE, VOCAB = 1536, 49152


def smollm2_layer_shapes() -> list[tuple[int, int]]:
    """(in, out) features of one decoder layer's linear layers, fused as vbatch has them."""
    qkv = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    return [
        (HIDDEN, qkv),
        (NUM_HEADS * HEAD_DIM, HIDDEN),
        (HIDDEN, 2 * INTERMEDIATE),
        (INTERMEDIATE, HIDDEN),
    ]


def flops_per_token() -> tuple[float, float]:
    """(FLOPs per token in the decoder layers' linear layers, FLOPs per token in the LM head)."""
    body = NUM_LAYERS * sum(2 * k * n for k, n in smollm2_layer_shapes())
    return float(body), float(2 * HIDDEN * VOCAB)


def gemm_candidates(m: int, k: int, n: int) -> dict[str, Callable[[], object]]:
    """x[m, k] @ w[n, k].T (an nn.Linear), fp32, by every GEMM the engine can choose on this
    machine: torch's (MKL), oneDNN from its reordered copy, and the native packed kernel where
    it is loaded (layers/linear_choice.py)."""
    x = torch.randn(m, k)
    w = torch.randn(n, k)
    out = torch.empty(m, n)
    reordered = onednn_weight(w)
    candidates: dict[str, Callable[[], object]] = {
        "torch": lambda: torch.nn.functional.linear(x, w, out=out),
        "onednn": lambda: onednn_linear(x, reordered),
    }
    if "native" in available_backends():
        packed = prepared_weight(w, "native")
        candidates["native"] = lambda: native_linear(x, packed, n)
    return candidates


def gemm_gflops(m: int, k: int, n: int, repeats: int, min_time_s: float = 0.2) -> float:
    """The fastest candidate's median GFLOP/s of x[m, k] @ w[n, k].T (gemm_candidates)."""
    best = 0.0
    for fn in gemm_candidates(m, k, n).values():
        fn()
        iters = 1
        while True:
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            if time.perf_counter() - start >= min_time_s / 4:
                break
            iters *= 2
        rates = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            rates.append(2 * m * k * n * iters / (time.perf_counter() - start) / 1e9)
        best = max(best, statistics.median(rates))
    return best


def model_gemm_rate(batch: int, repeats: int) -> tuple[float, float]:
    """(GFLOP/s over one token batch's decoder GEMMs, GFLOP/s of the LM head GEMM)."""
    shapes = smollm2_layer_shapes()
    seconds = sum(2 * batch * k * n / (gemm_gflops(batch, k, n, repeats) * 1e9) for k, n in shapes)
    body_rate = sum(2 * batch * k * n for k, n in shapes) / seconds / 1e9
    return body_rate, gemm_gflops(batch, HIDDEN, VOCAB, repeats)


def bound_tok_s(batch: int, repeats: int) -> dict[str, float]:
    """GEMM-only tokens/s: decode (every token samples) and prefill (one sample per prompt)."""
    body_flops, head_flops = flops_per_token()
    body_rate, head_rate = model_gemm_rate(batch, repeats)
    body_s = body_flops / (body_rate * 1e9)
    head_s = head_flops / (head_rate * 1e9)
    return {
        "body_gflops": body_rate,
        "head_gflops": head_rate,
        "decode_tok_s": 1.0 / (body_s + head_s),
        "prefill_tok_s": 1.0 / body_s,
        "blended_gflops": (body_flops + head_flops) / (body_s + head_s) / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    body_flops, head_flops = flops_per_token()
    print(
        f"SmolLM2-135M: {body_flops / 1e6:.0f} MFLOP/token in the layers, "
        f"{head_flops / 1e6:.0f} MFLOP in the LM head; threads={args.threads}"
    )
    for m, k, n in [(args.batch, HIDDEN, 1536), (args.batch, HIDDEN, VOCAB), (512, 576, 1536)]:
        rate = gemm_gflops(m, k, n, args.repeats)
        print(f"  fp32 GEMM [{m}x{k}]x[{k}x{n}]: {rate:.1f} GFLOP/s")
    b = bound_tok_s(args.batch, args.repeats)
    print(
        f"  decoder GEMMs at batch {args.batch}: {b['body_gflops']:.1f} GFLOP/s; "
        f"LM head: {b['head_gflops']:.1f} GFLOP/s"
    )
    print(
        f"GEMM-only bound at batch {args.batch}: decode {b['decode_tok_s']:.0f} tok/s, "
        f"prefill {b['prefill_tok_s']:.0f} tok/s"
    )


if __name__ == "__main__":
    main()
