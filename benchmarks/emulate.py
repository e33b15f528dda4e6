"""Run a benchmark (or any module) as on an AVX2-only CPU: the ISA switches of torch, oneDNN,
MKL, FBGEMM and vbatch's own kernels, set for it and the engine cores it spawns.

python -m benchmarks.emulate avx2 benchmarks.e2e --num-prompts 16 ...
python -m benchmarks.emulate avx2 vbatch.cli run examples/prompts.jsonl -o out.jsonl

What each switch does, and what none of them emulates, is in docs/performance.md
("Emulating an AVX2 CPU").
"""

from __future__ import annotations

import os
import sys

AVX2 = {
    "ATEN_CPU_CAPABILITY": "avx2",  # torch's own vectorized kernels
    "ONEDNN_MAX_CPU_ISA": "AVX2",  # oneDNN: _int_mm, and torch's oneDNN matmuls
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",  # MKL: the fp32 GEMMs
    "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",  # FBGEMM: the dynamic quantized linear
    "VBATCH_NATIVE_MARCH": "haswell",  # csrc/, built apart (the target is in its build key)
}
PROFILES = {"avx2": AVX2}


def main() -> None:
    if len(sys.argv) < 3 or sys.argv[1] not in PROFILES:
        sys.exit(f"usage: python -m benchmarks.emulate {{{','.join(PROFILES)}}} MODULE [ARGS...]")
    os.environ.update(PROFILES[sys.argv[1]])
    module, *args = sys.argv[2:]
    os.execv(sys.executable, [sys.executable, "-m", module, *args])


if __name__ == "__main__":
    main()
