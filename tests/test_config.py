"""Tests for EngineConfig: defaults, validation and from_dict."""

from __future__ import annotations

import pytest

from vbatch.config import EngineConfig
from vbatch.errors import ConfigError


def test_defaults_validate_and_capture_graphs() -> None:
    config = EngineConfig().validate()
    assert not config.enforce_eager and config.max_graph_batch_size == 256


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
        ({"heartbeat_timeout_s": "60"}, "heartbeat_timeout_s must be a positive number"),
        ({"startup_timeout_s": 0}, "startup_timeout_s must be a positive number"),
    ],
)
def test_invalid_settings_raise_config_error(values: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_dict(values)


def test_kv_cache_dtype_defaults_to_the_model_dtype() -> None:
    assert EngineConfig().validate().kv_cache_dtype == "auto"
    assert EngineConfig.from_dict({"kv_cache_dtype": "bfloat16"}).kv_cache_dtype == "bfloat16"


def test_from_dict_rejects_unknown_settings() -> None:
    assert EngineConfig.from_dict({"enforce_eager": True}).enforce_eager
    with pytest.raises(ConfigError, match="unknown engine setting"):
        EngineConfig.from_dict({"enforce_eager": True, "cuda_graphs": False})
