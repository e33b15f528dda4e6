"""Tests for EngineConfig: validation at each limit and from_dict."""

from __future__ import annotations

import pytest

from vbatch.config import EngineConfig
from vbatch.errors import ConfigError


def test_the_defaults_validate_and_each_limit_accepts_its_boundary() -> None:
    EngineConfig().validate()
    edge = {
        "device": "cpu",
        "quantization": "int8",
        "block_size": 16,
        "max_num_batched_tokens": 16,
        "max_num_seqs": 1,
        "max_graph_batch_size": 1,
        "max_model_len": 1,
        "num_kv_blocks": 2,
        "gpu_memory_utilization": 1.0,
        "startup_timeout_s": 1,
        "heartbeat_timeout_s": 1.0,
    }
    config = EngineConfig.from_dict(edge)
    assert {name: getattr(config, name) for name in edge} == edge


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"max_graph_batch_size": 0}, "max_graph_batch_size must be positive"),
        ({"max_num_seqs": 0}, "max_num_seqs must be positive"),
        ({"device": "tpu"}, "device must be one of"),
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype must be one of"),
        ({"block_size": 32, "max_num_batched_tokens": 16}, "at least block_size"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"heartbeat_timeout_s": 0.5}, "heartbeat_timeout_s must be at least 1 second"),
        ({"heartbeat_timeout_s": "60"}, "heartbeat_timeout_s must be a number, got '60'"),
        ({"startup_timeout_s": 0}, "startup_timeout_s must be a positive number"),
        ({"startup_timeout_s": True}, "startup_timeout_s must be a number, got True"),
        ({"max_model_len": "abc"}, "max_model_len must be an integer or null, got 'abc'"),
        ({"max_model_len": 2.5}, "max_model_len must be an integer or null, got 2.5"),
        ({"seed": 1.5}, "seed must be an integer, got 1.5"),
        ({"max_num_seqs": "4"}, "max_num_seqs must be an integer, got '4'"),
        ({"gpu_memory_utilization": "0.5"}, "gpu_memory_utilization must be a number"),
        ({"enable_prefix_caching": 1}, "enable_prefix_caching must be true or false, got 1"),
        ({"max_model_len": 0}, "max_model_len must be positive"),
        ({"kv_cache_memory_gb": 0}, "kv_cache_memory_gb must be a positive number"),
        ({"kv_cache_memory_gb": float("nan")}, "kv_cache_memory_gb must be a positive number"),
        ({"kv_cache_memory_gb": float("inf")}, "kv_cache_memory_gb must be a positive number"),
        ({"num_kv_blocks": 1}, "num_kv_blocks must be at least 2"),
        ({"attention_backend": "flash"}, "attention_backend must be one of"),
        ({"quantization": "int4"}, "quantization must be one of"),
        ({"quantization": "int8", "device": "cuda"}, "int8 quantization runs on CPU only"),
        ({"num_threads": 0}, "num_threads must be from 1 to"),
        ({"num_threads": -1}, "num_threads must be from 1 to"),
        ({"num_threads": 100_000}, "num_threads must be from 1 to .*got 100000"),
        ({"seed": 2**70}, "seed must be a signed 64-bit integer"),
        (
            {"batch_invariant": True, "linear_backend": "torch"},
            "batch_invariant does not go with linear_backend torch",
        ),
        (
            {"batch_invariant": True, "linear_backend": "native", "greedy_screen": True},
            "batch_invariant does not go with the greedy screen, linear_backend native",
        ),
    ],
)
def test_invalid_settings_raise_config_error(values: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_dict(values)


def test_from_dict_rejects_unknown_settings() -> None:
    assert EngineConfig.from_dict({"enforce_eager": True}).enforce_eager
    with pytest.raises(ConfigError, match="unknown engine setting"):
        EngineConfig.from_dict({"enforce_eager": True, "cuda_graphs": False})
    with pytest.raises(ConfigError, match=r"setting\(s\): cuda_graphs, speculative$"):
        EngineConfig.from_dict({"speculative": 1, "cuda_graphs": False})
