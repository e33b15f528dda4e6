"""Sampler cost: milliseconds per call at a decode-sized batch (target: a few ms on 2 threads).

python benchmarks/sampler_cost.py [--batch 64] [--vocab 49152] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vbatch.engine.sampler import Sampler, SamplingMetadata
from vbatch.engine.sequence import Sequence
from vbatch.sampling_params import SamplingParams

CASES = {
    "top_p=0.9,top_k=50": SamplingParams(top_p=0.9, top_k=50),
    "greedy": SamplingParams(temperature=0.0),
    "temperature=1 (full vocab)": SamplingParams(),
    "top_p=0.9": SamplingParams(top_p=0.9),
    "min_p=0.05": SamplingParams(min_p=0.05),
    "top_p=0.9,top_k=50,seeded": SamplingParams(top_p=0.9, top_k=50, seed=0),
    "top_p=0.9,top_k=50,penalties": SamplingParams(
        top_p=0.9, top_k=50, repetition_penalty=1.1, frequency_penalty=0.3
    ),
    "top_p=0.9,top_k=50,logprobs=5": SamplingParams(top_p=0.9, top_k=50, logprobs=5),
}


def peaked_logits(batch: int, vocab: int) -> torch.Tensor:
    """LM-like rows: a Gaussian bulk plus a few tokens far above it."""
    logits = torch.randn(batch, vocab) * 2.0
    logits[:, :20] += torch.linspace(12.0, 4.0, 20)
    return logits[:, torch.randperm(vocab)]


def time_case(
    params: SamplingParams, logits: torch.Tensor, num_output_tokens: int, reps: int
) -> tuple[float, float, float]:
    """Median milliseconds of a metadata build, and median and min of one sampler call."""
    seqs = [Sequence(str(i), list(range(200)), params, index=i) for i in range(logits.shape[0])]
    for seq in seqs:
        for t in torch.randint(0, logits.shape[1], (num_output_tokens,)).tolist():
            seq.append_token(t)
    sampler, generators = Sampler(), {}
    build_ms, sample_ms = [], []
    for _ in range(reps):
        start = time.perf_counter()
        meta = SamplingMetadata.build(seqs, torch.device("cpu"), logits.shape[1], generators)
        mid = time.perf_counter()
        sampler(logits, meta)
        end = time.perf_counter()
        build_ms.append((mid - start) * 1e3)
        sample_ms.append((end - mid) * 1e3)
    return statistics.median(build_ms), statistics.median(sample_ms), min(sample_ms)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--logits", type=str, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shapes = {
        "peaked": peaked_logits(args.batch, args.vocab),
        "gaussian": torch.randn(args.batch, args.vocab) * 2.0,
    }
    if args.logits:
        real = torch.load(args.logits).float()
        shapes["real"] = real[torch.arange(args.batch) % real.shape[0]].contiguous()
    print(f"batch {args.batch}, vocab {args.vocab}, {args.threads} threads; ms per call")
    for name, params in CASES.items():
        for shape, logits in shapes.items():
            build, median, best = time_case(params, logits, 100, args.reps)
            print(
                f"{name:30s} {shape:8s} build {build:6.2f}  sample {median:6.2f} (min {best:.2f})"
            )


if __name__ == "__main__":
    main()
