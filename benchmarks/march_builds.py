"""vbatch's native kernels built for each `-march`, timed side by side on this CPU.

A user's machine builds csrc/ with `-march=native`, which GCC reads as that CPU's own target
(znver3 on a Zen 3, skylake on an Intel core, ...), each with its own tuning; the AVX2 emulation
builds it for `haswell`. This builds it for each target asked for (every one must run on this
CPU), times the same kernels in a fresh process per build, in interleaved rounds, and prints each
build's best time and its ratio to the fastest build: a build-dependent slowdown shows as a ratio
well above 1.

python -m benchmarks.march_builds [--marches native,haswell,znver3,x86-64-v3] [--rounds 2]
    [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

import torch

# NOTE: SmolLM2-135M's shapes.
HIDDEN, QKV, INTERMEDIATE, VOCAB, NUM_LAYERS = 576, 960, 1536, 49152, 30
LAYER_ROWS = (1, 16, 43, 64, 512)
HEAD_CHUNK = 3072


def best_ms(fn: Callable[[], object], calls: int) -> float:
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def time_kernels(threads: int) -> dict[str, float]:
    """ms per call of each kernel, the best of several calls, with this process's build."""
    from benchmarks.attention_kernels import make_decode_step
    from vbatch.layers import native

    if not native.is_available():
        sys.exit("the native kernels did not build")
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    ops = torch.ops.vbatch
    times = {}
    # NOTE: one weight set per layer, so the weights stream from memory as in a decode step.
    layers = [
        (
            ops.pack_linear_weight(torch.randn(QKV, HIDDEN) * 0.05),
            ops.pack_linear_weight(torch.randn(HIDDEN, HIDDEN) * 0.05),
            ops.pack_swiglu_weight(torch.randn(2 * INTERMEDIATE, HIDDEN) * 0.05),
            ops.pack_linear_weight(torch.randn(HIDDEN, INTERMEDIATE) * 0.05),
        )
        for _ in range(NUM_LAYERS)
    ]
    for rows in LAYER_ROWS:
        x, act = torch.randn(rows, HIDDEN), torch.randn(rows, INTERMEDIATE)

        def stack(x: torch.Tensor = x, act: torch.Tensor = act) -> None:
            for qkv, o, gate_up, down in layers:
                ops.packed_linear(x, qkv, QKV, None)
                ops.packed_linear(x, o, HIDDEN, None)
                ops.packed_swiglu(x, gate_up, INTERMEDIATE, None)
                ops.packed_linear(act, down, HIDDEN, None)

        times[f"layers, {rows} rows"] = best_ms(stack, 5 if rows < 512 else 3)
    head = torch.randn(VOCAB, HIDDEN) * 0.05
    chunks = [ops.pack_linear_weight(head[s : s + HEAD_CHUNK]) for s in range(0, VOCAB, HEAD_CHUNK)]
    hidden = torch.randn(64, HIDDEN)
    times["greedy head, 64 rows"] = best_ms(
        lambda: ops.packed_head_argmax(hidden, chunks, HEAD_CHUNK, VOCAB), 9
    )
    int8 = ops.pack_int8_weight(torch.randint(-127, 128, (2 * INTERMEDIATE, HIDDEN)).to(torch.int8))
    a = torch.randint(-127, 128, (64, HIDDEN)).to(torch.int8)
    times["int8 GEMM, 64 rows"] = best_ms(lambda: ops.int8_packed_mm(a, int8, 2 * INTERMEDIATE), 9)
    steps, meta = make_decode_step(64, 240, (9, 3, 64), 16, NUM_LAYERS)

    def attention() -> None:
        for q, _, _, k_cache, v_cache in steps:
            ops.paged_attention(
                q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.125
            )

    times["decode attention, 64 x 240"] = best_ms(attention, 7)
    gate, up = torch.randn(64, INTERMEDIATE), torch.randn(64, INTERMEDIATE)
    times["silu_mul, 64 x 1536"] = best_ms(lambda: ops.silu_mul(gate, up), 21)
    times["torch silu(gate) * up, 64 x 1536 (the peer)"] = best_ms(
        lambda: torch.nn.functional.silu(gate) * up, 21
    )
    times["gelu_erf_, 64 x 1536 (with a copy)"] = best_ms(lambda: ops.gelu_erf_(gate.clone()), 21)
    return times


def run_build(march: str, threads: int) -> dict[str, float]:
    """One build's timings, from a fresh process (each build registers the same ops)."""
    from vbatch.layers.native import MARCH_ENV

    env = dict(os.environ, **{MARCH_ENV: "" if march == "native" else march})
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.march_builds", "--child", "--threads", str(threads)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--marches", default="native,haswell,znver3,x86-64-v3")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(time_kernels(args.threads)))
        return
    marches = args.marches.split(",")
    best: dict[str, dict[str, float]] = {m: {} for m in marches}
    for round_index in range(args.rounds):
        for march in marches:
            for kernel, ms in run_build(march, args.threads).items():
                best[march][kernel] = min(ms, best[march].get(kernel, float("inf")))
            print(f"[round {round_index + 1}] {march} timed", flush=True)
    kernels = list(best[marches[0]])
    print(f"best of {args.rounds} rounds, {args.threads} threads, ms (x the fastest build):")
    width = max(len(m) for m in marches) + 2
    for kernel in kernels:
        fastest = min(best[m][kernel] for m in marches)
        cells = "  ".join(
            f"{m:>{width}} {best[m][kernel]:8.2f} ({best[m][kernel] / fastest:.2f}x)"
            for m in marches
        )
        print(f"{kernel:<28}{cells}")


if __name__ == "__main__":
    main()
