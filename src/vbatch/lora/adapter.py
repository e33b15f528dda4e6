"""A PEFT LoRA adapter directory's settings (`adapter_config.json`), checked; torch-free."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vbatch.errors import LoraError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
DEFAULT_MAX_LORA_RANK = 64
# NOTE: the modules vbatch applies adapters to; PEFT names them as the checkpoint does (Phi-3's
# are already fused).
SUPPORTED_MODULES = frozenset(
    {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "qkv_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "gate_up_proj",
    }
)
_ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class AdapterConfig:
    """What vbatch takes from an adapter's config: rank, alpha, rsLoRA; `scaling` multiplies
    B·A as PEFT's LoraLayer does (alpha / r, or alpha / sqrt(r) with rsLoRA), for a module of
    rank r."""

    name: str
    path: Path
    rank: int
    lora_alpha: float
    use_rslora: bool
    # NOTE: as adapter_config.json gives them: a list of module names, a regex, "all-linear".
    target_modules: list[str] | str | None = None
    rank_pattern: dict[str, int] = field(default_factory=dict)

    def scaling(self, rank: int) -> float:
        return self.lora_alpha / (math.sqrt(rank) if self.use_rslora else rank)

    def targets(self, module: str) -> bool:
        """Whether PEFT puts a LoRA layer on `module` (a dotted name under the base model): a
        listed name equal to it or to its trailing parts, a regex matching it whole."""
        targets = self.target_modules
        if targets is None or targets == _ALL_LINEAR:
            return True
        if isinstance(targets, str):
            return re.fullmatch(targets, module) is not None
        return any(module == t or module.endswith(f".{t}") for t in targets)

    def rank_of(self, module: str) -> int:
        """The rank adapter_config.json gives `module`: its rank_pattern entry, else r."""
        for pattern, rank in self.rank_pattern.items():
            if re.match(rf"(.*\.)?({pattern})$", module):
                return rank
        return self.rank

    @property
    def files(self) -> list[Path]:
        return [self.path / CONFIG_FILE, self.path / WEIGHTS_FILE]


def read_adapter_config(name: str, path: str | Path, max_lora_rank: int) -> AdapterConfig:
    """The adapter at `path`, or a one-line LoraError naming it: a missing file, or anything
    but plain LoRA on the attention and MLP projections (DoRA, embedding or LM-head adapters,
    trained biases, per-module alphas), or a rank above `max_lora_rank`."""
    root = Path(path)

    def fail(reason: str) -> LoraError:
        return LoraError(f"LoRA adapter {name!r} ({root}): {reason}")

    if not (root / CONFIG_FILE).is_file():
        raise fail(f"no {CONFIG_FILE} there")
    if not (root / WEIGHTS_FILE).is_file():
        raise fail(f"no {WEIGHTS_FILE} there (vbatch reads safetensors adapters only)")
    try:
        raw: dict[str, Any] = json.loads((root / CONFIG_FILE).read_text())
    except (OSError, ValueError) as e:
        raise fail(f"unreadable {CONFIG_FILE}: {e}") from e
    if not isinstance(raw, dict):
        raise fail(f"{CONFIG_FILE} is not a JSON object")
    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise fail(f"peft_type is {peft_type}; vbatch runs LoRA adapters only")
    if raw.get("use_dora"):
        raise fail("DoRA adapters (use_dora) are not supported")
    if raw.get("modules_to_save"):
        raise fail(
            f"modules_to_save {raw['modules_to_save']} (full trained modules) is not supported"
        )
    if raw.get("bias", "none") != "none" or raw.get("lora_bias"):
        raise fail("adapters with trained biases are not supported")
    # NOTE: before alpha_pattern, which PEFT writes itself for the experts' target_parameters.
    if raw.get("target_parameters"):
        raise fail(
            f"target_parameters {raw['target_parameters']} (adapters on parameters such as MoE "
            "experts or routers) are not supported; vbatch adapts linear modules only"
        )
    if raw.get("trainable_token_indices"):
        raise fail("trainable_token_indices (trained token embeddings) is not supported")
    if raw.get("alpha_pattern"):
        raise fail("per-module lora_alpha (alpha_pattern) is not supported")
    if raw.get("fan_in_fan_out"):
        raise fail("fan_in_fan_out adapters (Conv1D layers) are not supported")
    targets = raw.get("target_modules")
    if isinstance(targets, list):
        # NOTE: as PEFT matches them: a dotted path ("model.layers.0.self_attn.q_proj", as
        # PEFT writes "all-linear" out) names the module of its last part.
        unknown = sorted(
            t for t in set(targets) if str(t).rpartition(".")[2] not in SUPPORTED_MODULES
        )
        if unknown:
            raise fail(
                f"targets {', '.join(unknown)}; vbatch applies adapters to "
                f"{', '.join(sorted(SUPPORTED_MODULES))} only"
            )
    elif targets is not None and targets != _ALL_LINEAR and not isinstance(targets, str):
        raise fail(f"target_modules {targets!r} is neither a list nor a pattern")
    if isinstance(targets, str) and targets != _ALL_LINEAR:
        try:
            re.compile(targets)
        except re.error as e:
            raise fail(f"target_modules {targets!r} is not a valid pattern: {e}") from None
    rank = raw.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise fail(f"r must be a positive integer, got {rank!r}")
    rank_pattern = raw.get("rank_pattern") or {}
    if not isinstance(rank_pattern, dict) or not all(
        isinstance(r, int) and not isinstance(r, bool) and r >= 1 for r in rank_pattern.values()
    ):
        raise fail(f"rank_pattern must map module patterns to positive ranks, got {rank_pattern!r}")
    ranks = [rank, *rank_pattern.values()]
    if max(ranks) > max_lora_rank:
        raise fail(f"rank {max(ranks)} is above max_lora_rank {max_lora_rank}")
    alpha = raw.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise fail(f"lora_alpha must be a number, got {alpha!r}")
    return AdapterConfig(
        name,
        root,
        rank,
        float(alpha),
        bool(raw.get("use_rslora", False)),
        list(targets) if isinstance(targets, list) else targets,
        dict(rank_pattern),
    )


def parse_lora_option(value: str) -> tuple[str, str]:
    """`NAME=PATH` (the CLI's --lora) as (name, path)."""
    name, sep, path = value.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise LoraError(f"--lora takes NAME=PATH, got {value!r}")
    return name.strip(), str(Path(path.strip()).expanduser().absolute())
