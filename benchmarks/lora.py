"""LoRA throughput: the same rows with no adapter, with one, and spread over 4 and 16 adapters
(rank 16 on every projection), against running each adapter as its own merged job.

In process (EngineCore, load excluded), SmolLM2-135M, greedy with ignore_eos so every run makes
the same tokens, prefix cache off so repeated rounds recompute. Each run is timed by the wall
clock and by the process's CPU time: on a shared, loaded host the CPU-time rate (with one
thread) is the steadier figure. The scenarios run interleaved,
`--rounds` times; medians are printed. A merged adapter computes exactly what the base model
does, so "each adapter as its own merged job" is timed as the base engine run over each
adapter's rows in turn (model loads not counted, which favours it).

python -m benchmarks.lora [--num-prompts 128] [--max-tokens 32] [--rounds 2] [--threads 2]
    [--max-num-seqs 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from benchmarks.workload import make_messages
from vbatch.client.tokenizer import TextTokenizer
from vbatch.config import EngineConfig
from vbatch.engine.core import EngineCore
from vbatch.lora.request import LoraRef
from vbatch.models.config import ModelConfig
from vbatch.models.loader import resolve_model
from vbatch.protocol import AddRequest, pack_token_ids
from vbatch.sampling_params import SamplingParams

RANK = 16
PROJECTIONS = {
    "self_attn.q_proj": ("hidden", "q"),
    "self_attn.k_proj": ("hidden", "kv"),
    "self_attn.v_proj": ("hidden", "kv"),
    "self_attn.o_proj": ("q", "hidden"),
    "mlp.gate_proj": ("hidden", "intermediate"),
    "mlp.up_proj": ("hidden", "intermediate"),
    "mlp.down_proj": ("intermediate", "hidden"),
}


def write_adapter(path: Path, config: ModelConfig, seed: int) -> Path:
    """A random rank-16 PEFT adapter on every projection of every layer."""
    sizes = {
        "hidden": config.hidden_size,
        "q": config.num_attention_heads * config.head_dim,
        "kv": config.num_key_value_heads * config.head_dim,
        "intermediate": config.intermediate_size,
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for name, (fan_in, fan_out) in PROJECTIONS.items():
            key = f"base_model.model.model.layers.{layer}.{name}"
            a = torch.randn(RANK, sizes[fan_in], generator=generator) * sizes[fan_in] ** -0.5
            b = torch.randn(sizes[fan_out], RANK, generator=generator) * 0.01
            tensors[f"{key}.lora_A.weight"] = a
            tensors[f"{key}.lora_B.weight"] = b
    path.mkdir(parents=True)
    save_file(tensors, path / "adapter_model.safetensors")
    targets = sorted({name.split(".")[1] for name in PROJECTIONS})
    settings = {"peft_type": "LORA", "r": RANK, "lora_alpha": 32, "target_modules": targets}
    (path / "adapter_config.json").write_text(json.dumps(settings))
    return path


Timing = tuple[float, float, int]  # wall seconds, CPU seconds, tokens made


def run(
    core: EngineCore, prompts: list[list[int]], loras: list[LoraRef | None], max_tokens: int
) -> Timing:
    """Wall and CPU seconds to finish every prompt, and the tokens made."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start, start_cpu = time.perf_counter(), time.process_time()
    for i, (ids, lora) in enumerate(zip(prompts, loras, strict=True)):
        core.add_request(AddRequest(f"r{i}", pack_token_ids(ids), params, lora=lora))
    num_tokens = 0
    while core.has_unfinished():
        num_tokens += len(core.step().token_ids)
    return time.perf_counter() - start, time.process_time() - start_cpu, num_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    args = parser.parse_args()
    resolved = resolve_model(None)
    model_config = ModelConfig.from_hf_dir(resolved.hf_dir)
    tokenizer = TextTokenizer.from_dir(resolved.hf_dir)
    prompts = tokenizer.encode_chats(make_messages(args.num_prompts))
    n = args.num_prompts
    with tempfile.TemporaryDirectory() as tmp:
        refs = [
            LoraRef(i + 1, f"a{i}", str(write_adapter(Path(tmp) / f"a{i}", model_config, i)))
            for i in range(16)
        ]
        common = dict(
            model=str(resolved.local_path),
            num_threads=args.threads,
            max_num_seqs=args.max_num_seqs,
            enable_prefix_caching=False,
        )
        base = EngineCore(EngineConfig(**common))
        lora = EngineCore(EngineConfig(**common, enable_lora=True, max_loras=4))
        for ref in refs:
            lora.runner.lora.register(ref)  # type: ignore[union-attr]
        spread4 = [refs[i % 4] for i in range(n)]
        spread16 = [refs[i % 16] for i in range(n)]
        scenarios = {
            "base model, no LoRA": lambda: run(base, prompts, [None] * n, args.max_tokens),
            "one adapter": lambda: run(lora, prompts, [refs[0]] * n, args.max_tokens),
            "4 adapters mixed": lambda: run(lora, prompts, spread4, args.max_tokens),
            "16 adapters, max_loras 4": lambda: run(lora, prompts, spread16, args.max_tokens),
            "4 merged jobs in turn": lambda: merged(base, prompts, 4, args.max_tokens),
            "16 merged jobs in turn": lambda: merged(base, prompts, 16, args.max_tokens),
        }
        times: dict[str, list[float]] = {name: [] for name in scenarios}
        cpu_times: dict[str, list[float]] = {name: [] for name in scenarios}
        tokens: dict[str, int] = {}
        for _ in range(args.rounds):
            for name, scenario in scenarios.items():
                seconds, cpu_seconds, tokens[name] = scenario()
                times[name].append(seconds)
                cpu_times[name].append(cpu_seconds)
                print(
                    f"  {name}: {tokens[name]} tokens in {seconds:.2f} s ({cpu_seconds:.2f} s CPU)",
                    flush=True,
                )
    base = "base model, no LoRA"
    base_rate = tokens[base] / statistics.median(times[base])
    base_cpu_rate = tokens[base] / statistics.median(cpu_times[base])
    print(
        f"SmolLM2-135M fp32, {n} chat prompts x {args.max_tokens} tokens, greedy, "
        f"threads={args.threads}, max_num_seqs={args.max_num_seqs}, rank {RANK} on "
        f"q,k,v,o,gate,up,down, {args.rounds} rounds interleaved; "
        f"CPU {torch.backends.cpu.get_cpu_capability()}"
    )
    for name, seconds in times.items():
        rate = tokens[name] / statistics.median(seconds)
        cpu_rate = tokens[name] / statistics.median(cpu_times[name])
        print(
            f"{name:28s} wall {rate:7.1f} tok/s {rate / base_rate:5.2f}x base | CPU time "
            f"{cpu_rate:7.1f} tok/s {cpu_rate / base_cpu_rate:5.2f}x base"
        )


def merged(
    core: EngineCore, prompts: list[list[int]], num_adapters: int, max_tokens: int
) -> Timing:
    """Each adapter's rows (every num_adapters-th) as a job of its own, one after another."""
    timings = []
    for k in range(num_adapters):
        rows = prompts[k::num_adapters]
        timings.append(run(core, rows, [None] * len(rows), max_tokens))
    wall, cpu, num_tokens = zip(*timings, strict=True)
    return sum(wall), sum(cpu), sum(num_tokens)


if __name__ == "__main__":
    main()
