"""EngineConfig: frozen engine settings shared by the client and the engine core."""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from dataclasses import dataclass
from enum import Enum
from typing import Any

from vbatch.errors import ConfigError


class Device(str, Enum):
    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


class Dtype(str, Enum):
    AUTO = "auto"
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class AttentionBackend(str, Enum):
    AUTO = "auto"
    TORCH = "torch"
    NATIVE = "native"


class Quantization(str, Enum):
    INT8 = "int8"


class LinearBackend(str, Enum):
    AUTO = "auto"
    TORCH = "torch"
    ONEDNN = "onednn"
    NATIVE = "native"


DEVICES = tuple(c.value for c in Device)
DTYPES = tuple(c.value for c in Dtype)
KV_CACHE_DTYPES = DTYPES
ATTENTION_BACKENDS = tuple(c.value for c in AttentionBackend)
QUANTIZATION_METHODS = tuple(c.value for c in Quantization)
LINEAR_BACKENDS = tuple(c.value for c in LinearBackend)


@dataclass(frozen=True)
class CorePlacement:
    """Where one engine core of several runs: the CPUs it is pinned to and the GPUs it sees
    (`CUDA_VISIBLE_DEVICES`); None leaves the parent's."""

    cpus: tuple[int, ...] | None = None
    cuda_visible_devices: str | None = None


# NOTE: the hang rules (client/core_client.py `_hang`). A loop iteration past the heartbeat
# timeout that used less than IDLE_CPU_FRACTION of its time on the CPU is a hang. A computing
# step may run SLOW_STEP_FACTOR times what the slowest measured seconds per token predict for a
# full step (max_num_batched_tokens), never less than the heartbeat timeout; before any step was
# measured, FIRST_STEP_FACTOR times the heartbeat timeout.
IDLE_CPU_FRACTION = 0.05
# NOTE: num_threads' ceiling: THREADS_PER_CPU a CPU, and never below MAX_THREADS (a Ray replica's
# node may have more CPUs than the machine that checks its settings).
THREADS_PER_CPU = 8
MAX_THREADS = 256
SLOW_STEP_FACTOR = 8.0
FIRST_STEP_FACTOR = 10.0


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine core needs to start. `model` is a resolved path (HF dir or GGUF).

    Invariants after validate(): limits are positive; `max_num_batched_tokens >= block_size`.
    On CUDA, decode steps of up to min(max_num_seqs, max_graph_batch_size) sequences replay
    captured CUDA graphs unless `enforce_eager`; other devices always run eagerly.
    `kv_cache_dtype` "auto" stores K/V in the model dtype; a 16-bit one under a float32 model
    (CPU only) halves the cache's bytes at a small cost in accuracy. `greedy_screen` finds
    plain-greedy tokens on CPU through an int8 screen of the LM head with fp32 rescoring of the
    few candidates it cannot rule out (the same tokens as the fp32 head); False scores the whole
    vocabulary in fp32; None (auto) times both on the model's head at start-up and takes the
    faster (layers/kernel_choice.py, cached per machine). `linear_backend` picks the GEMM library
    of the float32 CPU linears and LM head: "auto" times torch's (MKL), oneDNN's and the native
    packed kernel on the model's shapes at a few row counts at start-up and takes the fastest per
    projection and row count (layers/linear_choice.py, cached per machine); "torch", "onednn" or
    "native" force one.
    `async_scheduling` launches a decode
    step that continues the last one before the last one's tokens reach the host (overlap on a
    GPU; nothing to gain on CPU). `batch_invariant` (CPU, float32, native attention) computes
    every row of a step as in any other batch (layers/batch_invariant.py), so a seeded request
    gives the same bits alone, in any batch, and after a prefix-cache hit; it costs speed and
    takes neither int8 quantization, LoRA, mixture-of-experts models nor the greedy screen.
    After READY the core is declared hung, killed, and EngineDeadError raised when it sends no
    heartbeat for `heartbeat_timeout_s` seconds, when one iteration of its busy loop (one step)
    lasts that long without using the CPU, or when a computing step outlasts the limit sized from
    the step times measured so far (see SLOW_STEP_FACTOR). Before READY, `startup_timeout_s`
    applies instead.
    """

    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    kv_cache_memory_gb: float | None = None
    gpu_memory_utilization: float = 0.85
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    quantization: str | None = None
    num_threads: int | None = None
    seed: int = 0
    enforce_eager: bool = False
    greedy_screen: bool | None = None
    linear_backend: str = "auto"
    async_scheduling: bool = False
    batch_invariant: bool = False
    max_graph_batch_size: int = 256
    startup_timeout_s: float = 600.0
    heartbeat_timeout_s: float = 120.0
    enable_lora: bool = False
    max_loras: int = 8
    max_lora_rank: int = 64
    # NOTE: (name, path) of the adapters the core loads at start-up, with ids 1, 2, ... in order.
    loras: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        # NOTE: a manifest's JSON gives lists.
        object.__setattr__(self, "loras", tuple((str(n), str(p)) for n, p in self.loras))

    def _check_types(self) -> None:
        """Raise ConfigError for a field whose value is not of its declared type (a bool is not
        an integer, an integer is a float), before any range check compares it."""
        hints = typing.get_type_hints(type(self))
        for field in dataclasses.fields(self):
            hint = hints[field.name]
            kinds = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
            if not all(kind in _SCALARS for kind in kinds):
                continue
            value = getattr(self, field.name)
            if not any(_is_a(value, kind) for kind in kinds):
                names = " or ".join(_SCALARS[kind] for kind in kinds)
                raise ConfigError(f"{field.name} must be {names}, got {value!r:.80}")

    def validate(self) -> EngineConfig:
        self._check_types()
        if self.device not in DEVICES:
            raise ConfigError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                f"got {self.attention_backend!r}"
            )
        for name in (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_graph_batch_size",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_num_batched_tokens < self.block_size:
            raise ConfigError("max_num_batched_tokens must be at least block_size")
        if self.num_threads is not None:
            most = max(MAX_THREADS, THREADS_PER_CPU * (os.cpu_count() or 1))
            if not 1 <= self.num_threads <= most:
                raise ConfigError(
                    f"num_threads must be from 1 to {most} ({THREADS_PER_CPU} per CPU here; more "
                    f"only slow a step down, and torch crashes at very large counts), got "
                    f"{self.num_threads}"
                )
        if not -(2**63) <= self.seed < 2**63:
            raise ConfigError(f"seed must be a signed 64-bit integer, got {self.seed}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be positive, got {self.max_model_len}")
        memory = self.kv_cache_memory_gb
        if memory is not None and (
            isinstance(memory, bool)
            or not isinstance(memory, (int, float))
            or not 0 < memory < math.inf
        ):
            raise ConfigError(f"kv_cache_memory_gb must be a positive number, got {memory!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ConfigError(f"num_kv_blocks must be at least 2, got {self.num_kv_blocks}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ConfigError(
                f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, "
                f"got {self.quantization!r}"
            )
        if self.quantization is not None and self.device == "cuda":
            raise ConfigError(f"{self.quantization} quantization runs on CPU only")
        for name in ("startup_timeout_s", "heartbeat_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
        if self.heartbeat_timeout_s < 1.0:
            # NOTE: the core sends a heartbeat every 0.25-1 s.
            raise ConfigError(
                f"heartbeat_timeout_s must be at least 1 second, got {self.heartbeat_timeout_s}"
            )
        if self.loras and not self.enable_lora:
            raise ConfigError("LoRA adapters were given but enable_lora is off")
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        names = [name for name, _ in self.loras]
        if len(set(names)) != len(names):
            raise ConfigError(f"LoRA adapter names must be distinct, got {', '.join(names)}")
        if self.linear_backend not in LINEAR_BACKENDS:
            raise ConfigError(
                f"linear_backend must be one of {', '.join(LINEAR_BACKENDS)}, "
                f"got {self.linear_backend!r}"
            )
        if self.greedy_screen not in (None, True, False):
            raise ConfigError(
                f"greedy_screen must be true, false or null (auto), got {self.greedy_screen!r}"
            )
        if self.batch_invariant:
            refused = {
                "device cuda": self.device == "cuda",
                f"quantization {self.quantization}": self.quantization is not None,
                "enable_lora": self.enable_lora,
                "the greedy screen": self.greedy_screen is True,
                f"attention_backend {self.attention_backend}": self.attention_backend == "torch",
                # NOTE: its linears are oneDNN's, row by row as in any batch.
                f"linear_backend {self.linear_backend}": self.linear_backend in ("torch", "native"),
            }
            if any(refused.values()):
                names = ", ".join(name for name, on in refused.items() if on)
                raise ConfigError(f"batch_invariant does not go with {names}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("gpu_memory_utilization must be in (0, 1]")
        return self

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> EngineConfig:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown engine setting(s): {', '.join(unknown)}")
        return cls(**values).validate()


_SCALARS: dict[object, str] = {
    int: "an integer",
    float: "a number",
    bool: "true or false",
    str: "a string",
    type(None): "null",
}


def _is_a(value: object, kind: object) -> bool:
    if kind is type(None):
        return value is None
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind is float:
        return isinstance(value, (int, float))
    return isinstance(value, kind)  # type: ignore[arg-type]


def resolve_max_model_len(requested: int | None, model_max: int, limit_name: str) -> int:
    """The engine's maximum sequence length: `requested`, or the model's `model_max` (its
    `limit_name` in config.json) when None; more than the model can place is a ConfigError, as
    in vLLM, rather than a silent cap."""
    if requested is None:
        return model_max
    if requested > model_max:
        raise ConfigError(
            f"max_model_len {requested} is more than the model's {limit_name} of {model_max}"
        )
    return requested
