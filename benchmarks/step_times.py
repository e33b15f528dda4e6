"""Where a job's time goes, step by step: the throughput workload on one in-process engine, its
steps split into decode-only steps and steps with prompt tokens, and optionally a torch profile
of one step (CPU ops and, on CUDA, kernels).

python -m benchmarks.step_times [--model M] [--num-prompts 256] [--max-tokens 128]
    [--enforce-eager] [--profile-step N]

Written for the GPU check (`benchmarks/gpu.sh`), where it found the prefill steps taking 90% of
the time (docs/performance.md, "GPU"); it runs on CPU as well.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.workload import chat_token_ids
from vbatch.config import EngineConfig
from vbatch.engine.core import EngineCore
from vbatch.models.loader import resolve_model
from vbatch.protocol import AddRequest, pack_token_ids
from vbatch.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="HF directory, hub id or .gguf file")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--profile-step", type=int, default=None, help="profile this step")
    args = parser.parse_args()

    resolved = resolve_model(args.model)
    prompts = chat_token_ids(str(resolved.hf_dir), args.num_prompts)
    start = time.perf_counter()
    core = EngineCore(
        EngineConfig(
            model=str(resolved.local_path),
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            attention_backend=args.attention_backend,
            enforce_eager=args.enforce_eager,
        )
    )
    graphs = getattr(core.runner, "graph_runner", None) is not None
    print(
        f"engine ready in {time.perf_counter() - start:.1f} s: {core.info.attention_backend} "
        f"attention, CUDA graphs {'on' if graphs else 'off'}"
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for i, ids in enumerate(prompts):
        core.add_request(AddRequest(str(i), pack_token_ids(ids), params))
    steps: list[tuple[int, int, float]] = []  # (tokens, sampled rows, ms)
    profile = None
    start = time.perf_counter()
    while core.has_unfinished():
        t = time.perf_counter()
        if len(steps) == args.profile_step:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as torch_profile

            activities = [ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(ProfilerActivity.CUDA)
            with torch_profile(activities=activities) as profile:
                out = core.step()
        else:
            out = core.step()
        steps.append((core.last_step_tokens, len(out.token_ids), (time.perf_counter() - t) * 1e3))
    wall = time.perf_counter() - start
    num_tokens = sum(sampled for _, sampled, _ in steps)
    rate = num_tokens / wall
    print(f"{num_tokens} tokens in {wall:.2f} s ({rate:.1f} tok/s), {len(steps)} steps")
    decode = [ms for tokens, sampled, ms in steps if tokens == sampled > 0]
    prefill = [(tokens, round(ms, 1)) for tokens, sampled, ms in steps if tokens != sampled]
    if decode:
        print(
            f"decode-only steps: {len(decode)}, {sum(decode) / 1e3:.2f} s in all, "
            f"median {statistics.median(decode):.2f} ms, max {max(decode):.1f} ms"
        )
    print(
        f"steps with prompt tokens: {len(prefill)}, {sum(ms for _, ms in prefill) / 1e3:.2f} s "
        f"in all; (tokens, ms) of the first 12: {prefill[:12]}"
    )
    if profile is not None:
        tokens, sampled, ms = steps[args.profile_step]
        print(f"step {args.profile_step}: {tokens} tokens, {sampled} sampled, {ms:.1f} ms")
        averages = profile.key_averages()
        print(averages.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=50))
        if torch.cuda.is_available():
            print(
                averages.table(
                    sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=50
                )
            )


if __name__ == "__main__":
    main()
