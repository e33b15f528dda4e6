"""End to end: `vbatch run` (the CLI, in a subprocess) against HF `generate` and the GEMM bound.

Writes the throughput workload to JSONL, times `vbatch run IN -o OUT --max-tokens N
--temperature 0`, then HF `generate` at each batch size asked for (its best one is the baseline),
and prints vbatch/HF and bound/achieved wall time, where the bound is the sum over requests of
(prompt + output tokens) x FLOPs/token divided by the GEMM rate (and a tighter one: prompt
tokens without the LM head, at the 512-row prefill GEMM rate). The rates are measured right
before each round, since a shared host's speed moves between minutes; each round's wall is
divided by its own bounds, and the ratios' medians are printed.

python -m benchmarks.e2e [--num-prompts 128] [--max-tokens 128] [--threads 2]
    [--hf-batch-sizes 32,64] [--repeats 1] [--skip-hf] [--show-progress] [--quantization int8]
    [--greedy-screen auto|on|off] [--batch-invariant] [--linear-backend auto|torch|onednn|native]
    [--kv-cache-dtype auto|float32|bfloat16|float16]

Under the AVX2 emulation: python -m benchmarks.emulate avx2 benchmarks.e2e ...
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.gemm_bound import flops_per_token, model_gemm_rate
from benchmarks.throughput import run_hf
from benchmarks.workload import chat_token_ids, write_jsonl


def run_cli(in_path: Path, out_path: Path, args: argparse.Namespace) -> dict[str, float]:
    """Time one `vbatch run`; token counts come from the output rows' usage fields."""
    cmd = [
        sys.executable, "-m", "vbatch", "run", str(in_path), "-o", str(out_path),
        "--max-tokens", str(args.max_tokens), "--temperature", "0",
        "--num-threads", str(args.threads), "--overwrite",
    ]  # fmt: skip
    if args.quantization:
        cmd += ["--quantization", args.quantization]
    if args.greedy_screen != "auto":
        cmd.append("--greedy-screen" if args.greedy_screen == "on" else "--no-greedy-screen")
    if args.batch_invariant:
        cmd.append("--batch-invariant")
    if args.linear_backend:
        cmd += ["--linear-backend", args.linear_backend]
    if args.kv_cache_dtype:
        cmd += ["--kv-cache-dtype", args.kv_cache_dtype]
    if not args.show_progress:
        cmd.append("--quiet")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    start = time.perf_counter()
    subprocess.run(
        cmd, check=True, env=env, stdout=None if args.show_progress else subprocess.DEVNULL
    )
    wall = time.perf_counter() - start
    prompt_tokens = output_tokens = 0
    with open(out_path) as f:
        for line in f:
            row = json.loads(line)
            prompt_tokens += row["prompt_tokens"]
            output_tokens += row["completion_tokens"]
    return {"wall_s": wall, "prompt_tokens": prompt_tokens, "output_tokens": output_tokens}


def gemm_bounds(
    ours: dict[str, float],
    rates: tuple[float, float, float],
    body_flops: float,
    head_flops: float,
) -> tuple[float, float]:
    """(GEMM bound, tighter bound) in seconds for a run's token counts at `rates` (GFLOP/s of
    the layers at 64 rows, the LM head at 64 rows, the layers at 512 rows)."""
    body_rate, head_rate, prefill_rate = rates
    gemm_gflops = (body_flops + head_flops) / (body_flops / body_rate + head_flops / head_rate)
    num_tokens = ours["prompt_tokens"] + ours["output_tokens"]
    bound_s = num_tokens * (body_flops + head_flops) / (gemm_gflops * 1e9)
    # NOTE: tighter: prompt tokens skip the LM head and run as 512-row GEMMs, outputs at batch 64.
    tight_s = (
        ours["prompt_tokens"] * body_flops / prefill_rate
        + ours["output_tokens"] * (body_flops / body_rate + head_flops / head_rate)
    ) / 1e9
    return bound_s, tight_s


def hf_prompts(num_prompts: int) -> tuple[str, list[list[int]]]:
    from vbatch.models.loader import resolve_model

    hf_dir = str(resolve_model(None).hf_dir)
    return hf_dir, chat_token_ids(hf_dir, num_prompts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--hf-batch-sizes", default="32,64")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved rounds; medians")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--show-progress", action="store_true")
    parser.add_argument("--quantization", default=None, help="e.g. int8 (the bound stays fp32)")
    parser.add_argument(
        "--batch-invariant", action="store_true", help="vbatch's batch-invariant mode"
    )
    parser.add_argument(
        "--linear-backend",
        choices=("auto", "torch", "onednn", "native"),
        default=None,
        help="vbatch's GEMM library for float32 linears (default: its own, auto)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default=None,
        help="vbatch's KV cache dtype (default: its own, auto)",
    )
    parser.add_argument(
        "--greedy-screen",
        choices=("auto", "on", "off"),
        default="auto",
        help="force the int8 screen on or off (off: the fp32 LM head); auto: vbatch's choice",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    body_flops, head_flops = flops_per_token()
    print(
        f"workload: {args.num_prompts} chat prompts, max_tokens={args.max_tokens}, greedy, "
        f"threads={args.threads}"
    )
    batch_sizes = [] if args.skip_hf else [int(x) for x in args.hf_batch_sizes.split(",")]
    hf_dir, prompts = hf_prompts(args.num_prompts) if batch_sizes else ("", [])
    walls: list[float] = []
    bounds: list[tuple[float, float]] = []
    hf_rates: dict[int, list[float]] = {b: [] for b in batch_sizes}
    ours: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        in_path = write_jsonl(Path(tmp) / "workload.jsonl", args.num_prompts)
        for round_index in range(args.repeats):
            rates = (*model_gemm_rate(64, repeats=5), model_gemm_rate(512, repeats=5)[0])
            ours = run_cli(in_path, Path(tmp) / "out.jsonl", args)
            walls.append(ours["wall_s"])
            bounds.append(gemm_bounds(ours, rates, body_flops, head_flops))
            print(
                f"[round {round_index + 1}] vbatch run: {ours['wall_s']:.1f} s, "
                f"{ours['output_tokens'] / ours['wall_s']:.1f} output tok/s; GEMM rates "
                f"{rates[0]:.0f}/{rates[1]:.0f}/{rates[2]:.0f} GFLOP/s (layers at 64 rows, LM "
                f"head, layers at 512 rows): bound {bounds[-1][0]:.1f} s, tighter "
                f"{bounds[-1][1]:.1f} s",
                flush=True,
            )
            for batch_size in batch_sizes:
                hf = run_hf(hf_dir, prompts, args.max_tokens, batch_size)
                hf_rates[batch_size].append(hf["output_tok_s"])
                print(
                    f"[round {round_index + 1}] HF generate (batch {batch_size}): "
                    f"{hf['output_tok_s']:.1f} output tok/s, {hf['wall_s']:.1f} s",
                    flush=True,
                )
    wall = statistics.median(walls)
    bound_s = statistics.median(b[0] for b in bounds)
    tight_s = statistics.median(b[1] for b in bounds)
    ratio = statistics.median(w / b[0] for w, b in zip(walls, bounds, strict=True))
    tight_ratio = statistics.median(w / b[1] for w, b in zip(walls, bounds, strict=True))
    ours_tok_s = ours["output_tokens"] / wall
    print(
        f"vbatch run (median of {args.repeats}): {wall:.1f} s, {ours['prompt_tokens']} prompt + "
        f"{ours['output_tokens']} output tokens, {ours_tok_s:.1f} output tok/s; "
        f"GEMM bound {bound_s:.1f} s, wall/bound = {ratio:.2f} "
        f"(tighter bound {tight_s:.1f} s, wall/tighter = {tight_ratio:.2f}; medians over rounds "
        "of each round's wall over its own bounds)"
    )
    if not batch_sizes:
        return
    best_batch = max(batch_sizes, key=lambda b: statistics.median(hf_rates[b]))
    best = statistics.median(hf_rates[best_batch])
    print(
        f"HF generate best batch {best_batch}: median {best:.1f} output tok/s; "
        f"vbatch/HF = {ours_tok_s / best:.2f}x"
    )


if __name__ == "__main__":
    main()
