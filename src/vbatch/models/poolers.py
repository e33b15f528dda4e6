"""How an embedding model pools: the checkpoint's sentence-transformers files read into a
`PoolingConfig`, and the pooling itself (CLS, last token, mean or max; Matryoshka; normalize)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from vbatch.errors import ModelLoadError
from vbatch.models.config import read_sentence_bert_config

POOLING_MODES = ("cls", "lasttoken", "mean", "max")
# NOTE: sentence-transformers' module classes by their own name, whatever the module path they
# are saved under (`sentence_transformers.models.Pooling`, and since 6.0
# `sentence_transformers.sentence_transformer.modules.pooling.Pooling`).
_NORMALIZE, _POOLING, _TRANSFORMER = "Normalize", "Pooling", "Transformer"
# 1_Pooling/config.json's switch for each mode
_CONFIG_KEYS = {
    "cls": "pooling_mode_cls_token",
    "lasttoken": "pooling_mode_lasttoken",
    "mean": "pooling_mode_mean_tokens",
    "max": "pooling_mode_max_tokens",
}
_MODES_BY_KEY = {key: mode for mode, key in _CONFIG_KEYS.items()}


@dataclass(frozen=True)
class PoolingConfig:
    """`mode` is one of POOLING_MODES; `normalize` is the default for requests that do not say;
    `max_seq_length`, sentence-transformers' limit on an embedded prompt (None: none)."""

    mode: str
    normalize: bool
    max_seq_length: int | None = None


def read_pooling_config(hf_dir: str | Path, default_mode: str) -> PoolingConfig:
    """The checkpoint's pooling per its `modules.json` and `1_Pooling/config.json`, or
    (`default_mode`, normalized) without them, as vLLM does; modules vbatch cannot run (a Dense
    projection, for instance) are refused rather than skipped."""
    hf_dir = Path(hf_dir)
    max_seq_length = read_sentence_bert_config(hf_dir).max_seq_length
    modules_path = hf_dir / "modules.json"
    if not modules_path.is_file():
        return PoolingConfig(default_mode, True, max_seq_length)
    try:
        modules = json.loads(modules_path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {modules_path}: {e}") from e
    if not isinstance(modules, list) or not all(
        isinstance(m, dict) and isinstance(m.get("path", ""), str) for m in modules
    ):
        raise ModelLoadError(
            f"{modules_path} is not a list of modules ({{'type': ..., 'path': ...}} objects)"
        )
    mode, normalize = default_mode, False
    for module in modules:
        kind = module.get("type", "")
        name = kind.rpartition(".")[2] if kind.startswith("sentence_transformers.") else kind
        if name == _NORMALIZE:
            normalize = True
        elif name == _POOLING:
            mode = _pooling_mode(hf_dir / module.get("path", "1_Pooling") / "config.json")
        elif name != _TRANSFORMER:
            raise ModelLoadError(
                f"{modules_path}: sentence-transformers module {kind!r} is not supported "
                "(vbatch runs Transformer, Pooling and Normalize)"
            )
    return PoolingConfig(mode, normalize, max_seq_length)


def _pooling_mode(path: Path) -> str:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path} is not an object of pooling_mode_* switches")
    # NOTE: every switch that is on, those vbatch has no pooling for (mean_sqrt_len,
    # weightedmean) included: sentence-transformers concatenates the modes it is given.
    modes = [
        _MODES_BY_KEY.get(key, key)
        for key, on in raw.items()
        if on and key.startswith("pooling_mode_")
    ]
    if isinstance(raw.get("pooling_mode"), str):
        modes.append(raw["pooling_mode"])
    if (
        len(modes) != 1
        or modes[0] not in POOLING_MODES
        or raw.get("include_prompt", True) is not True
    ):
        raise ModelLoadError(f"{path}: vbatch pools by exactly one of {POOLING_MODES}, got {raw}")
    return modes[0]


def pool(hidden: torch.Tensor, mode: str) -> torch.Tensor:
    """[num_tokens, hidden] of one prompt → [hidden] float32."""
    if mode == "cls":
        return hidden[0].float()
    if mode == "lasttoken":
        return hidden[-1].float()
    if mode == "mean":
        return hidden.float().mean(0)
    return hidden.float().amax(0)


def finish_embedding(vector: torch.Tensor, dimensions: int | None, normalize: bool) -> torch.Tensor:
    """Matryoshka truncation to the leading `dimensions`, then L2 normalization if asked."""
    if dimensions is not None:
        vector = vector[..., :dimensions]
    return F.normalize(vector, dim=-1) if normalize else vector
