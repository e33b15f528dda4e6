"""Tests for ModelRunner: step batch building, 16-bit KV caches, and the CUDA path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vbatch.config import EngineConfig
from vbatch.engine.model_runner import ModelRunner
from vbatch.engine.sequence import Sequence
from vbatch.engine.steps import SchedulerOutput
from vbatch.errors import ConfigError
from vbatch.models.config import ModelConfig
from vbatch.models.loader import resolve_model
from vbatch.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_runner(model_dir: Path, device: str = "cpu", **overrides: object) -> ModelRunner:
    config = EngineConfig(
        model=str(model_dir), device=device, block_size=BLOCK_SIZE, num_kv_blocks=64, **overrides
    ).validate()
    resolved = resolve_model(config.model)
    return ModelRunner(config, resolved, ModelConfig.from_hf_dir(resolved.hf_dir))


def make_seq(token_ids: list[int], num_computed: int, block_table: list[int]) -> Sequence:
    seq = Sequence("r", token_ids, SamplingParams(temperature=0.0, max_tokens=8), 0)
    seq.num_computed_tokens = num_computed
    seq.block_table.extend(block_table)
    return seq


def mixed_batch() -> SchedulerOutput:
    """A decode at context 6, a prefill chunk that samples, and one that does not."""
    decode = make_seq([5, 6, 7, 8, 9, 10], 5, [9, 3])
    last_chunk = make_seq([11, 12, 13, 14, 15], 2, [7, 1])
    first_chunk = make_seq(list(range(20, 30)), 0, [4])
    return SchedulerOutput(seqs=[decode, last_chunk, first_chunk], num_new_tokens=[1, 3, 4])


def test_prepare_builds_flat_batch(tiny_model_dir: Path) -> None:
    runner = make_runner(tiny_model_dir)
    assert runner.dtype == torch.float32
    inputs = runner.prepare(mixed_batch())
    assert inputs.input_ids.tolist() == [10, 13, 14, 15, 20, 21, 22, 23]
    assert inputs.positions.tolist() == [5, 2, 3, 4, 0, 1, 2, 3]
    meta = inputs.meta
    assert meta.block_tables.tolist() == [[9, 3], [7, 1], [4, 0]]
    # slot = block_table[pos // 4] * 4 + pos % 4
    assert meta.slot_mapping.tolist() == [13, 30, 31, 4, 16, 17, 18, 19]
    assert meta.query_start_loc.tolist() == [0, 1, 4, 8]
    assert meta.seq_lens.tolist() == [6, 5, 4]
    assert (meta.max_query_len, meta.max_seq_len) == (4, 6)
    assert inputs.sample_rows == [0, 1]
    assert inputs.logits_rows.tolist() == [0, 3]


def test_execute_decode_batch_samples_each_seq(tiny_model_dir: Path) -> None:
    runner = make_runner(tiny_model_dir)
    seqs = [make_seq([3, 4, 5], 0, [i]) for i in range(3)]
    token_ids, _ = runner.execute(SchedulerOutput(seqs=seqs, num_new_tokens=[3, 3, 3]))
    assert len(token_ids) == 3 and len(set(token_ids)) == 1
    for seq, token_id in zip(seqs, token_ids, strict=True):
        seq.num_computed_tokens = 3
        seq.append_token(token_id)
    decoded, _ = runner.execute(SchedulerOutput(seqs=seqs, num_new_tokens=[1, 1, 1]))
    assert len(decoded) == 3 and len(set(decoded)) == 1


def step_logits(runner: ModelRunner, out: SchedulerOutput) -> torch.Tensor:
    """[num_sampling_seqs, vocab_size] float32 logits of one forward over `out`."""
    inputs = runner.prepare(out)
    with torch.inference_mode():
        hidden = runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta)
        return runner.model.compute_logits(hidden.index_select(0, inputs.logits_rows))


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "float16"])
def test_16bit_kv_cache_stays_close_to_float32(
    tiny_model_dir: Path, backend: str, kv_cache_dtype: str
) -> None:
    exact = make_runner(tiny_model_dir, attention_backend=backend)
    narrow = make_runner(tiny_model_dir, attention_backend=backend, kv_cache_dtype=kv_cache_dtype)
    assert exact.kv_caches[0][0].dtype == torch.float32
    assert narrow.dtype == torch.float32
    assert narrow.kv_caches[0][0].dtype == narrow.kv_caches[-1][1].dtype == narrow.kv_cache_dtype
    assert narrow.kv_cache_dtype == getattr(torch, kv_cache_dtype)
    assert 2 * narrow.block_bytes == exact.block_bytes
    # a prefill chunk longer than the native op takes (SDPA) and a short one, then decodes
    prompts = [list(range(40, 52)), [7, 8, 9, 10, 11]]
    seqs = {
        name: [
            make_seq(list(p), 0, [3 * i, 3 * i + 1, 3 * i + 2, 3 * i + 3])
            for i, p in enumerate(prompts)
        ]
        for name in ("exact", "narrow")
    }
    num_new = [len(p) for p in prompts]
    tolerance = 5e-3 if kv_cache_dtype == "bfloat16" else 1e-3
    for _ in range(4):
        logits = step_logits(exact, SchedulerOutput(seqs=seqs["exact"], num_new_tokens=num_new))
        narrow_logits = step_logits(
            narrow, SchedulerOutput(seqs=seqs["narrow"], num_new_tokens=num_new)
        )
        scale = logits.abs().max().item()
        assert (narrow_logits - logits).abs().max().item() < tolerance * scale
        for name in seqs:
            for seq, token_id, n in zip(
                seqs[name], logits.argmax(-1).tolist(), num_new, strict=True
            ):
                seq.num_computed_tokens += n
                seq.append_token(token_id)
        num_new = [1, 1]
    token_ids, _ = narrow.execute(SchedulerOutput(seqs=seqs["narrow"], num_new_tokens=num_new))
    assert len(token_ids) == 2


def test_kv_cache_dtype_other_than_model_dtype_needs_float32_model(tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="needs a float32 model on CPU"):
        make_runner(tiny_model_dir, dtype="bfloat16", kv_cache_dtype="float16")
    runner = make_runner(tiny_model_dir, dtype="bfloat16", kv_cache_dtype="bfloat16")
    assert runner.kv_caches[0][0].dtype == torch.bfloat16


@pytest.mark.gpu
def test_cuda_step_matches_cpu(tiny_model_dir: Path) -> None:
    cpu, cuda = make_runner(tiny_model_dir), make_runner(tiny_model_dir, "cuda")
    assert cuda.dtype in (torch.bfloat16, torch.float16)
    batch = mixed_batch()
    inputs = cuda.prepare(batch)
    assert inputs.input_ids.is_cuda and inputs.meta.block_tables.is_cuda
    assert inputs.logits_rows.tolist() == cpu.prepare(batch).logits_rows.tolist()
    # NOTE: a second step reuses the pinned staging buffers; its inputs must be its own.
    decode = make_seq([1, 2, 3], 2, [5])
    assert cuda.prepare(SchedulerOutput(seqs=[decode], num_new_tokens=[1])).input_ids.tolist() == [
        3
    ]
    token_ids, _ = cuda.execute(mixed_batch())
    assert len(token_ids) == 2
