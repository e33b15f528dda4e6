"""A PEFT adapter's tensors read onto our decoder's projections (fused q/k/v and gate/up)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from safetensors import SafetensorError, safe_open

from vbatch.errors import LoraError
from vbatch.lora.adapter import WEIGHTS_FILE, AdapterConfig
from vbatch.models.config import ModelConfig
from vbatch.models.weights import param_target

_PEFT_PREFIX = "base_model.model."
_LORA_SUFFIXES = {".lora_A.weight": "a", ".lora_B.weight": "b"}


@dataclass(frozen=True)
class LoraPiece:
    """One adapted checkpoint module inside our projection: it adds `scaled_b @ a @ x` to
    output rows `row_start : row_start + scaled_b.shape[0]`."""

    row_start: int
    a: torch.Tensor  # [rank, in_features] float32
    scaled_b: torch.Tensor  # [out_rows, rank] float32, B times the adapter's scaling


def read_adapter_weights(
    adapter: AdapterConfig,
    model_config: ModelConfig,
    shapes: dict[str, tuple[int, int]],
    max_lora_rank: int,
) -> dict[str, list[LoraPiece]]:
    """Our projection name (`layers.0.self_attn.qkv_proj`) → its pieces, ordered by row; each
    checked against `shapes` (projection → (in_features, out_features)), else a one-line
    LoraError naming the adapter (an adapter made for another model fails here)."""

    def fail(reason: str) -> LoraError:
        return LoraError(f"LoRA adapter {adapter.name!r} ({adapter.path}): {reason}")

    halves: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(adapter.path / WEIGHTS_FILE), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118
                module, part = _split_key(key)
                if part is None:
                    raise fail(f"tensor {key} is not a LoRA A/B matrix (DoRA, embedding?)")
                halves.setdefault(module, {})[part] = f.get_tensor(key).float()
    except (OSError, RuntimeError, ValueError, SafetensorError) as e:
        raise fail(f"cannot read {WEIGHTS_FILE}: {e}") from e
    if not halves:
        raise fail(f"{WEIGHTS_FILE} holds no LoRA tensors")
    pieces: dict[str, list[LoraPiece]] = {}
    for module, ab in sorted(halves.items()):
        if set(ab) != {"a", "b"}:
            raise fail(f"{module} has lora_{'A' if 'a' in ab else 'B'} without its pair")
        a, b = ab["a"], ab["b"]
        target = param_target(module + ".weight", model_config)
        projection = None if target is None else target.name.removesuffix(".weight")
        if target is None or target.expert is not None or projection not in shapes:
            raise fail(
                f"adapts {module}, which is not an attention or dense MLP projection of this "
                "model (vbatch adapts q, k, v, o, gate, up and down)"
            )
        if not adapter.targets(module):
            raise fail(
                f"holds LoRA weights for {module}, which its target_modules "
                f"{adapter.target_modules!r:.80} do not name (PEFT would not apply them)"
            )
        in_features, out_features = shapes[projection]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or b.shape[1] != a.shape[0]:
            raise fail(
                f"{module}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit this model's "
                f"{in_features} inputs (made for another base model?)"
            )
        rank = a.shape[0]
        if rank > max_lora_rank:
            raise fail(f"{module} has rank {rank}, above max_lora_rank {max_lora_rank}")
        # NOTE: q, k, v (and gate, up) are row ranges of one fused projection here.
        rows = target.num_rows if target.num_rows is not None else out_features
        if b.shape[0] != rows:
            raise fail(
                f"{module}: B has {b.shape[0]} rows where this model's {module.rsplit('.', 1)[-1]} "
                f"has {rows} (made for another base model?)"
            )
        if rank != adapter.rank_of(module):
            raise fail(
                f"{module} has rank {rank}, but adapter_config.json gives it "
                f"r = {adapter.rank_of(module)}"
            )
        piece = LoraPiece(target.row_start, a.contiguous(), b * adapter.scaling(rank))
        pieces.setdefault(projection, []).append(piece)
    for projection_pieces in pieces.values():
        projection_pieces.sort(key=lambda piece: piece.row_start)
    return pieces


def _split_key(key: str) -> tuple[str, str | None]:
    """(checkpoint module name, "a" | "b" | None) of a PEFT tensor key."""
    name = key.removeprefix(_PEFT_PREFIX)
    for suffix, part in _LORA_SUFFIXES.items():
        if name.endswith(suffix):
            return name.removesuffix(suffix), part
    return name, None
