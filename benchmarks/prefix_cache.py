"""Prefix caching: prompts sharing a long system prompt, with prefix caching on and off.

Reports the fraction of requests whose shared prefix was served from the cache (from each
request's num_cached_tokens and the scheduler's prefix_cache_hits) and the wall-time gain.

python -m benchmarks.prefix_cache [--num-prompts 64] [--max-tokens 32] [--threads 2]

With `--data-parallel-size N` the prompts fall in `--num-groups` groups, each with its own
system prompt, and run through `vbatch.LLM` on N cores twice: placed by load alone and by load
and prompt prefix (rows of a group kept on one core); it prints the prefix-cache hits and wall
time of each.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoTokenizer

from benchmarks.workload import make_messages
from vbatch.config import EngineConfig
from vbatch.engine.core import EngineCore
from vbatch.models.loader import resolve_model
from vbatch.protocol import AddRequest, pack_token_ids
from vbatch.sampling_params import SamplingParams

SYSTEM_PROMPT = " ".join(
    [
        "You are a careful assistant for a museum of science and industry.",
        "Answer in plain English for curious visitors of every age, in one short paragraph.",
        "Prefer concrete examples over abstractions, name the key idea first, and avoid jargon;",
        "when a technical word is needed, explain it in the same sentence.",
        "Do not invent dates, names or numbers; if you are unsure, say what is known instead.",
        "Keep a friendly, calm tone, never condescending, and do not use lists or headings.",
    ]
    * 4
)


def make_prompts(num_prompts: int, num_groups: int = 1) -> tuple[list[list[int]], int]:
    """Token ids of chat prompts that start with SYSTEM_PROMPT (row i with group i % num_groups's
    variant of it), and the length the first group shares."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None).hf_dir)
    prompts = []
    for i, messages in enumerate(make_messages(num_prompts)):
        system = SYSTEM_PROMPT if num_groups == 1 else f"Wing {i % num_groups}. {SYSTEM_PROMPT}"
        chat = [{"role": "system", "content": system}, *messages]
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids))
    shared = 0
    group = prompts[::num_groups]
    while all(len(p) > shared and p[shared] == group[0][shared] for p in group):
        shared += 1
    return prompts, shared


def run(prompts: list[list[int]], args: argparse.Namespace, caching: bool) -> dict[str, float]:
    core = EngineCore(EngineConfig(enable_prefix_caching=caching, num_threads=args.threads, seed=0))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    cached_tokens: dict[str, int] = {}
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        core.add_request(AddRequest(str(i), pack_token_ids(ids), params))
    while core.has_unfinished():
        for finish in core.step().finished:
            cached_tokens[finish.request_id] = finish.num_cached_tokens
    wall = time.perf_counter() - start
    stats = core.stats()
    return {
        "wall_s": wall,
        "block_size": core.config.block_size,
        "hits": stats.prefix_cache_hits,
        "queries": stats.prefix_cache_queries,
        "cached": [cached_tokens[str(i)] for i in range(len(prompts))],
    }


def run_data_parallel(
    prompts: list[list[int]], args: argparse.Namespace, prefix_placement: bool
) -> dict[str, float]:
    from vbatch.llm import LLM, Request

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    with LLM(
        None,
        data_parallel_size=args.data_parallel_size,
        num_threads=args.threads,
        prefix_placement=prefix_placement,
    ) as llm:
        start = time.perf_counter()
        llm.generate([Request(prompt_token_ids=ids) for ids in prompts], params)
        wall = time.perf_counter() - start
        stats = llm.get_stats()
    return {
        "wall_s": wall,
        "hits": stats.prefix_cache_hits,
        "queries": stats.prefix_cache_queries,
    }


def compare_placement(args: argparse.Namespace) -> None:
    prompts, shared = make_prompts(args.num_prompts, args.num_groups)
    print(
        f"{len(prompts)} prompts in {args.num_groups} groups, each sharing a {shared}-token "
        f"prefix; {sum(map(len, prompts))} prompt tokens, max_tokens={args.max_tokens}, greedy, "
        f"-dp {args.data_parallel_size}, threads={args.threads} in all"
    )
    results = {}
    for repeat in range(args.repeats):
        for aware in (False, True) if repeat % 2 == 0 else (True, False):
            result = run_data_parallel(prompts, args, aware)
            results.setdefault(aware, []).append(result)
            name = "load and prefix" if aware else "load only"
            print(
                f"{name}: prefix_cache_hits {result['hits']} of {result['queries']} queried "
                f"tokens ({result['hits'] / max(result['queries'], 1):.0%}), "
                f"wall {result['wall_s']:.1f} s"
            )
    walls = {aware: sorted(r["wall_s"] for r in runs) for aware, runs in results.items()}
    median = {aware: w[len(w) // 2] for aware, w in walls.items()}
    print(
        f"median wall: load only {median[False]:.1f} s, load and prefix {median[True]:.1f} s, "
        f"gain {median[False] / median[True]:.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--data-parallel-size", type=int, default=None)
    parser.add_argument("--num-groups", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    if args.data_parallel_size:
        compare_placement(args)
        return
    torch.set_num_threads(args.threads)
    prompts, shared = make_prompts(args.num_prompts)
    num_prompt_tokens = sum(map(len, prompts))
    print(
        f"{len(prompts)} prompts sharing a {shared}-token prefix, {num_prompt_tokens} prompt "
        f"tokens in all, max_tokens={args.max_tokens}, greedy, threads={args.threads}"
    )
    off = run(prompts, args, caching=False)
    on = run(prompts, args, caching=True)
    whole_blocks = shared // on["block_size"] * on["block_size"]
    num_skipped = sum(c >= shared for c in on["cached"])
    num_blocks_skipped = sum(c >= whole_blocks for c in on["cached"])
    fraction = num_skipped / len(prompts)
    print(
        f"prefix caching on: {num_skipped}/{len(prompts)} requests ({fraction:.0%}) skipped all "
        f"{shared} shared tokens ({num_blocks_skipped} at least its {whole_blocks} in whole "
        f"blocks); prefix_cache_hits {on['hits']} of {on['queries']} queried tokens "
        f"({on['hits'] / max(on['queries'], 1):.0%})"
    )
    print(
        f"wall time: off {off['wall_s']:.1f} s, on {on['wall_s']:.1f} s, "
        f"gain {off['wall_s'] / on['wall_s']:.2f}x"
    )


if __name__ == "__main__":
    main()
