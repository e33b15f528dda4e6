"""Per-step profile of a decode step: GEMM, attention, sampling and the rest, per attention backend.

Builds a decode batch (default 64 seqs at context ~300) on an EngineCore without running the
prefill (the KV cache content does not change the cost), then times core.step() with hooks on
every nn.Linear, the LM head, the attention backend and the sampler.

python -m benchmarks.profile_step [--batch 64] [--context 300] [--steps 10] [--threads 2]
    [--backends torch,native] [--greedy] [--kv-cache-dtype auto|float32|bfloat16|float16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.gemm_bound import flops_per_token, model_gemm_rate
from vbatch.config import KV_CACHE_DTYPES, EngineConfig
from vbatch.engine.core import EngineCore
from vbatch.layers.linear_choice import ChosenLinear
from vbatch.layers.quantization import Int8DynamicLinear
from vbatch.models.llama import LlamaMLP
from vbatch.protocol import AddRequest, pack_token_ids
from vbatch.sampling_params import SamplingParams

CATEGORIES = ("gemm", "attention", "sampling", "other")


class StepTimers:
    """Accumulates seconds per category while installed on an EngineCore's runner; the LM head
    (logits, or greedy decoding's argmax) counts as `head_category`."""

    def __init__(self, head_category: str = "gemm") -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.head_category = head_category

    def timed(self, category: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[category] += time.perf_counter() - start

        return wrapper

    def install(self, core: EngineCore) -> None:
        runner = core.runner
        for module in runner.model.modules():
            if isinstance(module, torch.nn.Linear | Int8DynamicLinear):
                module.forward = self.timed("gemm", module.forward)
                if isinstance(module, ChosenLinear | Int8DynamicLinear):
                    # NOTE: a SwiGLU packing's fused activation (vbatch::packed_swiglu,
                    # vbatch::int8_linear).
                    module.swiglu = self.timed("gemm", module.swiglu)
            elif isinstance(module, LlamaMLP):
                # NOTE: its two GEMMs as W @ x^T bypass Linear.forward; SiLU-and-mul rides along.
                module._forward_transposed = self.timed("gemm", module._forward_transposed)
        head = self.head_category
        runner.model.compute_logits = self.timed(head, runner.model.compute_logits)
        runner.model.greedy_token_ids = self.timed(head, runner.model.greedy_token_ids)
        backend = runner.attn_backend
        backend.forward = self.timed("attention", backend.forward)
        runner.sampling_metadata = self.timed("sampling", runner.sampling_metadata)
        runner.sampler = self.timed("sampling", runner.sampler)


def build_decode_batch(core: EngineCore, batch: int, context: int, params: SamplingParams) -> None:
    """Admit `batch` random prompts and mark their prefill done without computing it.

    The KV cache is filled with random values first: an untouched (torch.empty) cache maps every
    page to the kernel's zero page, which sits in cache and makes attention look several times
    cheaper than over real K/V.
    """
    gen = torch.Generator().manual_seed(0)
    for k_cache, v_cache in core.runner.kv_caches:
        k_cache.normal_(generator=gen)
        v_cache.normal_(generator=gen)
    vocab = core.model_config.vocab_size
    for i in range(batch):
        ids = torch.randint(0, vocab, (context,), generator=gen).tolist()
        core.add_request(AddRequest(f"p{i}", pack_token_ids(ids), params))
    scheduler = core.scheduler
    while any(
        seq.num_computed_tokens < seq.num_prompt_tokens
        for seqs in core.requests.values()
        for seq in seqs
    ):
        out = scheduler.schedule()
        scheduler.update(out, [0] * sum(out.sampling_mask))


def profile_backend(args: argparse.Namespace, backend: str) -> dict[str, float]:
    config = EngineConfig(
        model=args.model,
        max_num_seqs=args.batch,
        max_num_batched_tokens=max(2048, args.batch),
        attention_backend=backend,
        enable_prefix_caching=False,
        num_threads=args.threads,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    core = EngineCore(config)
    if args.greedy:
        params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    else:
        params = SamplingParams(
            temperature=0.8, top_p=0.9, top_k=50, max_tokens=10_000, ignore_eos=True
        )
    build_decode_batch(core, args.batch, args.context, params)
    for _ in range(2):
        core.step()
    timers = StepTimers()
    timers.install(core)
    step_times = []
    per_step: list[dict[str, float]] = []
    for _ in range(args.steps):
        before = dict(timers.seconds)
        start = time.perf_counter()
        out = core.step()
        step_times.append(time.perf_counter() - start)
        assert len(out.token_ids) == args.batch, "every seq decodes one token per step"
        per_step.append({k: timers.seconds[k] - before.get(k, 0.0) for k in timers.seconds})
    result = {
        "backend": core.runner.attn_backend.name,
        "step_ms": statistics.median(step_times) * 1e3,
    }
    for category in CATEGORIES[:-1]:
        result[category] = statistics.median(s.get(category, 0.0) for s in per_step) * 1e3
    result["other"] = result["step_ms"] - sum(result[c] for c in CATEGORIES[:-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--backends", default="torch,native")
    parser.add_argument("--greedy", action="store_true")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    body_flops, head_flops = flops_per_token()
    # NOTE: the GEMM rate moves by 10-20% between moments on this shared machine; it is measured
    # before and after the steps and the faster figure is used, which gives the lower ratio.
    rates = [model_gemm_rate(args.batch, repeats=5)]
    results = [profile_backend(args, backend) for backend in args.backends.split(",")]
    rates.append(model_gemm_rate(args.batch, repeats=5))
    gemm_ms = min(
        args.batch * (body_flops / body + head_flops / head) / 1e6 for body, head in rates
    )
    print(
        f"decode step, batch {args.batch}, context ~{args.context}, threads {args.threads}, "
        f"{'greedy' if args.greedy else 'top-k 50 / top-p 0.9'}, {args.kv_cache_dtype} KV cache; "
        f"measured GEMM rates (layers/LM head) "
        f"{', '.join(f'{body:.0f}/{head:.0f}' for body, head in rates)} GFLOP/s -> "
        f"GEMM-only step {gemm_ms:.1f} ms"
    )
    print(
        "| attention | step ms | GEMM ms | attention ms | sampling ms | other ms | "
        "GEMM share | decode tok/s | GEMM-bound ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['backend']} | {r['step_ms']:.1f} | {r['gemm']:.1f} | {r['attention']:.1f} | "
            f"{r['sampling']:.2f} | {r['other']:.1f} | {r['gemm'] / r['step_ms']:.0%} | "
            f"{args.batch / r['step_ms'] * 1e3:.0f} | {gemm_ms / r['step_ms']:.0%} |"
        )


if __name__ == "__main__":
    main()
