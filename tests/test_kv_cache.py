"""Tests for device and dtype choice and for the KV cache's size and tensors."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from vbatch.config import EngineConfig
from vbatch.engine import kv_cache
from vbatch.engine.kv_cache import (
    allocate_kv_cache,
    count_kv_blocks,
    kv_block_bytes,
    select_device,
    select_dtype,
    select_kv_cache_dtype,
)
from vbatch.errors import ConfigError
from vbatch.models.config import ModelConfig

CPU = torch.device("cpu")


def test_auto_dtype_is_float32_on_cpu() -> None:
    # NOTE: bf16 matmul on a CPU without bf16 units is 50-400x slower than fp32.
    assert select_dtype("auto", CPU) == torch.float32
    assert select_dtype("bfloat16", CPU) == torch.bfloat16
    assert select_dtype("float32", CPU) == torch.float32


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_without_a_device_is_a_config_error() -> None:
    assert select_device("auto") == CPU
    with pytest.raises(ConfigError, match="no CUDA device"):
        select_device("cuda")


def test_a_narrow_kv_cache_needs_a_float32_model_on_cpu() -> None:
    assert select_kv_cache_dtype("auto", torch.bfloat16, CPU) == torch.bfloat16
    assert select_kv_cache_dtype("bfloat16", torch.float32, CPU) == torch.bfloat16
    with pytest.raises(ConfigError, match="needs a float32 model on CPU"):
        select_kv_cache_dtype("float16", torch.bfloat16, CPU)
    with pytest.raises(ConfigError, match="needs a float32 model on CPU"):
        select_kv_cache_dtype("bfloat16", torch.float32, torch.device("cuda"))


def test_block_count_follows_the_budget(tiny_model_dir: Path) -> None:
    model_config = ModelConfig.from_hf_dir(tiny_model_dir)
    block_bytes = kv_block_bytes(model_config, 16, torch.float32)
    mc = model_config
    assert block_bytes == 2 * mc.num_hidden_layers * 16 * mc.num_key_value_heads * mc.head_dim * 4
    assert kv_block_bytes(model_config, 16, torch.bfloat16) * 2 == block_bytes
    base = EngineConfig(model=str(tiny_model_dir), device="cpu")
    fixed = dataclasses.replace(base, num_kv_blocks=7)
    assert count_kv_blocks(fixed, CPU, block_bytes) == 7
    sized = dataclasses.replace(base, kv_cache_memory_gb=64 * block_bytes / 1024**3)
    assert count_kv_blocks(sized, CPU, block_bytes) == 64
    assert 2 <= count_kv_blocks(base, CPU, block_bytes) <= 2 * 1024**3 // block_bytes
    tiny = dataclasses.replace(base, kv_cache_memory_gb=block_bytes / 1024**3)
    with pytest.raises(ConfigError, match=r"fewer than 2 blocks.*--kv-cache-memory"):
        count_kv_blocks(tiny, CPU, block_bytes)


def test_the_cpu_budget_leaves_out_the_ram_reserved_for_later_copies(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    block_bytes = 1024**2
    gib = 1024**3

    class Free:
        available = 6 * gib

    monkeypatch.setattr(kv_cache.psutil, "virtual_memory", lambda: Free())
    base = EngineConfig(model=str(tiny_model_dir), device="cpu")
    assert count_kv_blocks(base, CPU, block_bytes) == 1536
    assert count_kv_blocks(base, CPU, block_bytes, reserved_bytes=2 * gib) == 1024
    with pytest.raises(ConfigError, match="fewer than 2 blocks"):
        count_kv_blocks(base, CPU, block_bytes, reserved_bytes=7 * gib)


def test_allocated_cache_has_a_pair_per_layer(tiny_model_dir: Path) -> None:
    model_config = ModelConfig.from_hf_dir(tiny_model_dir)
    cache = allocate_kv_cache(model_config, 5, 16, torch.bfloat16, CPU, zeroed=True)
    assert len(cache) == model_config.num_hidden_layers
    shape = (5, 16, model_config.num_key_value_heads, model_config.head_dim)
    for k, v in cache:
        assert k.shape == v.shape == shape and k.dtype == torch.bfloat16
        assert not k.any() and not v.any() and k.data_ptr() != v.data_ptr()
