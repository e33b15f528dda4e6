"""The device and dtypes an engine core runs with, and its paged KV cache's size and tensors."""

from __future__ import annotations

import psutil
import torch

from vbatch.config import EngineConfig
from vbatch.errors import ConfigError
from vbatch.models.config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_CPU_KV_CACHE_GB = 2.0

KVCache = list[tuple[torch.Tensor, torch.Tensor]]


def select_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' was asked for, but torch sees no CUDA device")
    return torch.device(name)


def select_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is float32 on CPU (bf16 matmul is emulated and far slower there), bf16 on CUDA."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def select_kv_cache_dtype(name: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """`auto` is the model dtype; a narrower cache needs a float32 model on CPU."""
    kv_cache_dtype = dtype if name == "auto" else DTYPES[name]
    # NOTE: only the CPU kernels widen a 16-bit cache under float32 activations.
    if kv_cache_dtype != dtype and (device.type != "cpu" or dtype != torch.float32):
        raise ConfigError(
            f"kv_cache_dtype {name} differs from the model dtype "
            f"{str(dtype).removeprefix('torch.')}, which needs a float32 model on CPU"
        )
    return kv_cache_dtype


def kv_block_bytes(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block: K and V of `block_size` tokens in every layer."""
    mc = model_config
    per_token = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim
    return per_token * block_size * dtype.itemsize


def count_kv_blocks(
    config: EngineConfig, device: torch.device, block_bytes: int, reserved_bytes: int = 0
) -> int:
    """The blocks the configured budget holds: a fixed count, a memory size, the GPU's spare
    memory under gpu_memory_utilization, or on CPU the smaller of 2 GiB and 1/4 of the free RAM
    left after `reserved_bytes` (what the model allocates later: its weights' prepared copies)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if config.kv_cache_memory_gb is not None:
        budget = config.kv_cache_memory_gb * 1024**3
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        # NOTE: keep 10% of the utilisation budget for activations and sampler buffers.
        budget = (total * config.gpu_memory_utilization - used) * 0.9
    else:
        available = max(psutil.virtual_memory().available - reserved_bytes, 0)
        budget = min(DEFAULT_CPU_KV_CACHE_GB * 1024**3, available * 0.25)
    num_blocks = int(budget // block_bytes)
    if num_blocks < 2:
        raise ConfigError(
            f"the KV-cache budget ({budget / 1024**2:.0f} MiB) holds fewer than 2 blocks of "
            f"{block_bytes / 1024**2:.2f} MiB; raise --kv-cache-memory"
        )
    return num_blocks


def allocate_kv_cache(
    model_config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    zeroed: bool,
) -> KVCache:
    """A (K, V) pair per layer, each [num_blocks, block_size, num_kv_heads, head_dim]; `zeroed`
    for readers of slots past a context, else left untouched (no page is written)."""
    shape = (num_blocks, block_size, model_config.num_key_value_heads, model_config.head_dim)
    size = num_blocks * kv_block_bytes(model_config, block_size, dtype)
    what = f"the KV cache ({num_blocks} blocks, {size / 1024**3:.2f} GiB)"
    then = "lower --kv-cache-memory (kv_cache_memory_gb, or num_kv_blocks in the Python API)"
    if device.type == "cpu" and size > (total := psutil.virtual_memory().total):
        raise ConfigError(
            f"{what} exceeds this machine's memory ({total / 1024**3:.1f} GiB); {then}"
        )
    alloc = torch.zeros if zeroed else torch.empty
    try:
        return [
            (alloc(shape, dtype=dtype, device=device), alloc(shape, dtype=dtype, device=device))
            for _ in range(model_config.num_hidden_layers)
        ]
    except RuntimeError as e:  # NOTE: torch.OutOfMemoryError on CUDA is one too
        if "alloc" not in str(e).lower():
            raise
        raise ConfigError(f"cannot allocate {what} on {device.type}; {then}") from None
