"""benchmarks/cuda_attention.py: the float32 reference it checks the CUDA kernel against agrees
with the native CPU op over paged, shuffled blocks, and the benchmark runs on a GPU."""

from __future__ import annotations

import re
import sys

import pytest
import torch

from benchmarks import cuda_attention
from benchmarks.attention_kernels import make_decode_step
from vbatch.layers import native


def test_the_reference_matches_the_native_cpu_op() -> None:
    if not native.is_available():
        pytest.skip("native kernels are unavailable")
    layers, meta = make_decode_step(6, 40, cuda_attention.HEADS, cuda_attention.BLOCK_SIZE, 1)
    q, _, _, k_cache, v_cache = layers[0]
    scale = cuda_attention.HEADS[2] ** -0.5
    out = torch.ops.vbatch.paged_attention(
        q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale, 0,
        0.0, None,
    )  # fmt: skip
    expected = cuda_attention.reference(
        q, k_cache, v_cache, meta.seq_lens.tolist(), meta.block_tables, scale
    )
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    shuffled_k = k_cache[torch.randperm(k_cache.shape[0])]
    wrong = cuda_attention.reference(
        q, shuffled_k, v_cache, meta.seq_lens.tolist(), meta.block_tables, scale
    )
    assert (wrong - out).abs().max() > 1e-2


@pytest.mark.gpu
def test_the_benchmark_runs_and_the_kernel_matches_the_reference(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--num-seqs", "16", "--context", "300", "--num-layers", "2", "--num-steps", "2"]
    monkeypatch.setattr(sys, "argv", ["cuda_attention.py", *args])
    cuda_attention.main()
    out = capsys.readouterr().out
    error = re.search(r"max \|out - float32 reference\| ([\d.e+-]+)$", out, re.M)
    assert error, out
    assert float(error[1]) < 2e-2
