#!/usr/bin/env bash
# One command for a GPU machine (about 5 minutes): every gpu-marked test, decode attention
# alone, CLI jobs on CUDA (generate, embed, perplexity), step times with one profiled prefill
# step, vbatch throughput on CUDA (CUDA graphs, eager, async scheduling) against HF `generate`
# on the same GPU, and vLLM offline on the same prompts when vLLM imports.
#   bash benchmarks/gpu.sh [NUM_PROMPTS=256] [MAX_TOKENS=128]
# MODEL (an HF directory or .gguf file) picks the model; by default the bundled SmolLM2-135M.
set -uo pipefail
cd "$(dirname "$0")/.."
NUM_PROMPTS="${1:-256}"
MAX_TOKENS="${2:-128}"
MODEL_ARGS=(${MODEL:+--model "$MODEL"})
export PYTHONPATH="${PWD}/src:${PWD}${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PYTHON="${PYTHON:-python3}"

"$PYTHON" - <<'PY' || { echo "no usable CUDA device"; exit 1; }
import torch
assert torch.cuda.is_available()
print(torch.cuda.get_device_name(0), "torch", torch.__version__, "cuda", torch.version.cuda)
PY

echo "== native library with its CUDA kernels"
time timeout 300 "$PYTHON" -c "from vbatch.layers import native; print(native.is_available())"

echo "== gpu tests"
mapfile -t gpu_files < <(grep -l "mark.gpu" tests/test_*.py)
timeout 240 "$PYTHON" -m pytest -m gpu -q -ra -p no:cacheprovider "${gpu_files[@]}"

echo "== decode attention alone, checked against float32 attention"
timeout 60 "$PYTHON" -m benchmarks.cuda_attention
timeout 60 "$PYTHON" -m benchmarks.cuda_attention --context 1000 --num-seqs 64 | tail -1

for task in generate embed perplexity; do
  echo "== a CLI job on CUDA, --task $task"
  out_dir="$(mktemp -d)"
  timeout 120 "$PYTHON" -m vbatch.cli run examples/prompts.jsonl -o "$out_dir/out.jsonl" \
    --task "$task" --max-tokens 32 "${MODEL_ARGS[@]}" 2>&1 | tail -30
  "$PYTHON" - "$out_dir" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = [json.loads(line) for line in (out / "out.jsonl").read_text().splitlines()]
print(len(rows), "rows;", sum(r.get("error") is None for r in rows), "without error")
manifest = next(out.rglob("manifest.json"), None)
if manifest is not None:
    print("kernels:", json.loads(manifest.read_text())["kernels"])
PY
done

echo "== step times on CUDA (decode-only steps and steps with prompt tokens), one prefill profiled"
timeout 150 "$PYTHON" -m benchmarks.step_times --num-prompts "$NUM_PROMPTS" \
  --max-tokens "$MAX_TOKENS" --profile-step 1 "${MODEL_ARGS[@]}"

bench=(timeout 150 "$PYTHON" -m benchmarks.throughput --num-prompts "$NUM_PROMPTS"
  --max-tokens "$MAX_TOKENS" --max-num-seqs 256 --max-num-batched-tokens 8192 --warmup
  "${MODEL_ARGS[@]}")
echo "== vbatch throughput (CUDA graphs) against HF generate on the GPU"
"${bench[@]}" --hf-device cuda --hf-batch-sizes 64,256
echo "== the same, eager"
"${bench[@]}" --skip-hf --enforce-eager
echo "== the same with async scheduling"
"${bench[@]}" --skip-hf --async-scheduling

echo "== vLLM offline throughput on the same prompts (when vLLM imports)"
"$PYTHON" -c "import vllm" 2>/dev/null || echo "vLLM is not installed: skipped"
"$PYTHON" -c "import vllm" 2>/dev/null && timeout 150 "$PYTHON" - "$NUM_PROMPTS" "$MAX_TOKENS" "${MODEL:-}" <<'PY'
import sys, time
from vllm import LLM, SamplingParams, TokensPrompt
from benchmarks.workload import chat_token_ids
from vbatch.models.loader import resolve_model

num_prompts, max_tokens = int(sys.argv[1]), int(sys.argv[2])
hf_dir = str(resolve_model(sys.argv[3] or None).hf_dir)
prompts = [TokensPrompt(prompt_token_ids=ids) for ids in chat_token_ids(hf_dir, num_prompts)]
llm = LLM(model=hf_dir, dtype="bfloat16", enforce_eager=False)
params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
start = time.perf_counter()
outputs = llm.generate(prompts, params)
wall = time.perf_counter() - start
num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
print(f"vLLM: {num_out / wall:.1f} output tok/s, {wall:.1f} s")
PY
exit 0
