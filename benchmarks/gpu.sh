#!/usr/bin/env bash
# One command for a GPU machine (< 8 minutes): the gpu tests, vbatch throughput on CUDA, and
# vLLM offline throughput on the same prompts when vLLM is importable or installs quickly.
#   bash benchmarks/gpu.sh [NUM_PROMPTS=256] [MAX_TOKENS=128]
set -uo pipefail
cd "$(dirname "$0")/.."
NUM_PROMPTS="${1:-256}"
MAX_TOKENS="${2:-128}"
export PYTHONPATH="${PWD}/src:${PWD}${PYTHONPATH:+:$PYTHONPATH}"

python - <<'PY' || { echo "no usable CUDA device"; exit 1; }
import torch
assert torch.cuda.is_available()
print(torch.cuda.get_device_name(0), "torch", torch.__version__, "cuda", torch.version.cuda)
PY

echo "== gpu tests"
timeout 180 python -m pytest -m gpu -q -x tests/test_native.py tests/test_llama.py \
  tests/test_model_runner.py 2>&1 | tail -5

echo "== vbatch throughput (CUDA, bf16)"
timeout 150 python -m benchmarks.throughput --skip-hf --num-prompts "$NUM_PROMPTS" \
  --max-tokens "$MAX_TOKENS" --max-num-seqs 256 --max-num-batched-tokens 8192

echo "== the same with async scheduling"
timeout 150 python -m benchmarks.throughput --skip-hf --num-prompts "$NUM_PROMPTS" \
  --max-tokens "$MAX_TOKENS" --max-num-seqs 256 --max-num-batched-tokens 8192 --async-scheduling

echo "== vLLM offline throughput on the same prompts"
if ! python -c "import vllm" 2>/dev/null; then
  timeout 120 pip install -q vllm >/dev/null 2>&1 || echo "vLLM not installable here; skipped"
fi
python -c "import vllm" 2>/dev/null && timeout 150 python - "$NUM_PROMPTS" "$MAX_TOKENS" <<'PY'
import sys, time
from transformers import AutoTokenizer
from vllm import LLM, SamplingParams, TokensPrompt
from benchmarks.workload import make_messages
from vbatch.models.loader import resolve_model

num_prompts, max_tokens = int(sys.argv[1]), int(sys.argv[2])
hf_dir = str(resolve_model(None).hf_dir)
tokenizer = AutoTokenizer.from_pretrained(hf_dir)
prompts = []
for messages in make_messages(num_prompts):
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompts.append(TokensPrompt(prompt_token_ids=list(ids["input_ids"] if hasattr(ids, "keys") else ids)))
llm = LLM(model=hf_dir, dtype="bfloat16", enforce_eager=False)
params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
start = time.perf_counter()
outputs = llm.generate(prompts, params)
wall = time.perf_counter() - start
num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
print(f"vLLM: {num_out / wall:.1f} output tok/s, {wall:.1f} s")
PY
