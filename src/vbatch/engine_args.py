"""vLLM's `LLM(...)` arguments and `EngineArgs` mapped onto vbatch's engine settings, and the
default sampling parameters from a model's generation_config.json."""

from __future__ import annotations

import argparse
import json
import os
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from vbatch.config import EngineConfig
from vbatch.errors import ConfigError, SamplingParamsError
from vbatch.sampling_params import SamplingParams

# NOTE: arguments of vLLM's LLM/EngineArgs that change nothing vbatch does; accepted and
# ignored with one warning naming them.
VLLM_ONLY = frozenset(
    {
        "swap_space",
        "cpu_offload_gb",
        "disable_custom_all_reduce",
        "tokenizer_mode",
        "download_dir",
        "load_format",
        "max_seq_len_to_capture",
        "disable_async_output_proc",
        "compilation_config",
        "distributed_executor_backend",
        "hf_token",
        "max_logprobs",
        "guided_decoding_backend",
        "structured_outputs_config",
        "logprobs_mode",
        "scheduling_policy",
        "kv_transfer_config",
        "worker_cls",
        "trust_remote_code",
        "enable_chunked_prefill",
        "disable_log_stats",
        "allowed_local_media_path",
        "limit_mm_per_prompt",
        "mm_processor_kwargs",
        "task",
        "runner",
    }
)
# NOTE: values that vbatch honours as it is, so they pass without a warning (the API logs no
# stats, and every prefill is chunked).
_QUIET_VALUES: dict[str, tuple[Any, ...]] = {
    "disable_log_stats": (True, False),
    "enable_chunked_prefill": (True,),
    "task": ("generate", "auto"),
    "runner": ("generate", "auto"),
    "trust_remote_code": (False,),
}
DTYPE_NAMES = {
    "auto": "auto",
    "half": "float16",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float": "float32",
    "float32": "float32",
}
_RENAMED = {"num_gpu_blocks_override": "num_kv_blocks"}
_REFUSED = {
    "tensor_parallel_size": "vbatch runs one whole model per engine core; for more throughput "
    "run data_parallel_size=N cores (the CLI's -dp N)",
    "pipeline_parallel_size": "vbatch runs one whole model per engine core; use "
    "data_parallel_size=N (the CLI's -dp N)",
    "revision": "name the revision in the model id instead: model='org/name@revision'",
    "speculative_config": "vbatch has no speculative decoding",
}
GENERATION_CONFIG_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


@dataclass
class LLMSettings:
    """What `LLM(...)`'s keyword arguments come to: engine settings and the LLM's own."""

    engine: dict[str, Any]
    tokenizer: str | None = None
    generation_config: str = "auto"


def map_llm_args(args: dict[str, Any], llm_params: frozenset[str]) -> LLMSettings:
    """vLLM's and vbatch's `LLM` keyword arguments (other than `llm_params`, the LLM's own) to
    engine settings; raises ConfigError naming the vbatch equivalent or the accepted names."""
    engine_fields = {f.name for f in fields(EngineConfig)} - {"model"}
    settings = LLMSettings(engine={})
    ignored = []
    for name, value in args.items():
        if name in _REFUSED:
            if name in ("tensor_parallel_size", "pipeline_parallel_size") and value in (1, None):
                continue
            if name in ("revision", "speculative_config") and value is None:
                continue
            raise ConfigError(f"{name}={value!r} is not supported: {_REFUSED[name]}")
        if name == "tokenizer":
            settings.tokenizer = value
        elif name == "generation_config":
            settings.generation_config = _generation_config(value)
        elif name == "dtype":
            settings.engine["dtype"] = _dtype(value)
        elif name == "seed":
            if value is not None:
                settings.engine["seed"] = value
        elif name in _RENAMED:
            if value is not None:
                settings.engine[_RENAMED[name]] = value
        elif name in engine_fields:
            if value is not None:
                settings.engine[name] = value
        elif name in VLLM_ONLY:
            if value is not None and value not in _QUIET_VALUES.get(name, ()):
                ignored.append(name)
        else:
            accepted = sorted(
                engine_fields
                | llm_params
                | set(_RENAMED)
                | {"tokenizer", "generation_config", "dtype", "seed"}
                | set(_REFUSED)
            )
            raise ConfigError(
                f"unknown LLM argument {name!r}; accepted: {', '.join(accepted)} "
                f"(and vLLM-only settings vbatch ignores: {', '.join(sorted(VLLM_ONLY))})"
            )
    if ignored:
        warnings.warn(
            f"vbatch ignores these vLLM settings, which change nothing here: {', '.join(ignored)}",
            stacklevel=3,
        )
    return settings


def _generation_config(value: Any) -> str:
    """ "auto", "vllm" or a folder; None, older vLLM's default, is its "use none" ("vllm")."""
    if value is None:
        return "vllm"
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if not isinstance(value, str):
        raise ConfigError(
            f"generation_config must be 'auto', 'vllm' or a folder holding "
            f"generation_config.json, got {value!r:.80}"
        )
    return value


def _dtype(value: Any) -> str:
    name = str(value).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {value!r}")
    return DTYPE_NAMES[name]


def default_sampling_params(hf_dir: Path, generation_config: str) -> SamplingParams:
    """SamplingParams with the model's generation_config.json defaults (as vLLM's "auto"):
    temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens where it sets them.
    `generation_config` "vllm" (or "vbatch") ignores the file; another value names a folder."""
    if generation_config in ("vllm", "vbatch"):
        return SamplingParams()
    folder = hf_dir if generation_config == "auto" else Path(generation_config)
    path = folder / "generation_config.json"
    if not path.is_file():
        if generation_config != "auto":
            raise ConfigError(f"generation_config: no generation_config.json in {folder}")
        return SamplingParams()
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} is not a JSON object")
    values = {ours: raw[key] for key, ours in GENERATION_CONFIG_KEYS.items() if key in raw}
    try:
        return SamplingParams.from_dict(values)
    except SamplingParamsError as e:
        raise ConfigError(
            f"{path}: its sampling defaults are invalid ({e}); fix the file, or ignore it with "
            'generation_config="vllm"'
        ) from None


@dataclass
class EngineArgs:
    """vLLM's `EngineArgs` for scripts: `EngineArgs.add_cli_args(parser)` adds these fields as
    flags, and `LLM(**vars(parser.parse_args()))` takes them back."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.85
    enforce_eager: bool = False
    seed: int | None = None
    enable_prefix_caching: bool = True
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    trust_remote_code: bool = False
    disable_log_stats: bool = False
    generation_config: str = "auto"
    device: str = "auto"
    block_size: int | None = None
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    num_gpu_blocks_override: int | None = None
    async_scheduling: bool = False
    pipeline_parallel_size: int = 1

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        group = parser.add_argument_group("engine (vbatch.EngineArgs)")
        for f in fields(EngineArgs):
            flag = "--" + f.name.replace("_", "-")
            default = f.default
            if isinstance(default, bool):
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
            else:
                kind = {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
                group.add_argument(flag, type=kind, default=default)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
