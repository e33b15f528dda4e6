"""Per-step non-forward cost (scheduling, batch building, IPC, detokenization) at batch 1/64/256.

Uses a trivially small random Llama so the forward pass is cheap and the overhead shows.
In-process: wraps the model forward, logits and sampler of an EngineCore and times the rest of
each step. Through the subprocess: LLM.generate on the same workload, compared with the
in-process wall time, and the core's own busy time from SchedulerStats.

    python -m benchmarks.overhead [--batches 1 64 256] [--max-tokens 64] [--model DIR]
        [--attention-backend torch|native] [--rounds 5]

With --hash-cost: the prefix cache's block hashing instead. First the cost of one 16-token
block's chained key, the SHA-256 digest the BlockManager uses against the CPython tuple hash it
used before (issue 12: collisions of that one can be found in minutes), then the same in-process
workload with prefix caching on and the BlockManager's hashing timed: blocks hashed and hashing
µs per step, what the old hash would have cost for them, and the step's non-forward time.

    python -m benchmarks.overhead --hash-cost [--batches 64 256] [--prompt-len 16]
"""

from __future__ import annotations

import argparse
import functools
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PROMPT_LEN = 16  # the default; --prompt-len sets it


def make_tiny_model(out_dir: Path) -> Path:
    """A random 2-layer, 64-wide Llama with SmolLM2's tokenizer (needs torch + transformers)."""
    from benchmarks.tiny_model import write_tiny_llama
    from vbatch.models.loader import resolve_model

    return write_tiny_llama(out_dir, resolve_model(None).hf_dir, max_position_embeddings=1024)


def engine_args(
    batch: int, max_tokens: int, backend: str, prefix_caching: bool = False
) -> dict[str, Any]:
    blocks_per_seq = (PROMPT_LEN + max_tokens) // 16 + 2
    return dict(
        device="cpu",
        num_threads=1,
        max_num_seqs=batch,
        max_num_batched_tokens=max(1024, batch * PROMPT_LEN),
        num_kv_blocks=batch * blocks_per_seq + 16,
        enable_prefix_caching=prefix_caching,
        attention_backend=backend,
    )


def prompt_ids(batch: int, round_index: int = 0) -> list[list[int]]:
    # NOTE: each round's prompts differ, so a round with prefix caching hashes but never hits.
    return [
        [100 + (i * 7 + j * 13 + round_index * 101) % 4000 for j in range(PROMPT_LEN)]
        for i in range(batch)
    ]


def timed(fn: Callable[..., Any], acc: list[float]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[0] += time.perf_counter() - start

    return wrapper


def time_block_hashing(block_manager: Any, acc: list[float], count: list[int]) -> None:
    """Add up the time `block_manager` spends hashing blocks, and the blocks it hashes."""
    full_block_hashes = block_manager.full_block_hashes

    def timed(seq: Any, num_blocks: int) -> list[bytes]:
        before = len(seq.full_block_hashes)
        start = time.perf_counter()
        hashes = full_block_hashes(seq, num_blocks)
        acc[0] += time.perf_counter() - start
        count[0] += len(hashes) - before
        return hashes

    block_manager.full_block_hashes = timed


def run_in_process(
    model: Path,
    batch: int,
    max_tokens: int,
    backend: str,
    rounds: int,
    prefix_caching: bool = False,
) -> list[dict[str, float]]:
    """`rounds` timed runs of the workload on one EngineCore, after a warm-up request; with
    prefix caching, the BlockManager's block hashing is timed too."""
    import torch

    from vbatch.config import EngineConfig
    from vbatch.engine.core import EngineCore
    from vbatch.protocol import AddRequest, pack_token_ids
    from vbatch.sampling_params import SamplingParams

    args = engine_args(batch, max_tokens, backend, prefix_caching)
    config = EngineConfig(model=str(model), **args)
    core = EngineCore(config)
    forward = [0.0]
    hashing, num_hashed = [0.0], [0]
    time_block_hashing(core.scheduler.block_manager, hashing, num_hashed)
    runner = core.runner
    runner.model.forward = timed(runner.model.forward, forward)
    runner.model.compute_logits = timed(runner.model.compute_logits, forward)
    runner.model.greedy_token_ids = timed(runner.model.greedy_token_ids, forward)
    runner.sampler = timed(runner.sampler, forward)
    core.add_request(AddRequest("warmup", pack_token_ids([1, 2, 3]), SamplingParams(max_tokens=2)))
    while core.has_unfinished():
        core.step()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    results = []
    # NOTE: as in the engine-core process, whose busy loop runs in inference mode.
    with torch.inference_mode():
        for round_index in range(rounds):
            forward[0] = hashing[0] = 0.0
            num_hashed[0] = 0
            start = time.perf_counter()
            for i, ids in enumerate(prompt_ids(batch, round_index)):
                core.add_request(AddRequest(f"{round_index}-{i}", pack_token_ids(ids), params))
            num_steps = 0
            while core.has_unfinished():
                core.step()
                num_steps += 1
            wall = time.perf_counter() - start
            results.append(
                {
                    "wall_s": wall,
                    "forward_s": forward[0],
                    "num_steps": num_steps,
                    "hashing_s": hashing[0],
                    "num_hashed": num_hashed[0],
                }
            )
    core.shutdown()
    return results


def run_through_llm(model: Path, batch: int, max_tokens: int, backend: str) -> dict[str, float]:
    from vbatch import LLM, SamplingParams
    from vbatch.llm import Request

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    requests = [Request(prompt_token_ids=ids) for ids in prompt_ids(batch)]
    with LLM(str(model), **engine_args(batch, max_tokens, backend)) as llm:
        llm.generate(requests[:1], SamplingParams(max_tokens=2))
        before = llm.get_stats()
        start = time.perf_counter()
        outs = llm.generate(requests, params)
        wall = time.perf_counter() - start
        after = llm.get_stats()
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
    return {
        "wall_s": wall,
        "core_busy_s": after.busy_time_s - before.busy_time_s,
        # NOTE: the core's forward_time_s is all of ModelRunner.execute (batch building too).
        "core_execute_s": after.forward_time_s - before.forward_time_s,
        "num_steps": after.num_steps - before.num_steps,
    }


def tuple_hash_chain(token_ids: list[int], block_size: int) -> Callable[[], list[int]]:
    """The block keys as the BlockManager made them before issue 12: CPython's tuple hash of
    (parent hash, the block's tokens)."""

    def chain() -> list[int]:
        parent = 0
        hashes = []
        for start in range(0, len(token_ids) - block_size + 1, block_size):
            parent = hash((parent, tuple(token_ids[start : start + block_size])))
            hashes.append(parent)
        return hashes

    return chain


def digest_chain(token_ids: list[int], block_size: int) -> Callable[[], list[bytes]]:
    """The block keys as the BlockManager makes them now (its own code, on a seq whose
    memo of them is emptied first)."""
    from vbatch.engine.block_manager import BlockManager
    from vbatch.engine.sequence import Sequence
    from vbatch.sampling_params import SamplingParams

    manager = BlockManager(1, block_size)
    seq = Sequence("bench", token_ids, SamplingParams())

    def chain() -> list[bytes]:
        seq.full_block_hashes = []
        return manager.full_block_hashes(seq, len(token_ids) // block_size)

    return chain


def per_block_ns(make_chain: Callable[[list[int], int], Callable[[], list[Any]]]) -> float:
    """Least CPU ns per 16-token block of a chain over a 2048-token sequence, as a prefill chunk
    hashes it (CPU time, so that a busy host does not count its other processes' slices)."""
    token_ids = [100 + (j * 37) % 49000 for j in range(2048)]
    chain = make_chain(token_ids, 16)
    samples = []
    for _ in range(7):
        start = time.process_time()
        for _ in range(20):
            chain()
        samples.append((time.process_time() - start) / (20 * len(token_ids) // 16) * 1e9)
    return min(samples)


def report_hash_cost(model: Path, args: argparse.Namespace) -> None:
    old_ns = per_block_ns(tuple_hash_chain)
    new_ns = per_block_ns(digest_chain)
    print(
        f"one 16-token block's key: tuple hash {old_ns:.0f} ns, SHA-256 digest {new_ns:.0f} ns "
        f"({new_ns / old_ns:.1f}x, +{new_ns - old_ns:.0f} ns a block)"
    )
    # NOTE: per step, the blocks hashed times the cost of one (new and old), the hashing time
    # measured in the step loop (wall time, with the timing's own cost), and the step's
    # non-forward wall time; the new hashing's extra cost is the step-level impact.
    print(
        f"{'batch':>5} {'steps':>5} {'blocks/step':>11} {'new µs/step':>11} "
        f"{'old µs/step':>11} {'measured':>8} {'non-fwd µs/step':>15} {'extra share':>11}"
    )
    for batch in args.batches:
        runs = run_in_process(
            model, batch, args.max_tokens, args.attention_backend, args.rounds, True
        )
        run = sorted(runs, key=lambda r: r["wall_s"] - r["forward_s"])[len(runs) // 2]
        steps = run["num_steps"]
        blocks = run["num_hashed"] / steps
        non_forward_us = (run["wall_s"] - run["forward_s"]) / steps * 1e6
        extra_us = blocks * (new_ns - old_ns) / 1e3
        print(
            f"{batch:>5} {steps:>5} {blocks:>11.1f} {blocks * new_ns / 1e3:>11.1f} "
            f"{blocks * old_ns / 1e3:>11.1f} {run['hashing_s'] / steps * 1e6:>8.1f} "
            f"{non_forward_us:>15.0f} {extra_us / non_forward_us:>11.1%}",
            flush=True,
        )


def main() -> None:
    global PROMPT_LEN
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--attention-backend", default="torch")
    parser.add_argument(
        "--rounds", type=int, default=5, help="timed in-process runs; the median one is shown"
    )
    parser.add_argument(
        "--hash-cost", action="store_true", help="time the prefix cache's block hashing instead"
    )
    parser.add_argument("--prompt-len", type=int, default=PROMPT_LEN)
    args = parser.parse_args()
    import torch

    PROMPT_LEN = args.prompt_len
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="vbatch-overhead-"))
    try:
        model = args.model or make_tiny_model(tmp)
        if args.hash_cost:
            report_hash_cost(model, args)
            return
        header = (
            f"{'batch':>5} {'steps':>5} {'in-proc ms':>10} {'fwd ms':>8} {'µs/step':>8} "
            f"{'non-fwd':>7} | {'LLM ms':>8} {'core busy':>9} {'non-exec':>8} {'+µs/step':>8} "
            f"{'LLM/in-proc':>11} | µs/step of each round"
        )
        print(header)
        for batch in args.batches:
            backend = args.attention_backend
            runs = run_in_process(model, batch, args.max_tokens, backend, args.rounds)
            per_step = [(r["wall_s"] - r["forward_s"]) / r["num_steps"] * 1e6 for r in runs]
            # NOTE: the median round by non-forward time stands for the batch size.
            inproc = runs[per_step.index(statistics.median_low(per_step))]
            api = run_through_llm(model, batch, args.max_tokens, backend)
            steps = inproc["num_steps"]
            overhead_us = (inproc["wall_s"] - inproc["forward_s"]) / steps * 1e6
            extra_us = (api["wall_s"] - inproc["wall_s"]) / max(api["num_steps"], 1) * 1e6
            print(
                f"{batch:>5} {steps:>5} {inproc['wall_s'] * 1e3:>10.1f} "
                f"{inproc['forward_s'] * 1e3:>8.1f} {overhead_us:>8.0f} "
                f"{1 - inproc['forward_s'] / inproc['wall_s']:>7.1%} | "
                f"{api['wall_s'] * 1e3:>8.1f} {api['core_busy_s'] * 1e3:>9.1f} "
                f"{1 - api['core_execute_s'] / api['wall_s']:>8.1%} "
                f"{extra_us:>8.0f} {api['wall_s'] / inproc['wall_s']:>11.2f} | "
                + " ".join(f"{us:.0f}" for us in per_step),
                flush=True,
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
