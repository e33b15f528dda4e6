"""Sampler cost: milliseconds per call at a decode-sized batch (target: a few ms on 2 threads).

    python benchmarks/sampler_cost.py [--batch 64] [--threads 2] [--logits PATH] [--only NAME]

`--logits` takes a torch.save'd [rows, vocab] tensor of real model logits, tiled to the batch.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vbatch.engine.sampler import Sampler
from vbatch.engine.sampling_metadata import SamplingMetadata
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


def lm_like_logits(batch: int, vocab: int) -> torch.Tensor:
    """Rows shaped like SmolLM2's at temperature 1: for top-p 0.9 the nucleus has a median of
    about 50 tokens, exceeds 128 in about 30% of rows and 1024 in about 2%."""
    z = torch.randn(batch, vocab)
    scale = torch.empty(batch, 1).uniform_(0.65, 1.1)
    return scale * (3.7 * z + 0.3 * z.clamp(min=0) ** 2)


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
    parser.add_argument("--only", type=str, default="", help="run cases whose name has this")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shapes = {
        "lm-like": lm_like_logits(args.batch, args.vocab),
        "flat": torch.randn(args.batch, args.vocab),
    }
    if args.logits:
        real = torch.load(args.logits).float()
        shapes["real"] = real[torch.arange(args.batch) % real.shape[0]].contiguous()
    print(f"batch {args.batch}, vocab {args.vocab}, {args.threads} threads; ms per call")
    for name, params in CASES.items():
        if args.only not in name:
            continue
        for shape, logits in shapes.items():
            build, median, best = time_case(params, logits, 100, args.reps)
            print(
                f"{name:30s} {shape:8s} build {build:6.2f}  sample {median:6.2f} (min {best:.2f})"
            )


if __name__ == "__main__":
    main()
