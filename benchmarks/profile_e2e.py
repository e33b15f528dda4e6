"""Where an end-to-end run's time goes: the e2e workload on an in-process EngineCore, each step
timed by category (the layers' GEMMs, the LM head, attention, sampling, other), split into steps
that still prefill and pure decode steps; the decode steps again by how many sequences they ran,
with their GEMM and LM head time per token against what `benchmarks.e2e`'s tighter bound charges
(every output token at the 64-row GEMM rate), so that the cost of a batch that shrinks as
sequences finish shows.

`benchmarks.e2e` times the CLI as a user sees it; this runs the same tokenized chat prompts
through one EngineCore (no client, no subprocess), so its total is the engine's share of that
wall time and the rest is start-up and the client.

python -m benchmarks.profile_e2e [--num-prompts 64] [--max-tokens 128] [--threads 2]
    [--linear-backend auto|torch|onednn|native] [--quantization int8]
Under the AVX2 emulation: python -m benchmarks.emulate avx2 benchmarks.profile_e2e ...
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict

import torch

from benchmarks.e2e import hf_prompts
from benchmarks.gemm_bound import flops_per_token, model_gemm_rate
from benchmarks.profile_step import StepTimers
from vbatch.config import EngineConfig
from vbatch.engine.core import EngineCore
from vbatch.protocol import AddRequest, pack_token_ids
from vbatch.sampling_params import SamplingParams

PHASES = ("prefill", "decode")
TIMED = ("gemm", "head", "attention", "sampling")
# NOTE: decode steps are reported by the number of sequences they ran, in these bands.
BATCH_BANDS = ((1, 15), (16, 31), (32, 47), (48, 63), (64, 1 << 30))


def is_prefilling(core: EngineCore) -> bool:
    """Whether any request still has prompt tokens to compute (the next step prefills)."""
    return any(
        seq.num_computed_tokens < seq.num_prompt_tokens
        for seqs in core.requests.values()
        for seq in seqs
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--linear-backend", choices=("auto", "torch", "onednn", "native"), default="auto"
    )
    parser.add_argument("--quantization", default=None, help="e.g. int8")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    _, prompts = hf_prompts(args.num_prompts)
    start = time.perf_counter()
    core = EngineCore(
        EngineConfig(
            num_threads=args.threads,
            linear_backend=args.linear_backend,
            quantization=args.quantization,
        )
    )
    init_s = time.perf_counter() - start
    timers = StepTimers(head_category="head")
    timers.install(core)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for i, ids in enumerate(prompts):
        core.add_request(AddRequest(f"r{i}", pack_token_ids(ids), params))
    phases: dict[str, dict[str, float]] = {name: defaultdict(float) for name in PHASES}
    decode_steps: list[float] = []
    # (rows, step seconds, layers' GEMM seconds, LM head seconds) per decode step
    decode_rows: list[tuple[int, float, float, float]] = []
    while core.requests:
        phase = phases["prefill" if is_prefilling(core) else "decode"]
        before = dict(timers.seconds)
        step_start = time.perf_counter()
        out = core.step()
        step_s = time.perf_counter() - step_start
        phase["steps"] += 1
        phase["total"] += step_s
        for category in TIMED:
            phase[category] += timers.seconds[category] - before.get(category, 0.0)
        if phase is phases["decode"]:
            decode_steps.append(step_s)
            gemm_s, head_s = (timers.seconds[c] - before.get(c, 0.0) for c in ("gemm", "head"))
            decode_rows.append((len(out.token_ids), step_s, gemm_s, head_s))
    print(
        f"{args.num_prompts} chat prompts, max_tokens={args.max_tokens}, greedy, "
        f"threads={args.threads}, {torch.backends.cpu.get_cpu_capability()}, "
        f"load {os.getloadavg()[0]:.2f}; EngineCore built in {init_s:.2f} s"
    )
    print("| phase | steps | s | layers' GEMM s | LM head s | attention s | sampling s | other s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, phase in phases.items():
        other = phase["total"] - sum(phase[c] for c in TIMED)
        print(
            f"| {name} | {phase['steps']:.0f} | {phase['total']:.2f} | {phase['gemm']:.2f} | "
            f"{phase['head']:.2f} | {phase['attention']:.2f} | {phase['sampling']:.2f} | "
            f"{other:.2f} |"
        )
    if decode_steps:
        print(f"decode step: median {statistics.median(decode_steps) * 1e3:.1f} ms")
        print_batch_bands(decode_rows)


def print_batch_bands(decode_rows: list[tuple[int, float, float, float]]) -> None:
    """The decode steps by batch band: their time, their layers' GEMM and LM head time, and the
    tighter bound's charge for their tokens (each at the 64-row rate, measured here)."""
    body_flops, head_flops = flops_per_token()
    body_rate, head_rate = model_gemm_rate(64, repeats=5)
    body_ms, head_ms = body_flops / body_rate / 1e6, head_flops / head_rate / 1e6
    print(
        f"decode steps by batch; the bound charges {body_ms:.2f} ms per token for the layers "
        f"and {head_ms:.2f} ms for the LM head ({body_rate:.0f}/{head_rate:.0f} GFLOP/s at 64 rows)"
    )
    print("| sequences | steps | tokens | s | layers' GEMM ms/token | LM head ms/token |")
    print("|---|---|---|---|---|---|")
    for low, high in BATCH_BANDS:
        band = [r for r in decode_rows if low <= r[0] <= high]
        if not band:
            continue
        tokens = sum(r[0] for r in band)
        print(
            f"| {low}-{min(high, max(r[0] for r in band))} | {len(band)} | {tokens} | "
            f"{sum(r[1] for r in band):.2f} | {sum(r[2] for r in band) / tokens * 1e3:.2f} | "
            f"{sum(r[3] for r in band) / tokens * 1e3:.2f} |"
        )


if __name__ == "__main__":
    main()
