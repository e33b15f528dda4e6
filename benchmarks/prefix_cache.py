"""Prefix caching: prompts sharing a long system prompt, with prefix caching on and off.

Reports the fraction of requests whose shared prefix was served from the cache (from each
request's num_cached_tokens and the scheduler's prefix_cache_hits) and the wall-time gain.

python -m benchmarks.prefix_cache [--num-prompts 64] [--max-tokens 32] [--threads 2]
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


def make_prompts(num_prompts: int) -> tuple[list[list[int]], int]:
    """Token ids of chat prompts that all start with SYSTEM_PROMPT, and the shared length."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None).hf_dir)
    prompts = []
    for messages in make_messages(num_prompts):
        chat = [{"role": "system", "content": SYSTEM_PROMPT}, *messages]
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids))
    shared = 0
    while all(len(p) > shared and p[shared] == prompts[0][shared] for p in prompts):
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompts, shared = make_prompts(args.num_prompts)
    num_prompt_tokens = sum(map(len, prompts))
    print(
        f"{len(prompts)} prompts sharing a {shared}-token prefix, {num_prompt_tokens} prompt "
        f"tokens in all, max_tokens={args.max_tokens}, greedy, threads={args.threads}"
    )
    off = run(prompts, args, caching=False)
    on = run(prompts, args, caching=True)
    cacheable = shared // on["block_size"] * on["block_size"]
    num_skipped = sum(c >= cacheable for c in on["cached"])
    fraction = num_skipped / len(prompts)
    print(
        f"prefix caching on: {num_skipped}/{len(prompts)} requests ({fraction:.0%}) skipped "
        f"their {cacheable} cacheable shared tokens; prefix_cache_hits {on['hits']} of "
        f"{on['queries']} queried tokens ({on['hits'] / max(on['queries'], 1):.0%})"
    )
    print(
        f"wall time: off {off['wall_s']:.1f} s, on {on['wall_s']:.1f} s, "
        f"gain {off['wall_s'] / on['wall_s']:.2f}x"
    )


if __name__ == "__main__":
    main()
