"""int8 against fp32 on the throughput workload: speed, greedy agreement and log-likelihood.

Runs the in-process engine once in fp32 and once with `quantization="int8"` on the same prompts
(greedy), then scores the fp32 continuations teacher-forced under transformers' fp32 model and
under the same model with the same int8 linears (`quantize_linears`), which is the engine's math:

- speed: output tok/s of each run and int8/fp32;
- greedy agreement: identical continuations, mean common prefix, and teacher-forced top-1
  agreement (int8's argmax equals the fp32 token at each fp32 position);
- quality: mean log-likelihood per token of the fp32 continuations under each model.

python -m benchmarks.quantization [--num-prompts 64] [--max-tokens 128] [--threads 2]
    [--hf-batch-size 32]   # also time HF generate (fp32) for the vbatch-int8/HF ratio
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.throughput import run_hf, run_vbatch
from benchmarks.workload import chat_token_ids
from vbatch.layers.quantization import quantize_linears
from vbatch.models.loader import resolve_model


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@torch.inference_mode()
def score(model: torch.nn.Module, prompts: list[list[int]], outputs: list[list[int]]) -> dict:
    """Per continuation token: log-prob of the given token and whether it is the argmax."""
    logprobs: list[float] = []
    hits: list[bool] = []
    for prompt, output in zip(prompts, outputs, strict=True):
        if not output:
            continue
        ids = torch.tensor([prompt + output])
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        target = torch.tensor(output)
        lp = logits.log_softmax(-1).gather(1, target[:, None])[:, 0]
        logprobs.extend(lp.tolist())
        hits.extend((logits.argmax(-1) == target).tolist())
    return {"mean_logprob": statistics.fmean(logprobs), "top1": statistics.fmean(hits)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--hf-batch-size", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import LlamaForCausalLM

    resolved = resolve_model(None)
    prompts = chat_token_ids(str(resolved.hf_dir), args.num_prompts)
    engine_args = argparse.Namespace(
        max_num_seqs=128, max_num_batched_tokens=2048, attention_backend="auto"
    )
    runs = {}
    for quantization in (None, "int8"):
        engine_args.quantization = quantization
        runs[quantization or "fp32"] = run_vbatch(None, prompts, args.max_tokens, engine_args)
    fp32, int8 = runs["fp32"], runs["int8"]
    print(
        f"workload: {args.num_prompts} chat prompts, max_tokens={args.max_tokens}, greedy, "
        f"threads={args.threads}"
    )
    for name, run in runs.items():
        print(f"vbatch {name}: {run['output_tok_s']:.1f} output tok/s, {run['wall_s']:.1f} s")
    print(f"int8/fp32 speed = {int8['output_tok_s'] / fp32['output_tok_s']:.2f}x")
    same = sum(a == b for a, b in zip(fp32["tokens"], int8["tokens"], strict=True))
    prefix = statistics.fmean(
        common_prefix(a, b) for a, b in zip(fp32["tokens"], int8["tokens"], strict=True)
    )
    print(
        f"identical greedy continuations: {same}/{args.num_prompts}; "
        f"mean common prefix {prefix:.1f} tokens"
    )
    model = LlamaForCausalLM.from_pretrained(resolved.hf_dir, dtype=torch.float32).eval()
    ref = score(model, prompts, fp32["tokens"])
    quantize_linears(model.model.layers)
    quant = score(model, prompts, fp32["tokens"])
    change = quant["mean_logprob"] - ref["mean_logprob"]
    print(
        f"fp32 continuations, teacher-forced: top-1 agreement int8 {quant['top1']:.1%} "
        f"(fp32 {ref['top1']:.1%}); mean log-likelihood/token fp32 {ref['mean_logprob']:.4f}, "
        f"int8 {quant['mean_logprob']:.4f} (change {change:+.4f})"
    )
    if args.hf_batch_size:
        hf = run_hf(str(resolved.hf_dir), prompts, args.max_tokens, args.hf_batch_size)
        print(
            f"HF generate fp32 (batch {args.hf_batch_size}): {hf['output_tok_s']:.1f} tok/s; "
            f"vbatch fp32/HF = {fp32['output_tok_s'] / hf['output_tok_s']:.2f}x, "
            f"vbatch int8/HF = {int8['output_tok_s'] / hf['output_tok_s']:.2f}x"
        )


if __name__ == "__main__":
    main()
