"""The int8 greedy screen against the fp32 LM head: time per call, candidates, agreement.

Captures real final hidden states (SmolLM2 decoding the throughput workload greedily), then
times LlamaForCausalLM's fp32 chunked argmax and the screen through each of its exact int8 GEMMs
here (torch's `_int_mm` where it sums exactly, vbatch's own) on the same rows, alternating.

python -m benchmarks.greedy_screen [--num-prompts 32] [--max-tokens 32] [--threads 2]
    [--batches 1 64 128 256] [--repeats 7]

Under the AVX2 emulation: python -m benchmarks.emulate avx2 benchmarks.greedy_screen ...
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.workload import make_messages
from vbatch.client.tokenizer import TextTokenizer
from vbatch.config import EngineConfig
from vbatch.engine.core import EngineCore
from vbatch.layers.greedy_screen import MAX_CANDIDATES, Int8GreedyScreen, screen_gemms
from vbatch.models.loader import resolve_model
from vbatch.protocol import AddRequest, pack_token_ids
from vbatch.sampling_params import SamplingParams


def capture_hidden(core: EngineCore, num_prompts: int, max_tokens: int) -> torch.Tensor:
    """[num_rows, hidden] final hidden states of every greedy step of the workload."""
    tokenizer = TextTokenizer.from_dir(resolve_model(None).hf_dir)
    model = core.runner.model
    captured: list[torch.Tensor] = []
    greedy = model.greedy_token_ids

    def capturing(hidden: torch.Tensor) -> torch.Tensor:
        captured.append(hidden.clone())
        return greedy(hidden)

    model.greedy_token_ids = capturing
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for i, ids in enumerate(tokenizer.encode_chats(make_messages(num_prompts))):
        core.add_request(AddRequest(f"p{i}", pack_token_ids(ids), params))
    while core.has_unfinished():
        core.step()
    model.greedy_token_ids = greedy
    return torch.cat(captured)


def timed_ms(fn: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor) -> float:
    start = time.perf_counter()
    fn(hidden)
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 128, 256])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    core = EngineCore(EngineConfig(num_threads=args.threads, greedy_screen=True))
    model = core.runner.model
    if model.greedy_screen is None:
        raise SystemExit("the greedy screen is not available here (native kernels)")
    hidden = capture_hidden(core, args.num_prompts, args.max_tokens)
    fp32 = model._greedy_token_ids_fp32
    gemms = tuple(screen_gemms())
    screen = Int8GreedyScreen(model.lm_head_weight, gemms=gemms)
    with torch.inference_mode():
        expected = fp32(hidden)
        for gemm in gemms:
            _, counts = screen.screen(hidden, gemm=gemm)
            got = screen.argmax(hidden, fp32, gemm=gemm)
            settled = counts[counts >= 0].float()
            print(
                f"screen through {gemm}, {hidden.shape[0]} real rows: agreement with the fp32 "
                f"head {(got == expected).sum()}/{len(got)}; candidates per row median "
                f"{settled.median():.0f}, p90 {settled.quantile(0.9):.0f}, max "
                f"{settled.max():.0f}; rows over {MAX_CANDIDATES} (fp32 fallback): "
                f"{(counts < 0).sum()}"
            )
    print(
        f"{'batch':>5} {'fp32 head ms':>12}"
        + "".join(f" {g + ' ms':>10} {'speedup':>7}" for g in gemms)
    )
    for batch in args.batches:
        rows = (
            hidden[:batch]
            if batch <= len(hidden)
            else hidden.repeat(-(-batch // len(hidden)), 1)[:batch]
        )
        rows = rows.contiguous()
        fns = {"fp32": fp32} | {
            gemm: (lambda h, gemm=gemm: screen.argmax(h, fp32, gemm=gemm)) for gemm in gemms
        }
        times: dict[str, list[float]] = {name: [] for name in fns}
        with torch.inference_mode():
            for _ in range(2):
                for fn in fns.values():
                    fn(rows)
            for _ in range(args.repeats):
                for name, fn in fns.items():
                    times[name].append(timed_ms(fn, rows))
        ms = {name: statistics.median(t) for name, t in times.items()}
        line = f"{batch:>5} {ms['fp32']:>12.2f}"
        line += "".join(f" {ms[g]:>10.2f} {ms['fp32'] / ms[g]:>6.2f}x" for g in gemms)
        print(line, flush=True)


if __name__ == "__main__":
    main()
