"""Where an end-to-end run's time goes: the e2e workload on an in-process EngineCore, each step
timed by category (GEMM, attention, sampling, other), split into steps that still prefill and
pure decode steps.

`benchmarks.e2e` times the CLI as a user sees it; this runs the same tokenized chat prompts
through one EngineCore (no client, no subprocess), so its total is the engine's share of that
wall time and the rest is start-up and the client.

python -m benchmarks.profile_e2e [--num-prompts 64] [--max-tokens 128] [--threads 2]
    [--linear-backend auto|torch|onednn|native]
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
from benchmarks.profile_step import CATEGORIES, StepTimers
from vbatch.config import EngineConfig
from vbatch.engine.core import EngineCore
from vbatch.protocol import AddRequest, pack_token_ids
from vbatch.sampling_params import SamplingParams

PHASES = ("prefill", "decode")


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
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    _, prompts = hf_prompts(args.num_prompts)
    start = time.perf_counter()
    core = EngineCore(EngineConfig(num_threads=args.threads, linear_backend=args.linear_backend))
    init_s = time.perf_counter() - start
    timers = StepTimers()
    timers.install(core)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for i, ids in enumerate(prompts):
        core.add_request(AddRequest(f"r{i}", pack_token_ids(ids), params))
    phases: dict[str, dict[str, float]] = {name: defaultdict(float) for name in PHASES}
    decode_steps: list[float] = []
    while core.requests:
        phase = phases["prefill" if is_prefilling(core) else "decode"]
        before = dict(timers.seconds)
        step_start = time.perf_counter()
        core.step()
        step_s = time.perf_counter() - step_start
        phase["steps"] += 1
        phase["total"] += step_s
        for category in CATEGORIES[:-1]:
            phase[category] += timers.seconds[category] - before.get(category, 0.0)
        if phase is phases["decode"]:
            decode_steps.append(step_s)
    print(
        f"{args.num_prompts} chat prompts, max_tokens={args.max_tokens}, greedy, "
        f"threads={args.threads}, {torch.backends.cpu.get_cpu_capability()}, "
        f"load {os.getloadavg()[0]:.2f}; EngineCore built in {init_s:.2f} s"
    )
    print("| phase | steps | s | GEMM s | attention s | sampling s | other s |")
    print("|---|---|---|---|---|---|---|")
    for name, phase in phases.items():
        other = phase["total"] - sum(phase[c] for c in CATEGORIES[:-1])
        print(
            f"| {name} | {phase['steps']:.0f} | {phase['total']:.2f} | {phase['gemm']:.2f} | "
            f"{phase['attention']:.2f} | {phase['sampling']:.2f} | {other:.2f} |"
        )
    if decode_steps:
        print(f"decode step: median {statistics.median(decode_steps) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
