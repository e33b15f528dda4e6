"""Throughput: vbatch's in-process engine against Hugging Face `generate` on the same workload.

python benchmarks/throughput.py [--model M] [--num-prompts 128] [--max-tokens 128]
    [--hf-batch-sizes 64]

--model takes what `vbatch run --model` takes: an HF directory, a hub id in the local Hugging
Face cache (org/name[@revision]) or a .gguf file; by default the bundled SmolLM2-135M.

With `--data-parallel-size 1,2` it instead runs the workload through `vbatch.LLM` (engine-core
processes) with each data-parallel size in turn, `--repeats` times, `--threads` being the total
split between the cores, and prints the median of each and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

from benchmarks.workload import chat_token_ids
from vbatch.config import EngineConfig
from vbatch.engine.core import EngineCore
from vbatch.models.loader import resolve_model
from vbatch.protocol import AddRequest, pack_token_ids
from vbatch.sampling_params import SamplingParams


def run_vbatch(
    model: str | None, prompts: list[list[int]], max_tokens: int, args: argparse.Namespace
) -> dict:
    core = EngineCore(
        EngineConfig(
            model=model,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            attention_backend=args.attention_backend,
            quantization=getattr(args, "quantization", None),
            async_scheduling=getattr(args, "async_scheduling", False),
            enforce_eager=getattr(args, "enforce_eager", False),
        )
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    if getattr(args, "warmup", False):
        # NOTE: reversed prompts share no cached prefix block with the timed ones.
        warm = SamplingParams(temperature=0.0, max_tokens=4)
        for i, ids in enumerate(prompts[:8]):
            core.add_request(AddRequest(f"warm{i}", pack_token_ids(ids[::-1]), warm))
        while core.has_unfinished():
            core.step()
    outputs: dict[str, list[int]] = {}
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        core.add_request(AddRequest(str(i), pack_token_ids(ids), params))
    step_times = []
    while core.has_unfinished():
        t = time.perf_counter()
        out = core.step()
        for rid, token_id in zip(out.request_ids, out.token_ids, strict=True):
            outputs.setdefault(rid, []).append(token_id)
        step_times.append(time.perf_counter() - t)
    wall = time.perf_counter() - start
    num_out = sum(len(v) for v in outputs.values())
    return {
        "wall_s": wall,
        "output_tokens": num_out,
        "output_tok_s": num_out / wall,
        "prompt_tok_s": sum(map(len, prompts)) / wall,
        "median_step_ms": statistics.median(step_times) * 1e3,
        "tokens": [outputs[str(i)] for i in range(len(prompts))],
        "backend": core.info.attention_backend,
    }


def run_llm(
    model: str | None, prompts: list[list[int]], max_tokens: int, dp: int, args: argparse.Namespace
) -> float:
    """Output tokens per second of one `LLM.generate` over the workload on `dp` fresh cores."""
    from vbatch.llm import LLM, Request

    requests = [Request(prompt_token_ids=ids) for ids in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    with LLM(
        model,
        data_parallel_size=dp,
        num_threads=args.threads,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        attention_backend=args.attention_backend,
    ) as llm:
        start = time.perf_counter()
        outputs = llm.generate(requests, params)
        wall = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / wall


def compare_data_parallel(
    model: str | None, prompts: list[list[int]], args: argparse.Namespace
) -> None:
    sizes = [int(x) for x in args.data_parallel_size.split(",")]
    rates: dict[int, list[float]] = {dp: [] for dp in sizes}
    for repeat in range(args.repeats):
        # NOTE: the order alternates, so a machine growing busier does not favour one size.
        for dp in sizes if repeat % 2 == 0 else sizes[::-1]:
            rate = run_llm(model, prompts, args.max_tokens, dp, args)
            rates[dp].append(rate)
            print(f"-dp {dp} (threads {args.threads} in all): {rate:.1f} output tok/s")
    medians = {dp: statistics.median(r) for dp, r in rates.items()}
    for dp, median in medians.items():
        ratio = median / medians[sizes[0]]
        print(f"-dp {dp}: median {median:.1f} output tok/s, {ratio:.2f}x -dp {sizes[0]}")


def run_hf(
    hf_dir: str, prompts: list[list[int]], max_tokens: int, batch_size: int, device: str = "cpu"
) -> dict:
    """HF `generate` in float32 on CPU, in bfloat16 on CUDA (after one warm-up batch there)."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(device).eval()
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    pad = next(iter(eos_ids))

    def generate(batch: list[list[int]], new_tokens: int) -> list[list[int]]:
        width = max(map(len, batch))
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=pad,
            )
        return out[:, width:].tolist()

    if device != "cpu":
        generate(prompts[:batch_size], 4)
    tokens: list[list[int]] = []
    start = time.perf_counter()
    for b in range(0, len(prompts), batch_size):
        for row in generate(prompts[b : b + batch_size], max_tokens):
            cut = next((j + 1 for j, t in enumerate(row) if t in eos_ids), len(row))
            tokens.append(row[:cut])
    wall = time.perf_counter() - start
    num_out = sum(map(len, tokens))
    return {
        "wall_s": wall,
        "output_tokens": num_out,
        "output_tok_s": num_out / wall,
        "prompt_tok_s": sum(map(len, prompts)) / wall,
        "tokens": tokens,
    }


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of requests whose greedy continuations are identical."""
    return sum(x == y for x, y in zip(a, b)) / len(a)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="HF directory, hub id or .gguf file")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--hf-batch-sizes", default="64")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--hf-device", default="cpu", help="cpu (float32) or cuda (bfloat16)")
    parser.add_argument(
        "--warmup", action="store_true", help="run 8 short requests on the core before timing"
    )
    parser.add_argument("--async-scheduling", action="store_true")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--data-parallel-size", default=None, help="e.g. 1,2 (through LLM)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    resolved = resolve_model(args.model)
    prompts = chat_token_ids(str(resolved.hf_dir), args.num_prompts)
    lengths = sorted(map(len, prompts))
    print(
        f"workload: {len(prompts)} chat prompts, {lengths[0]}-{lengths[-1]} tokens "
        f"(median {lengths[len(lengths) // 2]}), max_tokens={args.max_tokens}, greedy, "
        f"threads={args.threads}"
    )
    if args.data_parallel_size:
        compare_data_parallel(str(resolved.local_path), prompts, args)
        return
    ours = run_vbatch(str(resolved.local_path), prompts, args.max_tokens, args)
    print(
        f"vbatch ({ours['backend']} attention): {ours['output_tok_s']:.1f} output tok/s, "
        f"{ours['prompt_tok_s']:.1f} prompt tok/s, {ours['wall_s']:.1f} s, "
        f"median step {ours['median_step_ms']:.1f} ms, "
        f"{sum(map(len, ours['tokens']))} tokens"
    )
    if args.skip_hf:
        return
    for bs in (int(x) for x in args.hf_batch_sizes.split(",")):
        hf = run_hf(str(resolved.hf_dir), prompts, args.max_tokens, bs, args.hf_device)
        print(
            f"HF generate ({args.hf_device}, batch {bs}): {hf['output_tok_s']:.1f} output tok/s, "
            f"{hf['wall_s']:.1f} s; vbatch/HF = {ours['output_tok_s'] / hf['output_tok_s']:.2f}x; "
            f"identical greedy continuations: {agreement(ours['tokens'], hf['tokens']):.0%}"
        )


if __name__ == "__main__":
    main()
